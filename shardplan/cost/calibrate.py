"""Calibration: micro-benchmarks on the local devices, fitted to the catalog's efficiencies.

``shardplan calibrate`` (or :func:`calibrate` + :func:`write_device_yaml`) measures, on the
devices jax sees:

* **matmul**: square ``n×n @ n×n`` products at a few sizes, in the device's fastest dtype of
  bf16 / fp16 / fp32 (``2·n³`` FLOPs); ``efficiency.matmul`` = best achieved / peak.
* **attention**: ``softmax(q·kᵀ/√d)·v`` on ``[batch, heads, seq, head_dim]``, FLOPs by the
  FlashAttention convention ``4·batch·heads·seq²·head_dim`` (Dao 2023; softmax not counted);
  ``efficiency.attention`` = achieved / peak.
* **memory**: ``y = x · s`` on a large fp32 array, ``2·|x|`` bytes moved;
  ``efficiency.memory_bound`` = achieved / ``hbm_bandwidth_bytes_per_s``.
* **collectives** (with ≥ 2 devices of the type): ``psum`` at two message sizes and an
  ``all_gather`` through ``jax.shard_map`` over a 1-D mesh of those devices. The ring model
  with its start-up, ``t = (4 + 2(n−1))·α + 2(n−1)/n · B/bw`` (α0 = 4·α, see
  :mod:`shardplan.cost.collectives`), is solved for α and bw from the two sizes;
  ``efficiency.collective`` = fitted bw / the catalog's nominal ``intra_node_link``
  bandwidth, and the link's latency becomes the fitted per-step α.

Each benchmark is the median of ``repeats`` timed runs after ``warmup`` runs, every run ended
by ``block_until_ready``. Efficiencies are clipped to (0, 1] (a figure above 1 means the
catalog's peak is too low; the source string keeps the raw ratio). Datasheet figures (peaks,
HBM size and bandwidth, nominal link bandwidth) are kept from the catalog entry the run started
from; every changed figure gets a ``source:`` of the form
``measured: <what>, <date>, jax <version>, <device_kind>``.

Nothing runs on import.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from shardplan.cluster import Cluster, DeviceSpec, Efficiency, Link, load_device
from shardplan.cluster.catalog import DEVICE_KEYS
from shardplan.cost.collectives import STARTUP_STEPS
from shardplan.errors import ClusterError, format_error

__all__ = [
    "ACCELERATOR_SIZES",
    "CPU_SIZES",
    "MIN_EFFICIENCY",
    "QUICK_SIZES",
    "BenchSizes",
    "Calibration",
    "Measurement",
    "bench_all_gather",
    "bench_attention",
    "bench_copy",
    "bench_matmul",
    "bench_psum",
    "calibrate",
    "fit_ring_link",
    "median_time_s",
    "write_device_yaml",
]

MIN_EFFICIENCY = 1e-4
"""Lower clip of a measured efficiency: the catalog requires a positive fraction of peak."""

_BENCH_DTYPES = ("bf16", "fp16", "fp32")
"""Candidate dtypes for the compute benchmarks, preferred in this order at equal peak."""

_JNP_DTYPES: Mapping[str, Any] = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}

_FP32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class BenchSizes:
    """Problem sizes and repetitions of one calibration run.

    Attributes:
      matmul_n: square matmul sizes n (``n×n @ n×n``).
      attention: ``(batch, heads, seq, head_dim)`` of the attention benchmark.
      copy_bytes: bytes of the array the memory benchmark scales.
      collective_bytes: ``(small, large)`` per-device psum buffer sizes for the α-β fit.
      repeats: timed runs per benchmark (the median is kept).
      warmup: untimed runs first (compilation, caches).
    """

    matmul_n: tuple[int, ...]
    attention: tuple[int, int, int, int]
    copy_bytes: int
    collective_bytes: tuple[int, int]
    repeats: int
    warmup: int


QUICK_SIZES = BenchSizes(
    matmul_n=(128, 256, 512),
    attention=(2, 4, 256, 64),
    copy_bytes=16 * 2**20,
    collective_bytes=(16 * 2**10, 2 * 2**20),
    repeats=5,
    warmup=2,
)
"""``--quick``: seconds on a CPU; too small to load a GPU fully (efficiencies come out low)."""

CPU_SIZES = BenchSizes(
    matmul_n=(512, 1024, 2048),
    attention=(4, 8, 512, 64),
    copy_bytes=128 * 2**20,
    collective_bytes=(64 * 2**10, 16 * 2**20),
    repeats=10,
    warmup=3,
)
"""A full run on CPU devices (about a minute)."""

ACCELERATOR_SIZES = BenchSizes(
    matmul_n=(2048, 4096, 8192),
    attention=(8, 16, 2048, 128),
    copy_bytes=2 * 2**30,
    collective_bytes=(2**20, 256 * 2**20),
    repeats=20,
    warmup=5,
)
"""A full run on GPUs: training-sized shapes (8192³ bf16 reaches ~80 % of peak on an H200)."""


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One benchmark's result.

    Attributes:
      what: what was run, e.g. ``"matmul 512^3 fp32"``.
      time_s: median seconds per run.
      rate: achieved FLOP/s (compute) or bytes/s (memory, collectives).
      unit: ``"FLOP/s"`` or ``"bytes/s"``.
    """

    what: str
    time_s: float
    rate: float
    unit: str

    def describe(self) -> str:
        """``"matmul 512^3 fp32: 1.23 ms, 218 GFLOP/s"``."""
        unit = "GB/s" if self.unit == "bytes/s" else f"G{self.unit}"
        return f"{self.what}: {self.time_s * 1e3:.4g} ms, {self.rate / 1e9:.4g} {unit}"


