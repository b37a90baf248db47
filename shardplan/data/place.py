"""Batches as the planner and the devices see them: shape structs, and placed arrays.

A planned step (:func:`~shardplan.apply_plan`) places a numpy batch itself, with
``jax.device_put`` on the plan's batch shardings; :func:`place_batch` is for code that places
batches ahead of the step (to overlap the host-to-device copy with the previous step) or runs
several processes: every process computes the same global batch (``Dataset.train_batch(k)`` is a
function of ``(seed, k)``), and each copies only the rows its own devices hold. (With several
processes, ``jax.device_put`` of a host array first checks, with a collective across processes
on every call, that all processes passed the same value: ``multihost_utils.assert_equal`` in
jax 0.10's ``dispatch.py``. :func:`place_batch` relies on the batch being a function of the
step instead.)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from shardplan.data.config import DataConfig
from shardplan.data.dataset import Batch

__all__ = ["abstract_batch", "place_batch"]


def abstract_batch(config: DataConfig, /) -> dict[str, jax.ShapeDtypeStruct]:
    """The shape and dtype of a batch, for planning without data (``make_plan``).

    Example:
      >>> abstract_batch(DataConfig(seq_len=16, batch_size=4))["inputs"]
      ShapeDtypeStruct(shape=(4, 16), dtype=int32)
    """
    spec = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), np.int32)
    return {"inputs": spec, "targets": spec}


def place_batch(batch: Batch, shardings: Any, /) -> dict[str, jax.Array]:
    """A global numpy batch as ``jax.Array``s on ``shardings``, copying to each device only
    the slice it holds.

    Works in one process and in several (each passing the same global batch) without the
    cross-process equality check ``jax.device_put`` makes for host arrays.

    Args:
      batch: ``{"inputs": int32[batch, seq], "targets": int32[batch, seq]}`` (whole batch).
      shardings: one ``jax.sharding.Sharding`` for every leaf, or a pytree of them with the
        batch's structure (e.g. built from ``plan.batch_specs``).

    Returns:
      The batch as global arrays.

    Example:
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> batch = {"inputs": np.zeros((2, 4), np.int32), "targets": np.ones((2, 4), np.int32)}
      >>> place_batch(batch, NamedSharding(mesh, P("data")))["targets"].sharding.spec
      P('data',)
    """
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, batch)

    def place(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    placed: dict[str, jax.Array] = jax.tree.map(place, batch, shardings)
    return placed
