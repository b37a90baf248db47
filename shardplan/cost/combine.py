"""XLA's all-reduce combiner in the cost model: which partial sums share one call's start-up.

A collective call pays a start-up (:func:`shardplan.cost.collectives.startup_s`) whatever its
bytes. XLA does not issue one call per all-reduce of the partitioned program: its
``AllReduceCombiner`` pass merges all-reduces that do not depend on one another (same replica
groups and reduction) into one tuple-shaped call, up to a byte and an operand-count threshold
per call. The gradient all-reduces of data parallelism are such a set: the weight gradients of
every layer are independent of each other, and XLA sends them in a few large calls, not one
per parameter leaf. The tensor-parallel all-reduces of the forward and backward passes are
not: each feeds the next layer's matmuls, which feed the next all-reduce, so each is a call of
its own.

**Which partial sums combine** (:func:`combinable_ops`). The all-reduce of an op's partial sum
is *combinable* when nothing downstream of the op's results can be another partial-sum
reduction of the forward, backward or recompute phase: no op that reads them, directly or
through other ops, has a contracted (``reduce``) factor in its rule, except ops of the update
phase (optimizer arithmetic: a global gradient norm may reduce the gradients, and XLA still
combines the gradients' own all-reduces, which do not depend on each other). Weight and bias
gradients and the loss's mean over a sharded batch are combinable; a tensor-parallel
activation all-reduce is not. This looks only at the graph (what *may* be reduced under some
strategy), so it never calls an all-reduce combinable that a chosen plan makes dependent.

**What a combinable all-reduce pays** (:func:`startup_share`). Combined calls fill up to
``T`` bytes or :data:`COMBINE_THRESHOLD_COUNT` operands; an all-reduce of ``B`` bytes per
device is then ``max(B / T, 1 / count)`` of a call, capped at 1, and pays that share of the
start-up (its ring steps and bandwidth are unchanged: combining saves calls, not bytes). The
thresholds are XLA's: on GPU ``kDefaultAllReduceCombineThreshold`` = 30 MiB + 7 bytes
(``xla/service/collective_utils.h``, the default of
``--xla_gpu_all_reduce_combine_threshold_bytes``) and 256 operands; on XLA:CPU no byte limit
and 256 operands (measured here with jax 0.10.2: 6 gradients of 16 MiB go in one call of
96 MiB, 300 gradients of 16 KiB in two calls of 256 and 44 operands). Data parallelism of a
model whose gradients are many small leaves therefore pays about one start-up per 256 leaves,
as compiled, instead of one per leaf.

Example:
    >>> from shardplan.cluster import load_device
    >>> startup_share(32 * 2**20, load_device("a100-80g"))  # one full call and more: all of it
    1.0
    >>> round(startup_share(2**20, load_device("a100-80g")), 4)  # 1 MiB of a 30 MiB call
    0.0333
    >>> startup_share(2**20, load_device("cpu"))  # XLA:CPU: one 256th of a call
    0.00390625
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shardplan.cluster import DeviceSpec
from shardplan.cost.rules import OpRule, op_rule
from shardplan.trace.graph import OpGraph

__all__ = ["COMBINE_THRESHOLD_COUNT", "GPU_COMBINE_THRESHOLD_BYTES", "combinable_ops",
           "combine_threshold_bytes", "startup_share"]

GPU_COMBINE_THRESHOLD_BYTES = 30 * 2**20 + 7
"""XLA:GPU's default all-reduce combine threshold, bytes per combined call
(``kDefaultAllReduceCombineThreshold`` in ``xla/service/collective_utils.h``)."""

COMBINE_THRESHOLD_COUNT = 256
"""Operands per combined all-reduce call (XLA's combiner threshold count, GPU and CPU;
measured on XLA:CPU: 300 gradients compile to calls of 256 and 44)."""


def combine_threshold_bytes(device: DeviceSpec) -> float:
    """Bytes per combined all-reduce call on ``device``'s compiler: unlimited on XLA:CPU (a
    device whose ``device_kinds`` name ``cpu``), :data:`GPU_COMBINE_THRESHOLD_BYTES` else."""
    return math.inf if "cpu" in device.device_kinds else float(GPU_COMBINE_THRESHOLD_BYTES)


def startup_share(nbytes: float, device: DeviceSpec) -> float:
    """The share of a call's start-up that a combinable all-reduce of ``nbytes`` per device
    pays on ``device``: ``min(1, max(nbytes / T, 1 / COMBINE_THRESHOLD_COUNT))``."""
    return min(1.0, max(nbytes / combine_threshold_bytes(device), 1.0 / COMBINE_THRESHOLD_COUNT))


def combinable_ops(graph: OpGraph, rules: Sequence[OpRule] | None = None) -> frozenset[int]:
    """Ids of the ops whose partial-sum all-reduces XLA's combiner can merge with others
    (module docstring): ops with a contracted factor from whose results no contracting op of
    the forward, backward or recompute phase can be reached. One pass over the ops in reverse
    (repeated while a loop's carried values change the answer).

    Args:
      graph: the traced step.
      rules: per op, its :func:`~shardplan.cost.rules.op_rule` (computed when not given).
    """
    if rules is None:
        rules = [op_rule(graph, op) for op in graph.ops]
    reduces = [any(f.kind == "reduce" for f in rules[op.id].factors) for op in graph.ops]
    blocking = [reduces[op.id] and op.phase != "update" for op in graph.ops]
    consumers = graph.consumers
    # reaches[o]: a blocking op reads o's results, directly or through other ops. A loop's
    # carried values are read by ops listed before their writer, so the reverse pass repeats
    # until nothing changes (twice for a graph without loops).
    reaches = [False] * len(graph.ops)
    changed = True
    while changed:
        changed = False
        for op in reversed(graph.ops):
            if reaches[op.id]:
                continue
            if any(blocking[r] or reaches[r] for t in op.outputs for r in consumers[t]
                   if r != op.id):
                reaches[op.id] = changed = True
    return frozenset(op.id for op in graph.ops if reduces[op.id] and not reaches[op.id])
