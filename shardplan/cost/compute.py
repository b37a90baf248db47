"""Compute time of ops on a device type: a roofline with per-op-class efficiencies.

Pure functions of an :class:`~shardplan.trace.Op`, a :class:`~shardplan.cluster.DeviceSpec`
and a shard divisor (no jax). The roofline (Williams, Waterman & Patterson, "Roofline: an
insightful visual performance model for multicore architectures", CACM 2009) with the
catalog's derating factors::

    compute_s = flops / (peak[dtype] · eff[class]) + transcendentals / (peak[fp32] · eff[class])
    memory_s  = (bytes_read + bytes_written) / (hbm_bandwidth · eff.memory_bound)
    time_s    = max(compute_s, memory_s)

* ``class`` is :func:`op_class`: ``matmul``, ``attention`` or ``memory_bound`` (the catalog's
  efficiencies; a V100 runs attention far below its matmul rate, HeterMoE arXiv 2504.03871).
* ``dtype`` is the op's compute dtype (:func:`compute_dtype`); a device without it runs
  ``device.effective_dtype(dtype)`` (bf16 on a V100 runs as fp16), and :class:`OpTime` says so.
* Transcendentals (``exp``, ``tanh``, ``log`` ...) are counted as FLOPs at the fp32 rate: GPUs
  evaluate them on CUDA-core/SFU pipes, not tensor cores.
* Dividing FLOPs and bytes by the shard divisor models an op split evenly over devices.

Fusion is not inferred here: by default each op is charged its own operand and result bytes,
which over-charges chains of elementwise ops (an unfused softmax over ``[b, h, s, s]`` scores
is most of a GPT-1.3B step's memory-bound time that way); pass ``materialized`` (tensor id ->
kept in memory, e.g. from a fusion/liveness analysis) to charge only real buffers. Kernel launch
overheads are not modelled. Views that XLA lowers to bitcasts (:data:`VIEW_PRIMITIVES`) cost
nothing.

Example:
    >>> from shardplan.cluster import load_device
    >>> import jax, jax.numpy as jnp
    >>> from shardplan.trace import trace
    >>> g = trace(lambda w, x: x @ w, jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16),
    ...           jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16))
    >>> t = op_time_s(g.ops[0], load_device("a100-80g"), dtype="bf16")
    >>> t.bound, t.op_class, round(t.time_s * 1e6, 1)  # 2·4096³ / (312e12 · 0.75)
    ('compute', 'matmul', 587.3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable
from typing import Literal

from shardplan.cluster import DeviceSpec
from shardplan.cluster.device import canonical_dtype
from shardplan.errors import ClusterError
from shardplan.kernels.registry import PRIMITIVE as KERNEL
from shardplan.kernels.registry import rule_for
from shardplan.trace.graph import Op, OpGraph, Phase

__all__ = [
    "ATTENTION_MARKERS",
    "ATTENTION_MIN_BATCH_DIMS",
    "KERNEL_PRIMITIVES",
    "MATMUL_PRIMITIVES",
    "PASS_THROUGH_PRIMITIVES",
    "VIEW_PRIMITIVES",
    "Bound",
    "OpClass",
    "OpTime",
    "compute_dtype",
    "fp32_rate",
    "graph_compute_time_s",
    "op_class",
    "op_time_s",
    "op_times",
    "parameter_tensors",
    "with_materialized_bytes",
]

OpClass = Literal["matmul", "attention", "memory_bound"]
"""The op classes the device catalog has efficiencies for (compute-side)."""

Bound = Literal["compute", "memory"]
"""Which side of the roofline limits an op."""

MATMUL_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})
"""Primitives that run on matrix units (tensor cores)."""

KERNEL_PRIMITIVES = frozenset({"pallas_call", KERNEL})
"""Custom kernels: attention if their scope or source mentions :data:`ATTENTION_MARKERS`,
otherwise matmul (the project's kernels are flash attention and grouped matmul)."""

ATTENTION_MARKERS = ("attention", "flash", "attn")
"""Lower-case substrings of a kernel's scope or source that mark an attention kernel."""

ATTENTION_MIN_BATCH_DIMS = 2
"""A dot with at least this many batch dimensions (``[batch, heads]``) on both operands and no
parameter operand is attention: ``q·kᵀ`` (``bqhd,bkhd->bhqk``) and ``p·v`` and their
gradients. Projections (``x @ w``) have no batch dimension, MoE expert matmuls one."""

VIEW_PRIMITIVES = frozenset(
    {
        # bitcasts of a row-major layout
        "reshape",
        "squeeze",
        "expand_dims",
        "bitcast_convert_type",
        # no code at all
        "stop_gradient",
        "optimization_barrier",
        "pvary",
        "pcast",
        # no compute; the resharding they may cause is communication, costed apart
        "sharding_constraint",
        "device_put",
    }
)
"""Ops XLA lowers to bitcasts or removes: no kernel, no bytes moved."""

PASS_THROUGH_PRIMITIVES = VIEW_PRIMITIVES | {"convert_element_type", "transpose", "copy"}
"""Ops whose result is still "the parameter" for :func:`parameter_tensors` (a bf16 cast of a
weight, its transpose)."""

_DTYPE_WIDTH = {"fp8": 1, "bf16": 2, "fp16": 2, "tf32": 3, "fp32": 4}
"""Order of the catalog's dtypes from narrow to wide, to pick a dot's operand dtype."""


@dataclasses.dataclass(frozen=True)
class OpTime:
    """The roofline time of one execution of an op on a device.

    Attributes:
      time_s: ``max(compute_s, memory_s)``.
      dtype: the catalog dtype the device ran it in (after ``effective_dtype``).
      bound: ``compute`` or ``memory``, whichever term is larger.
      op_class: ``matmul``, ``attention`` or ``memory_bound``.
    """

    time_s: float
    dtype: str
    bound: Bound
    op_class: OpClass


# --------------------------------------------------------------------------------------------
# classification


def parameter_tensors(graph: OpGraph) -> frozenset[int]:
    """Ids of the trained parameters' tensors and of values that are still them.

    A parameter passed through :data:`PASS_THROUGH_PRIMITIVES` (a bf16 cast, a transpose) or a
    structural loop-slicing op (one layer of a scanned stack) still counts.
    """
    found = {p.tensor for p in graph.parameters if p.role == "parameter"}
    for op in graph.ops:  # program order is topological: one pass closes the set
        passes = op.structural or op.primitive in PASS_THROUGH_PRIMITIVES
        if passes and any(t in found for t in op.inputs):
            found.update(op.outputs)
    return frozenset(found)


def _is_attention_kernel(op: Op) -> bool:
    text = f"{op.scope} {op.source}".lower()
    return any(marker in text for marker in ATTENTION_MARKERS)


def op_class(op: Op, /, parameters: Collection[int] = frozenset()) -> OpClass:
    """The op class whose efficiency applies to ``op``.

    Rules (deliberately simple):

    * ``dot_general`` with at least :data:`ATTENTION_MIN_BATCH_DIMS` batch dimensions and no
      operand in ``parameters`` is ``attention`` (activation × activation per batch and head);
    * any other dot / convolution is ``matmul``;
    * a ``pallas_call`` is ``attention`` when its scope or source mentions attention
      (:data:`ATTENTION_MARKERS`), else ``matmul``;
    * everything else is ``memory_bound``.

    Args:
      op: the op.
      parameters: tensor ids that hold parameters (:func:`parameter_tensors`); empty: only the
        layout decides.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from shardplan.trace import trace
        >>> q = jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.float32)  # [batch, seq, heads, dim]
        >>> g = trace(lambda q: jnp.einsum("bqhd,bkhd->bhqk", q, q), q)
        >>> op_class(g.ops[0])
        'attention'
    """
    if op.primitive == KERNEL:  # a shardplan kernel: its registered class
        rule = rule_for(str(op.attrs.get("kernel", "")))
        return "attention" if rule is not None and rule.op_class == "attention" else "matmul"
    if op.primitive in KERNEL_PRIMITIVES:
        return "attention" if _is_attention_kernel(op) else "matmul"
    if op.primitive not in MATMUL_PRIMITIVES:
        return "memory_bound"
    batch_dims = min(len(op.attrs.get("lhs_batch", ())), len(op.attrs.get("rhs_batch", ())))
    if batch_dims >= ATTENTION_MIN_BATCH_DIMS and not any(t in parameters for t in op.inputs):
        return "attention"
    return "matmul"


def _float_key(dtype: str) -> str | None:
    """The catalog dtype of a floating dtype name; None for ints/bools; fp32 for float64."""
    try:
        return canonical_dtype(dtype)
    except ClusterError:
        # The catalog has no fp64 figures; float64 work is rare in training: cost it as fp32.
        return "fp32" if dtype.startswith(("float", "complex")) else None


def compute_dtype(op: Op, graph: OpGraph) -> str:
    """The catalog dtype ``op`` computes in.

    Dots and kernels: the widest operand dtype (a bf16 dot accumulating into fp32 runs on bf16
    tensor cores). Other ops: the output dtype; for a non-float output (a comparison) the
    widest float operand; integer-only work counts as fp32 (same ALU rate on GPUs).
    fp32 dots are costed as fp32, not TF32: pass ``dtype="tf32"`` to :func:`op_time_s` to
    model XLA's default-precision TF32 matmuls on Ampere and newer.
    """

    def keys(tensor_ids: Iterable[int]) -> list[str]:
        found = (_float_key(graph.tensors[t].dtype) for t in tensor_ids)
        return [k for k in found if k is not None]

    inputs = keys(op.inputs)
    if op.primitive in MATMUL_PRIMITIVES | KERNEL_PRIMITIVES and inputs:
        return max(inputs, key=_DTYPE_WIDTH.__getitem__)
    outputs = keys(op.outputs)
    if outputs:
        return max(outputs, key=_DTYPE_WIDTH.__getitem__)
    return max(inputs, key=_DTYPE_WIDTH.__getitem__) if inputs else "fp32"


# --------------------------------------------------------------------------------------------
# roofline


def fp32_rate(device: DeviceSpec, fallback_dtype: str) -> float:
    """FLOP/s ``device`` runs transcendentals at: its fp32 rate (``fallback_dtype``'s, the
    op's working dtype, where the spec has no fp32 figure)."""
    try:
        return device.flops_per_s("fp32")
    except ClusterError:  # an inline spec without fp32 or a fallback: its working dtype's rate
        return device.peak_flops_per_s[fallback_dtype]


def op_time_s(
    op: Op,
    device: DeviceSpec,
    *,
    dtype: str,
    flops_divisor: float = 1.0,
    bytes_divisor: float = 1.0,
    kind: OpClass | None = None,
) -> OpTime:
    """Roofline time of one execution of ``op`` on ``device`` (module docstring formula).

    Args:
      op: the op (per-execution ``flops``, ``transcendentals``, ``bytes_read/written``).
      device: the device type.
      dtype: the compute dtype (:func:`compute_dtype`; ``bfloat16`` or ``bf16`` style).
      flops_divisor: the op's FLOPs are split over this many devices (its shard divisor).
      bytes_divisor: the op's bytes are split over this many devices.
      kind: the op class; default :func:`op_class` from the layout alone.

    Returns:
      The time, the dtype the device ran, the bound and the class.

    Raises:
      ClusterError: ``dtype`` is not a float dtype of the catalog, or the device has neither
        it nor a fallback.
    """
    op_kind = kind if kind is not None else op_class(op)
    ran = device.effective_dtype(dtype)
    class_eff = getattr(device.efficiency, op_kind)
    flops = op.flops / flops_divisor
    compute_s = flops / (device.peak_flops_per_s[ran] * class_eff)
    if op.transcendentals:
        transcendentals = op.transcendentals / flops_divisor
        compute_s += transcendentals / (fp32_rate(device, ran) * class_eff)
    nbytes = (op.bytes_read + op.bytes_written) / bytes_divisor
    memory_s = nbytes / (device.hbm_bandwidth_bytes_per_s * device.efficiency.memory_bound)
    bound: Bound = "compute" if compute_s >= memory_s else "memory"
    return OpTime(max(compute_s, memory_s), ran, bound, op_kind)


def _costed(op: Op, phases: Collection[Phase] | None) -> bool:
    """Whether an op costs time: not a loop marker, a folded constant or a view."""
    if op.structural or op.attrs.get("folded") or op.primitive in VIEW_PRIMITIVES:
        return False
    return phases is None or op.phase in phases


def _share(tensor_ids: Iterable[int], graph: OpGraph, keep: Callable[[int], bool]) -> float:
    """The fraction of the bytes of ``tensor_ids`` that ``keep`` keeps (1 for none)."""
    sizes = [(graph.tensors[t].nbytes, keep(t)) for t in tensor_ids]
    total = sum(size for size, _ in sizes)
    return sum(size for size, kept in sizes if kept) / total if total else 1.0


def materialized_bytes(op: Op, graph: OpGraph,
                       materialized: Callable[[int], bool]) -> tuple[int, int]:
    """The bytes ``op`` reads and writes of the operands and results that live in device
    memory (:func:`with_materialized_bytes` without building the op)."""
    read = op.bytes_read * _share(op.inputs, graph, materialized)
    written = op.bytes_written * _share(op.outputs, graph, materialized)
    return round(read), round(written)


def with_materialized_bytes(op: Op, graph: OpGraph, materialized: Callable[[int], bool]) -> Op:
    """``op`` charged only for the operands and results that live in device memory."""
    read, written = materialized_bytes(op, graph, materialized)
    return dataclasses.replace(op, bytes_read=read, bytes_written=written)


def op_times(
    graph: OpGraph,
    device: DeviceSpec,
    *,
    divisor_of: Callable[[int], float] | None = None,
    phases: Collection[Phase] | None = None,
    materialized: Callable[[int], bool] | None = None,
) -> dict[int, OpTime]:
    """The roofline time of one execution of every costed op, keyed by op id.

    Structural loop markers, constant-folded ops and :data:`VIEW_PRIMITIVES` are left out.

    Args:
      graph: the traced graph.
      device: the device type every op runs on.
      divisor_of: op id -> shard divisor of its FLOPs and bytes (default 1: unsharded).
      phases: only ops of these phases (default all).
      materialized: tensor id -> whether XLA keeps the tensor in device memory; operands and
        results it fuses away are not charged (each op's bytes are scaled by the materialized
        share). Default: every tensor is materialized (no fusion), an upper bound that
        over-charges chains of elementwise ops such as an unfused softmax.
    """
    params = parameter_tensors(graph)
    out: dict[int, OpTime] = {}
    for op in graph.ops:
        if not _costed(op, phases):
            continue
        divisor = 1.0 if divisor_of is None else float(divisor_of(op.id))
        if materialized is not None:
            op = with_materialized_bytes(op, graph, materialized)
        out[op.id] = op_time_s(
            op,
            device,
            dtype=compute_dtype(op, graph),
            flops_divisor=divisor,
            bytes_divisor=divisor,
            kind=op_class(op, params),
        )
    return out


def graph_compute_time_s(
    graph: OpGraph,
    device: DeviceSpec,
    *,
    divisor_of: Callable[[int], float] | None = None,
    phases: Collection[Phase] | None = None,
    materialized: Callable[[int], bool] | None = None,
) -> float:
    """Sum of ``op_time_s × op.count`` over the costed ops (see :func:`op_times` for the
    arguments).

    Ops run one after another (no overlap between ops, no fusion): the sum is the serial
    compute time of one call of the traced function on one device.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from shardplan.cluster import load_device
        >>> from shardplan.trace import trace
        >>> g = trace(lambda w, x: x @ w, jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16),
        ...           jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16))
        >>> a100 = load_device("a100-80g")
        >>> whole = graph_compute_time_s(g, a100)
        >>> round(graph_compute_time_s(g, a100, divisor_of=lambda _: 8) / whole, 3)
        0.125
    """
    times = op_times(graph, device, divisor_of=divisor_of, phases=phases, materialized=materialized)
    return sum(t.time_s * graph.ops[op_id].count for op_id, t in times.items())
