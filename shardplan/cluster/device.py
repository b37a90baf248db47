"""What one accelerator type can do: :class:`DeviceSpec`, its efficiencies, dtype names.

Peak figures are dense (no 2:4 sparsity). A dtype the device lacks is absent from
``peak_flops_per_s``; work in that dtype runs as ``fallback_dtype`` (``tf32`` without TF32
tensor cores runs as ``fp32``). The figures themselves are data, in ``configs/devices/*.yaml``
(see :mod:`shardplan.cluster.catalog`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardplan._schema import FrozenMap, Where
from shardplan.cluster._schema import as_float, as_int, fail
from shardplan.cluster.link import Link
from shardplan.errors import ClusterError, format_error

__all__ = [
    "DEFAULT_INLINE_EFFICIENCY",
    "DTYPES",
    "DeviceSpec",
    "Efficiency",
    "canonical_dtype",
]

DTYPES = ("fp8", "bf16", "fp16", "tf32", "fp32")
"""The dtype keys of ``peak_flops_per_s``; ``tf32`` is fp32 matmul on TF32 tensor cores."""

_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "float32": "fp32",
    "f32": "fp32",
    "float": "fp32",
    "tensorfloat32": "tf32",
}


def canonical_dtype(dtype: str) -> str:
    """Maps a dtype name (``"bfloat16"``, ``"float8_e4m3fn"``, ``"fp16"``) to a :data:`DTYPES` key.

    Args:
      dtype: a shardplan key, a numpy/jax dtype name (``x.dtype.name``) or a common alias.

    Returns:
      One of :data:`DTYPES`.

    Raises:
      ClusterError: the name is not a floating-point dtype the catalog has figures for.
    """
    name = str(dtype).strip().lower()
    if name in DTYPES:
        return name
    if name in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[name]
    if name.startswith(("float8", "fp8", "f8")):
        return "fp8"
    raise ClusterError(
        format_error(
            f"no peak FLOP/s figures exist for dtype {dtype!r}",
            where="dtype",
            value=dtype,
            remedy=f"use one of {', '.join(DTYPES)} (or bfloat16, float16, float32, float8_*)",
        )
    )


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of peak an op class reaches on a device (the cost model's derating factors).

    Attributes:
      matmul: achieved / peak FLOP/s on large dense matmuls.
      attention: achieved / peak FLOP/s on attention (fused kernels where the device has them).
      memory_bound: achieved / peak HBM bandwidth on elementwise and reduction ops.
      collective: achieved / nominal link bandwidth for collectives (NCCL bus bandwidth).
    """

    matmul: float
    attention: float
    memory_bound: float
    collective: float

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            where = Where(path=f"efficiency.{field.name}")
            as_float(value, where, what="an efficiency (fraction of peak)")
            if value > 1:
                raise fail(
                    where,
                    "an efficiency is a fraction of peak and cannot exceed 1",
                    value,
                    "use a value in (0, 1], e.g. 0.75 for 75 % of peak",
                )

    def to_dict(self) -> dict[str, float]:
        """The YAML form."""
        return dataclasses.asdict(self)