# --------------------------------------------------------------------------------------------
# timing and fitting


def median_time_s(fn: Callable[..., Any], *args: Any, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn(*args)``, each run waited for with ``block_until_ready``.

    Args:
      fn: a (jitted) function.
      *args: its arguments, already on the device.
      repeats: timed runs.
      warmup: untimed runs first (the first one compiles).
    """
    for _ in range(max(warmup, 1)):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit_ring_link(
    n: int, small_bytes: float, small_s: float, large_bytes: float, large_s: float
) -> Link:
    """Solves the ring all-reduce model ``t = α0 + 2(n−1)·α + 2(n−1)/n · B/bw`` for α and bw.

    The start-up is α0 = ``STARTUP_STEPS``·α (:func:`~shardplan.cost.collectives.startup_s`),
    so the latency part is ``(4 + 2(n−1))·α``: the one group size measured cannot tell α0 and
    α apart, and the fit keeps their ratio fixed. Two measurements (B₁, t₁), (B₂, t₂) give the
    slope ``2(n−1)/(n·bw) = (t₂−t₁)/(B₂−B₁)`` and then α from the small one. When noise makes
    the slope non-positive, bw comes from the large message alone (α taken as 0 there) and α
    from the small one. α is clipped at 0.

    Args:
      n: devices in the ring (≥ 2).
      small_bytes: B₁, per-device buffer of the small all-reduce.
      small_s: t₁, its time.
      large_bytes: B₂ > B₁.
      large_s: t₂.

    Returns:
      The fitted link: bandwidth per direction per device, per-step latency α.

    Example:
        >>> from shardplan.cost.collectives import ring_all_reduce_s
        >>> ring_s = lambda b: ring_all_reduce_s(8, b, Link(300e9, 2e-6))  # (4 + 14)·2 µs + ...
        >>> link = fit_ring_link(8, 1e6, ring_s(1e6), 1e9, ring_s(1e9))
        >>> round(link.bandwidth_bytes_per_s / 1e9, 3), round(link.latency_s * 1e6, 3)
        (300.0, 2.0)
    """
    steps = 2 * (n - 1)
    latencies = STARTUP_STEPS + steps  # α0 + 2(n−1)·α, in α
    bytes_factor = steps / n  # 2(n−1)/n
    slope = (large_s - small_s) / (large_bytes - small_bytes)
    bandwidth = bytes_factor / slope if slope > 0 else bytes_factor * large_bytes / large_s
    latency = (small_s - bytes_factor * small_bytes / bandwidth) / latencies
    return Link(bandwidth, max(latency, 0.0))


def _clip(efficiency: float) -> float:
    return min(max(efficiency, MIN_EFFICIENCY), 1.0)


# --------------------------------------------------------------------------------------------
# benchmarks


def _on(device: Any, shape: tuple[int, ...], dtype: Any, seed: int) -> Any:
    values = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return jax.device_put(jnp.asarray(values, dtype=dtype), device)


def bench_matmul(device: Any, n: int, dtype: str, sizes: BenchSizes) -> Measurement:
    """``n×n @ n×n`` in ``dtype`` on ``device``: ``2·n³`` FLOPs per run."""
    a = _on(device, (n, n), _JNP_DTYPES[dtype], 0)
    b = _on(device, (n, n), _JNP_DTYPES[dtype], 1)
    t = median_time_s(jax.jit(jnp.matmul), a, b, repeats=sizes.repeats, warmup=sizes.warmup)
    return Measurement(f"matmul {n}^3 {dtype}", t, 2 * n**3 / t, "FLOP/s")


def _attention(q: Any, k: Any, v: Any) -> Any:
    # q, k, v: [batch, heads, seq, head_dim]
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])  # [b, h, seq, seq]
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", probs, v)  # [batch, heads, seq, head_dim]


def bench_attention(device: Any, dtype: str, sizes: BenchSizes) -> Measurement:
    """Unfused softmax attention: ``4·batch·heads·seq²·head_dim`` FLOPs (FlashAttention's
    forward convention, softmax not counted)."""
    batch, heads, seq, head_dim = sizes.attention
    shape = (batch, heads, seq, head_dim)
    q, k, v = (_on(device, shape, _JNP_DTYPES[dtype], s) for s in (2, 3, 4))
    t = median_time_s(jax.jit(_attention), q, k, v, repeats=sizes.repeats, warmup=sizes.warmup)
    flops = 4 * batch * heads * seq**2 * head_dim
    return Measurement(
        f"attention {batch}x{heads}x{seq}x{head_dim} {dtype}", t, flops / t, "FLOP/s"
    )


def bench_copy(device: Any, sizes: BenchSizes) -> Measurement:
    """``y = x · s`` on an fp32 array of ``copy_bytes``: reads and writes it (2× its bytes)."""
    x = _on(device, (sizes.copy_bytes // _FP32_BYTES,), jnp.float32, 5)
    scale = jax.device_put(jnp.float32(1.0001), device)
    t = median_time_s(jax.jit(jnp.multiply), x, scale, repeats=sizes.repeats, warmup=sizes.warmup)
    return Measurement(
        f"scale {sizes.copy_bytes / 2**20:g} MiB fp32", t, 2 * sizes.copy_bytes / t, "bytes/s"
    )


def _mesh_input(devices: Sequence[Any], per_device_bytes: int) -> tuple[Any, Any]:
    """A 1-D mesh over ``devices`` and an fp32 array with ``per_device_bytes`` on each."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((len(devices),), ("x",), (AxisType.Explicit,), devices=devices)
    elements = len(devices) * max(per_device_bytes // _FP32_BYTES, 1)
    x = jax.device_put(jnp.ones((elements,), jnp.float32), NamedSharding(mesh, PartitionSpec("x")))
    return mesh, x


def bench_psum(devices: Sequence[Any], per_device_bytes: int, sizes: BenchSizes) -> Measurement:
    """All-reduce (``psum`` in ``shard_map``) of ``per_device_bytes`` on each device; the rate
    is the ring's *bus bandwidth* ``2(n−1)/n · B / t`` (NCCL-tests' busbw)."""
    from jax.sharding import PartitionSpec

    mesh, x = _mesh_input(devices, per_device_bytes)
    fn = jax.jit(
        jax.shard_map(
            lambda a: jax.lax.psum(a, "x"),
            mesh=mesh,
            in_specs=PartitionSpec("x"),
            out_specs=PartitionSpec(),
        )
    )
    t = median_time_s(fn, x, repeats=sizes.repeats, warmup=sizes.warmup)
    n = len(devices)
    nbytes = x.nbytes // n
    return Measurement(
        f"psum {nbytes / 2**10:g} KiB x {n} devices", t, 2 * (n - 1) / n * nbytes / t, "bytes/s"
    )


def bench_all_gather(
    devices: Sequence[Any], per_device_bytes: int, sizes: BenchSizes
) -> Measurement:
    """All-gather of ``per_device_bytes`` shards into ``n·per_device_bytes`` on each device;
    rate = bus bandwidth ``(n−1)/n · B / t`` with B the gathered size."""
    from jax.sharding import PartitionSpec

    mesh, x = _mesh_input(devices, per_device_bytes)
    # out_specs P("x"): each device's gathered copy stays its own block of the global result.
    fn = jax.jit(
        jax.shard_map(
            lambda a: jax.lax.all_gather(a, "x", tiled=True),
            mesh=mesh,
            in_specs=PartitionSpec("x"),
            out_specs=PartitionSpec("x"),
        )
    )
    t = median_time_s(fn, x, repeats=sizes.repeats, warmup=sizes.warmup)
    n = len(devices)
    gathered = x.nbytes
    return Measurement(
        f"all_gather to {gathered / 2**10:g} KiB x {n} devices",
        t,
        (n - 1) / n * gathered / t,
        "bytes/s",
    )


# --------------------------------------------------------------------------------------------
# the calibration


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The outcome of :func:`calibrate`: new efficiencies and link latency for one device type.

    Attributes:
      base: the catalog entry (or ``--device`` override) the run started from.
      device_kind: ``jax.Device.device_kind`` of the measured devices.
      num_devices: devices of that type the collectives ran over (1: none ran).
      dtype: the dtype of the compute benchmarks.
      efficiency: the fitted efficiencies (kept from ``base`` where nothing was measured).
      intra_node_link: the link with the fitted latency and the nominal bandwidth.
      measurements: every benchmark, in the order run.
      sources: the ``source:`` entries of the changed figures.
    """

    base: DeviceSpec
    device_kind: str
    num_devices: int
    dtype: str
    efficiency: Efficiency
    intra_node_link: Link | None
    measurements: tuple[Measurement, ...]
    sources: Mapping[str, str]

    def device_spec(self) -> DeviceSpec:
        """``base`` with the calibrated efficiencies, link and sources."""
        return dataclasses.replace(
            self.base,
            efficiency=self.efficiency,
            intra_node_link=self.intra_node_link,
            sources={**self.base.sources, **self.sources},
        )

    def to_yaml_dict(self) -> dict[str, Any]:
        """The device in the catalog's YAML schema and key order (``configs/devices/*.yaml``)."""
        d = self.device_spec().to_dict()
        return {k: d[k] for k in DEVICE_KEYS if d.get(k) is not None}

    def summary(self) -> str:
        """Lines for a terminal: each measurement, then each efficiency before -> after."""
        lines = [
            f"calibrated {self.base.name} on {self.num_devices} x {self.device_kind} "
            f"({self.dtype} compute)"
        ]
        lines += [f"  {m.describe()}" for m in self.measurements]
        before, after = self.base.efficiency.to_dict(), self.efficiency.to_dict()
        lines += [f"  efficiency.{k}: {before[k]:g} -> {after[k]:g}" for k in after]
        if self.num_devices < 2:
            lines.append("  collectives: not measured (one device of this type)")
        elif self.intra_node_link is not None and self.base.intra_node_link is not None:
            was, now = self.base.intra_node_link.latency_s, self.intra_node_link.latency_s
            lines.append(f"  intra_node_link.latency_us: {was * 1e6:g} -> {now * 1e6:.3g}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Stamp:
    """Writes ``measured: <what>, <date>, jax <version>, <device_kind>`` source strings."""

    date: str
    jax_version: str
    device_kind: str

    def source(self, what: str) -> str:
        return f"measured: {what}, {self.date}, jax {self.jax_version}, {self.device_kind}"


def _bench_dtype(spec: DeviceSpec) -> str:
    """The fastest of bf16 / fp16 / fp32 the device has a peak for (earlier wins ties)."""
    have = [d for d in _BENCH_DTYPES if d in spec.peak_flops_per_s]
    if not have:
        raise ClusterError(
            format_error(
                f"device {spec.name!r} has no bf16, fp16 or fp32 peak to calibrate against",
                where=f"device {spec.name!r}: peak_flops_per_s",
                value=dict(spec.peak_flops_per_s),
                remedy="add a bf16, fp16 or fp32 peak to its spec",
            )
        )
    return max(have, key=lambda d: (spec.peak_flops_per_s[d], -_BENCH_DTYPES.index(d)))


def _target(device: str | None, devices: Sequence[Any]) -> tuple[DeviceSpec, list[Any]]:
    """The catalog entry to start from and the local devices of that type."""
    if device is None:
        group = Cluster.local(devices).groups[0]
        return group.device, [devices[i] for i in group.device_ids]
    kind = devices[0].device_kind
    return load_device(device), [d for d in devices if d.device_kind == kind]


def _ratio_text(rate: float, peak: float, unit: str) -> str:
    ratio = rate / peak
    clipped = f" clipped to {_clip(ratio):.4g}" if _clip(ratio) != ratio else ""
    return f"{rate / 1e9:.4g} G{unit} / {peak / 1e9:.4g} G{unit} = {ratio:.4g}{clipped}"


def _compute_efficiencies(
    spec: DeviceSpec, device: Any, dtype: str, sizes: BenchSizes, stamp: _Stamp
) -> tuple[dict[str, float], dict[str, str], list[Measurement]]:
    """Matmul, attention and memory efficiencies with their sources."""
    matmuls = [bench_matmul(device, n, dtype, sizes) for n in sizes.matmul_n]
    attention = bench_attention(device, dtype, sizes)
    copy = bench_copy(device, sizes)
    peak, hbm = spec.peak_flops_per_s[dtype], spec.hbm_bandwidth_bytes_per_s
    best = max(matmuls, key=lambda m: m.rate)
    tried = "/".join(f"{n}^3" for n in sizes.matmul_n)
    efficiency = {
        "matmul": _clip(best.rate / peak),
        "attention": _clip(attention.rate / peak),
        "memory_bound": _clip(copy.rate / hbm),
    }
    sources = {
        "efficiency.matmul": stamp.source(
            f"best of {dtype} matmuls {tried} ({best.what}) "
            f"{_ratio_text(best.rate, peak, 'FLOP/s')}"
        ),
        "efficiency.attention": stamp.source(
            f"unfused softmax {attention.what} at 4*b*h*s^2*d FLOPs "
            f"{_ratio_text(attention.rate, peak, 'FLOP/s')}"
        ),
        "efficiency.memory_bound": stamp.source(
            f"{copy.what} (read + write) {_ratio_text(copy.rate, hbm, 'B/s')}"
        ),
    }
    return efficiency, sources, [*matmuls, attention, copy]


def _collective_fit(
    spec: DeviceSpec, devices: Sequence[Any], sizes: BenchSizes, stamp: _Stamp
) -> tuple[float, Link, dict[str, str], list[Measurement]]:
    """``(efficiency.collective, intra_node_link, sources, measurements)`` from psum timings."""
    n = len(devices)
    small_bytes, large_bytes = ((b // _FP32_BYTES) * _FP32_BYTES for b in sizes.collective_bytes)
    small = bench_psum(devices, small_bytes, sizes)
    large = bench_psum(devices, large_bytes, sizes)
    gather = bench_all_gather(devices, max(large_bytes // n, _FP32_BYTES), sizes)
    fitted = fit_ring_link(n, small_bytes, small.time_s, large_bytes, large.time_s)
    nominal = spec.intra_node_link or fitted
    how = (
        f"ring fit of psum over {n} devices at {small_bytes / 2**10:g} KiB and "
        f"{large_bytes / 2**10:g} KiB"
    )
    efficiency = _clip(fitted.bandwidth_bytes_per_s / nominal.bandwidth_bytes_per_s)
    bus = _ratio_text(fitted.bandwidth_bytes_per_s, nominal.bandwidth_bytes_per_s, "B/s")
    sources = {
        "efficiency.collective": stamp.source(
            f"{how}: bus bandwidth {bus} of the nominal intra-node link "
            f"(all_gather busbw {gather.rate / 1e9:.4g} GB/s)"
        ),
        "intra_node_link.latency_us": stamp.source(
            f"{how}: per-step alpha = {fitted.latency_s * 1e6:.4g} us "
            f"(start-up {STARTUP_STEPS} alpha per call)"
        ),
    }
    if spec.intra_node_link is None:
        sources["intra_node_link.bandwidth_GB_s"] = stamp.source(f"{how}: bandwidth")
    link = Link(nominal.bandwidth_bytes_per_s, float(f"{fitted.latency_s:.4g}"))
    return efficiency, link, sources, [small, large, gather]


def calibrate(
    *,
    device: str | None = None,
    devices: Sequence[Any] | None = None,
    quick: bool = False,
    sizes: BenchSizes | None = None,
) -> Calibration:
    """Runs the micro-benchmarks (module docstring) and fits the device's efficiencies.

    Args:
      device: catalog name (or inline-spec YAML name) to start from; default the type of
        ``Cluster.local(devices)``'s first group.
      devices: the jax devices to measure on; default ``jax.local_devices()``. Compute runs on
        the first device of the type, collectives over all devices of that kind.
      quick: small sizes (:data:`QUICK_SIZES`), seconds on a CPU.
      sizes: explicit sizes (overrides ``quick``); default :data:`CPU_SIZES` on CPU devices,
        :data:`ACCELERATOR_SIZES` otherwise.

    Returns:
      The calibration; :func:`write_device_yaml` writes it as a catalog file.

    Raises:
      ClusterError: an unknown ``device`` name, or local devices the catalog does not know
        (pass ``device=``).
    """
    devs = list(devices) if devices is not None else list(jax.local_devices())
    spec, bench_devices = _target(device, devs)
    first = bench_devices[0]
    if sizes is None:
        sizes = (
            QUICK_SIZES if quick else CPU_SIZES if first.platform == "cpu" else (ACCELERATOR_SIZES)
        )
    dtype = _bench_dtype(spec)
    stamp = _Stamp(datetime.date.today().isoformat(), jax.__version__, first.device_kind)
    values, sources, measured = _compute_efficiencies(spec, first, dtype, sizes, stamp)
    link = spec.intra_node_link
    values["collective"] = spec.efficiency.collective
    if len(bench_devices) >= 2:
        values["collective"], link, more, runs = _collective_fit(spec, bench_devices, sizes, stamp)
        sources.update(more)
        measured += runs
    efficiency = Efficiency(**{k: float(f"{v:.4g}") for k, v in values.items()})
    return Calibration(
        spec,
        first.device_kind,
        len(bench_devices),
        dtype,
        efficiency,
        link,
        tuple(measured),
        sources,
    )


class _CatalogDumper(yaml.SafeDumper):
    """Writes large floats as ``3.12e+14`` (not ``312000000000000.0``), a form that YAML 1.1
    readers (``yaml.safe_load``) and the catalog's loader both read as a number."""


def _represent_float(dumper: yaml.SafeDumper, value: float) -> yaml.ScalarNode:
    if not math.isfinite(value) or abs(value) < 1e6:
        return dumper.represent_float(value)
    digits = next((p for p in range(1, 17) if float(f"{value:.{p}e}") == value), 17)
    mantissa, exponent = f"{value:.{digits}e}".split("e")
    mantissa = mantissa.rstrip("0")
    mantissa += "0" if mantissa.endswith(".") else ""  # YAML 1.1 floats need a digit after "."
    return dumper.represent_scalar("tag:yaml.org,2002:float", f"{mantissa}e{exponent}")


_CatalogDumper.add_representer(float, _represent_float)


def write_device_yaml(calibration: Calibration, path: str | Path) -> Path:
    """Writes ``calibration`` as a device file in the catalog format (parents created).

    The file starts with a comment listing the raw measurements; ``load_device(yaml.safe_load
    (text))`` reads it back, and it can replace ``configs/devices/<name>.yaml``.

    Returns:
      The path written.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = [
        f"# {calibration.base.name}: calibrated by `shardplan calibrate` on "
        f"{calibration.num_devices} x {calibration.device_kind}, jax {jax.__version__}."
    ]
    header += [f"#   {m.describe()}" for m in calibration.measurements]
    body = yaml.dump(
        calibration.to_yaml_dict(),
        Dumper=_CatalogDumper,
        sort_keys=False,
        width=1000,
        allow_unicode=True,
    )
    out.write_text("\n".join(header) + "\n" + body, encoding="utf-8")
    return out
