"""Hand-written sharding rules for the reference models (what a user would write by hand).

Each rule maps a traced argument leaf (:class:`shardplan.trace.graph.Parameter`: key path,
role, shape, argument index) to a ``PartitionSpec``-like tuple, or None for replicated. They are
the baselines shardplan's planner is compared against, and the shardings the cost model is
checked with against XLA.
"""

from __future__ import annotations

from collections.abc import Callable

from shardplan.trace.graph import Parameter

__all__ = ["Rule", "data_parallel", "fsdp", "megatron", "with_batch"]

Rule = Callable[[Parameter], tuple | None]

_COLUMN = ("attn/q/kernel", "attn/k/kernel", "attn/v/kernel", "mlp/up/kernel",
           "mlp/gate/kernel")
_COLUMN_BIAS = ("attn/q/bias", "attn/k/bias", "attn/v/bias", "mlp/up/bias")
_ROW = ("attn/o/kernel", "mlp/down/kernel")


def data_parallel(p: Parameter) -> tuple | None:
    """Everything replicated (combine with :func:`with_batch`)."""
    return None


def megatron(axis: str) -> Rule:
    """Megatron-LM tensor parallelism on ``axis``: column-split q/k/v and MLP-in (gate, up),
    row-split attention-out and MLP-out; optimizer state follows its parameter; the rest
    (norms, embeddings, head) replicated."""

    def rule(p: Parameter) -> tuple | None:
        if p.arg_index != 0:
            return None
        path = p.param_path or p.path
        if any(k in path for k in _COLUMN):
            return (None, axis)
        if any(k in path for k in _ROW):
            return (axis, None)
        if any(k in path for k in _COLUMN_BIAS):
            return (axis,)
        return None

    return rule


def fsdp(axis: str, shards: int) -> Rule:
    """ZeRO-3 / FSDP: parameters and optimizer state split on their first dimension over
    ``axis`` (of ``shards`` devices) wherever it divides."""

    def rule(p: Parameter) -> tuple | None:
        if p.role in ("parameter", "optimizer_state") and p.shape and p.shape[0] % shards == 0:
            return (axis,)
        return None

    return rule


def with_batch(rule: Rule, axis: str | tuple[str, ...]) -> Rule:
    """``rule`` for the state, and the batch (argument 1) split on its first dimension."""

    def both(p: Parameter) -> tuple | None:
        return (axis,) if p.arg_index == 1 else rule(p)

    return both