DEFAULT_INLINE_EFFICIENCY = Efficiency(matmul=0.5, attention=0.35, memory_bound=0.7, collective=0.7)
"""Efficiencies assumed for an inline device spec that gives none.

estimate: deliberately below the catalog's measured-or-published values for current GPUs
(0.75-0.8 matmul) so that an unknown device is not planned as if it were well tuned;
``shardplan calibrate`` replaces them with measurements.
"""


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator type's figures, as read from the catalog or an inline spec.

    Attributes:
      name: catalog name (``a100-80g``) or the inline spec's name.
      vendor: ``nvidia``, ``generic``, ...
      peak_flops_per_s: dtype key (:data:`DTYPES`) -> dense peak FLOP/s; absent = unsupported.
      memory_bytes: device memory in bytes (datasheet GB read as 10^9 bytes).
      hbm_bandwidth_bytes_per_s: device-memory bandwidth in bytes/s.
      efficiency: per-op-class fractions of peak.
      fallback_dtype: the dtype work in an absent dtype runs as (``fp16`` for bf16 on V100).
      price_per_hour_usd: on-demand price of one device-hour, if known.
      intra_node_link: the usual link between two such devices in one node.
      inter_node_link: the usual per-device link between nodes of such devices.
      device_kinds: ``jax.Device.device_kind`` strings that identify this type.
      description: free text.
      sources: field path (``peak_flops_per_s.bf16``) -> citation of that figure.
    """

    name: str
    vendor: str
    peak_flops_per_s: Mapping[str, float]
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    efficiency: Efficiency = DEFAULT_INLINE_EFFICIENCY
    fallback_dtype: str | None = None
    price_per_hour_usd: float | None = None
    intra_node_link: Link | None = None
    inter_node_link: Link | None = None
    device_kinds: tuple[str, ...] = ()
    description: str = ""
    sources: Mapping[str, str] = dataclasses.field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        where = Where(path=f"DeviceSpec({self.name!r})")
        peak = FrozenMap(
            {canonical_dtype(k): float(v) for k, v in self.peak_flops_per_s.items()}, sort=False
        )
        if not peak:
            raise fail(
                where.key("peak_flops_per_s"),
                "a device needs at least one peak figure",
                dict(self.peak_flops_per_s),
                "give e.g. {bf16: 312e12, fp32: 19.5e12}",
            )
        for dtype, flops in peak.items():
            as_float(flops, where.key(f"peak_flops_per_s.{dtype}"), what="a peak FLOP/s figure")
        as_int(self.memory_bytes, where.key("memory_bytes"), what="memory in bytes")
        as_float(
            self.hbm_bandwidth_bytes_per_s,
            where.key("hbm_bandwidth_bytes_per_s"),
            what="a memory bandwidth in bytes/s",
        )
        if self.fallback_dtype is not None and self.fallback_dtype not in peak:
            raise fail(
                where.key("fallback_dtype"),
                "fallback_dtype must be a dtype the device has a peak figure for",
                self.fallback_dtype,
                f"use one of {', '.join(peak)}",
            )
        if self.price_per_hour_usd is not None:
            as_float(
                self.price_per_hour_usd,
                where.key("price_per_hour_usd"),
                what="a price in USD per hour",
                allow_minimum=True,
            )
        object.__setattr__(self, "peak_flops_per_s", peak)
        object.__setattr__(self, "memory_bytes", int(self.memory_bytes))
        object.__setattr__(self, "device_kinds", tuple(self.device_kinds))
        object.__setattr__(self, "sources", FrozenMap(self.sources, sort=False))

    def effective_dtype(self, dtype: str) -> str:
        """The dtype this device actually runs work of ``dtype`` in.

        Args:
          dtype: a dtype name (see :func:`canonical_dtype`).

        Returns:
          ``dtype``'s key if the device has a figure for it; ``fp32`` for ``tf32`` on a device
          without TF32 tensor cores; else ``fallback_dtype``.

        Raises:
          ClusterError: the device has neither the dtype nor a fallback.
        """
        key = canonical_dtype(dtype)
        if key in self.peak_flops_per_s:
            return key
        if key == "tf32" and "fp32" in self.peak_flops_per_s:
            return "fp32"  # TF32 is a matmul mode of fp32; without the tensor cores it is fp32.
        if self.fallback_dtype is not None:
            return self.fallback_dtype
        raise ClusterError(
            format_error(
                f"device {self.name!r} has no {key} peak figure and no fallback_dtype",
                where=f"device {self.name!r}: peak_flops_per_s",
                value=dtype,
                remedy=f"compute in one of {', '.join(self.peak_flops_per_s)}, or add "
                f"peak_flops_per_s.{key} or fallback_dtype to its spec "
                f"(configs/devices/{self.name}.yaml for a catalog device)",
            )
        )

    def flops_per_s(self, dtype: str) -> float:
        """Dense peak FLOP/s for work in ``dtype`` (after :meth:`effective_dtype`).

        Example:
            >>> from shardplan.cluster import load_device
            >>> load_device("t4").flops_per_s("bf16")  # T4 has no bf16: runs fp16
            65000000000000.0
        """
        return self.peak_flops_per_s[self.effective_dtype(dtype)]

    def to_dict(self) -> dict[str, Any]:
        """The YAML form (an inline spec that :func:`load_device` reads back to an equal value)."""
        out: dict[str, Any] = {
            "name": self.name,
            "vendor": self.vendor,
            "peak_flops_per_s": dict(self.peak_flops_per_s),
            "memory_bytes": self.memory_bytes,
            "hbm_bandwidth_bytes_per_s": self.hbm_bandwidth_bytes_per_s,
            "efficiency": self.efficiency.to_dict(),
            "fallback_dtype": self.fallback_dtype,
            "price_per_hour_usd": self.price_per_hour_usd,
        }
        if self.intra_node_link is not None:
            out["intra_node_link"] = self.intra_node_link.to_dict()
        if self.inter_node_link is not None:
            out["inter_node_link"] = self.inter_node_link.to_dict()
        if self.device_kinds:
            out["device_kinds"] = list(self.device_kinds)
        if self.description:
            out["description"] = self.description
        if self.sources:
            out["source"] = dict(self.sources)
        return out
