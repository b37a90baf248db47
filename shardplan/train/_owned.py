"""Multi-process checkpoints: the leaves that live on one process of several.

A pipelined plan run as several processes puts each stage's state leaves on one process (the
others hold placeholders with no shards). orbax's array handler refuses such arrays when
``jax.process_count() > 1`` (it takes them for host-local ``pmap`` arrays: "Cannot serialize
host local jax.Array"), so :class:`OwnedHandler` writes them instead, one ``.npy`` per leaf from
the process holding it, into the step's temporary folder like any orbax item (the step stays
atomic). Used by :mod:`shardplan.train.checkpoint`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from shardplan.runtime.pipeline import placeholder as runtime_placeholder

__all__ = ["OwnedHandler", "OwnedRestore", "OwnedSave", "here", "one_process", "placeholder"]


def processes(sharding: jax.sharding.Sharding) -> set[int]:
    """The processes that hold ``sharding``'s devices."""
    devices: set[Any] = sharding.device_set  # Any: the stubs lack Device.process_index
    return {int(d.process_index) for d in devices}


def one_process(leaf: Any) -> bool:
    """Whether ``leaf`` lives on one process of several (a pipeline stage's leaf): orbax
    refuses to write those (it takes them for host-local ``pmap`` arrays)."""
    if jax.process_count() == 1 or not isinstance(leaf, jax.Array):
        return False
    return len(processes(leaf.sharding)) == 1


def here(sharding: jax.sharding.Sharding) -> bool:
    """Whether this process holds any of ``sharding``'s devices."""
    return jax.process_index() in processes(sharding)


def placeholder(target: jax.ShapeDtypeStruct) -> jax.Array:
    """A leaf of other processes' devices: shape, dtype and sharding, no shards here."""
    return runtime_placeholder(target, target.sharding)


_BITS: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}
"""Unsigned integer dtypes by item size, to store any dtype's bits in ``.npy``."""


@dataclass
class OwnedSave(ocp.args.CheckpointArgs):
    """Leaves each held by one process: ``{file stem: array}`` (the same keys everywhere)."""

    arrays: dict[str, jax.Array]


@dataclass
class OwnedRestore(ocp.args.CheckpointArgs):
    """``{file stem: target}``; only targets with devices on this process are read."""

    targets: dict[str, jax.ShapeDtypeStruct]


class OwnedHandler(ocp.CheckpointHandler):
    """Writes each one-process leaf as ``<stem>.npy`` from the process that holds it.

    Used only in multi-process runs, for the leaves orbax's array handler refuses. The files go
    into the step's temporary folder like every other item, so the step stays atomic. Reading
    memory-maps the file and takes each local shard's slice, so any target layout works (the
    folder must be on a file system every process sees, as for orbax's own items).
    """

    def save(self, directory: Any, *args: Any, **kwargs: Any) -> None:
        arrays = (kwargs.get("args") or args[0]).arrays
        for stem, leaf in arrays.items():
            if leaf.is_fully_addressable and leaf.addressable_shards:  # held here
                data = np.asarray(leaf)
                # .npy cannot name ml_dtypes (bfloat16 reads back as void): store the bits as
                # unsigned integers of the same width; the target's dtype says what they are.
                data = data.view(_BITS.get(data.dtype.itemsize, data.dtype))
                with open(Path(directory) / f"{stem}.npy", "wb") as f:
                    np.save(f, data)

    def restore(self, directory: Any, *args: Any, **kwargs: Any) -> dict[str, jax.Array]:
        targets = (kwargs.get("args") or args[0]).targets
        out: dict[str, jax.Array] = {}
        for stem, target in targets.items():
            data = np.load(Path(directory) / f"{stem}.npy", mmap_mode="r")
            if data.shape != target.shape or data.dtype.itemsize != target.dtype.itemsize:
                raise ValueError(
                    f"{stem}.npy holds {data.dtype}{list(data.shape)}, "
                    f"not {target.dtype}{list(target.shape)}"
                )
            data = data.view(target.dtype)

            def shard(index: Any, data: np.ndarray = data) -> np.ndarray:
                return np.array(data[index])  # reads only this shard's slice

            out[stem] = jax.make_array_from_callback(
                target.shape, target.sharding, shard, dtype=target.dtype
            )
        return out
