"""What every process of a multi-process run needs to agree on, and how it gets there.

Under ``shardplan launch`` (or any ``jax.distributed`` job) every process runs the same
training loop. A pipelined plan leaves each stage's values on the process that holds the
stage's devices (the others hold placeholders without shards), so values the loop reads on the
host — the loss, the state for evaluation and sampling — are first brought to every process
(:func:`everywhere`), and the plan, solved once, is sent from process 0 (:func:`from_main`) so
that every process runs the same one. Only process 0 writes the run directory's files and
prints (:func:`is_main`).

Everything goes through :func:`jax.experimental.multihost_utils.broadcast_one_to_all` (a sum
over all devices with zeros from every process but the source). Leaves travel as their bytes
(``uint8``: jax without x64 has no 8-byte integers), so the sum is exact for any dtype (NaN
payloads and -0.0 too).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from shardplan.errors import RuntimeFailure, format_error

__all__ = ["everywhere", "from_main", "is_main"]

def is_main() -> bool:
    """Whether this is the process that writes the run's files and prints (process 0)."""
    return jax.process_index() == 0


def _broadcast(arrays: list[np.ndarray], source: bool) -> list[np.ndarray]:
    """``arrays`` of the source process on every process (others pass arrays of the same
    shapes and dtypes; their values are ignored)."""
    raw = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) if source
           else np.zeros(a.size * a.dtype.itemsize, np.uint8) for a in arrays]
    got = multihost_utils.broadcast_one_to_all(raw, is_source=source)
    return [np.asarray(g, np.uint8).view(a.dtype).reshape(a.shape)
            for g, a in zip(got, arrays, strict=True)]


def from_main(data: bytes | None) -> bytes:
    """Process 0's ``data`` on every process (the others pass ``None``)."""
    if jax.process_count() == 1:
        assert data is not None
        return data
    source = is_main()
    size = np.array([len(data) if source and data is not None else 0], np.int64)
    (size,) = _broadcast([size], source)
    payload = (np.frombuffer(data, np.uint8) if source and data is not None
               else np.zeros(int(size[0]), np.uint8))
    (payload,) = _broadcast([payload], source)
    return payload.tobytes()


def _processes(x: jax.Array) -> list[int]:
    devices: set[Any] = x.sharding.device_set  # Any: the stubs lack Device.process_index
    return sorted({int(d.process_index) for d in devices})


def everywhere(tree: Any) -> Any:
    """``tree`` with every array leaf as a numpy array on every process, whichever processes
    hold it: a leaf of one process (a pipeline stage's) or a replicated one is sent from the
    first process holding it, a leaf sharded over every device is gathered. Every process
    must call it with a tree of the same structure and shardings.

    Raises:
      RuntimeFailure: a leaf is sharded over the devices of some processes but not all (no
        plan shardplan makes does that), or it is a PRNG key array.
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)
    leaves, treedef = jax.tree.flatten(tree)
    out: list[Any] = list(leaves)
    sources: dict[int, list[int]] = {}  # process -> the leaves it sends
    everyone = set(jax.devices())
    for i, x in enumerate(leaves):
        if not isinstance(x, jax.Array):
            out[i] = np.asarray(x)
            continue
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            raise RuntimeFailure(format_error(
                "A value of this dtype cannot be brought to every process.",
                where=f"leaf {i} of {treedef}", value=str(x.dtype),
                remedy="keep PRNG keys out of the values the training loop reads (use "
                       "jax.random.key_data)"))
        processes = _processes(x)
        if x.is_fully_replicated or len(processes) == 1:
            sources.setdefault(processes[0], []).append(i)
        elif set(x.sharding.device_set) == everyone:
            out[i] = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        else:
            raise RuntimeFailure(format_error(
                "A value is sharded over some processes' devices but not all, so it cannot "
                "be gathered.", where=f"leaf {i} of {treedef}", value=processes,
                remedy="run plans whose stages each sit on one process, or whose meshes span "
                       "all of them"))
    me = jax.process_index()
    for p in sorted(sources):
        idx = sources[p]
        local = [np.asarray(leaves[i]) if p == me and leaves[i].is_fully_addressable
                 else np.asarray(leaves[i].addressable_data(0)) if p == me
                 else np.zeros(leaves[i].shape, leaves[i].dtype) for i in idx]
        for i, value in zip(idx, _broadcast(local, p == me), strict=True):
            out[i] = value
    return jax.tree.unflatten(treedef, out)
