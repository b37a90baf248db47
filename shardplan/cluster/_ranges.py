"""Plausible ranges of hardware figures, to catch unit slips in YAML and dict descriptions.

A bandwidth of ``300e9`` under ``bandwidth_GB_s`` (bytes/s written where GB/s is meant) or a
latency of ``2e-6`` under ``latency_us`` (seconds where µs is meant) is a valid positive number,
so the schema accepts it, and the planner then believes in links 10^9 times too fast or too
slow. Each figure here has a range that every real device and link falls well inside; a value
outside it is reported as a :class:`~shardplan.errors.ShardplanWarning` (not an error: an
exotic machine or a deliberate what-if study may need it) naming the key path, the value, the
unit, the range, and, where a common slip explains the value, the number that was probably
meant.

The checks run where a person writes the figure, in the YAML units (:func:`parse_link`,
:func:`~shardplan.cluster.catalog.parse_device`: YAML files, ``Cluster.from_dict`` and inline
device specs). The value classes (``Link``, ``DeviceSpec``) do not check: they hold SI units and
are also built by code from measurements (``shardplan calibrate``) and derived figures, where
no one wrote a unit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from shardplan._schema import Where, warn

__all__ = [
    "DEVICE_MEMORY_BYTES",
    "HBM_BANDWIDTH_BYTES_PER_S",
    "LINK_BANDWIDTH_GB_S",
    "LINK_LATENCY_US",
    "PEAK_FLOPS_PER_S",
    "PlausibleRange",
    "check_plausible",
]


@dataclasses.dataclass(frozen=True)
class PlausibleRange:
    """The range a hardware figure falls in, in the unit its key is written in.

    Attributes:
      unit: the key's unit, as the message shows it (``"GB/s"``).
      low: the smallest plausible value.
      high: the largest plausible value.
      what: what the figure is, for the message ("a link bandwidth").
      slips: (the unit someone may have written instead, the conversion of such a value into
        ``unit``), tried in order; a slip is suggested when the converted value is in range.
      zero_ok: 0 is a deliberate idealisation (a latency-free link), not a slip.
    """

    unit: str
    low: float
    high: float
    what: str
    slips: tuple[tuple[str, Callable[[float], float]], ...] = ()
    zero_ok: bool = False

    def contains(self, value: float) -> bool:
        """Whether ``value`` is plausible (the bounds included)."""
        return (self.zero_ok and value == 0) or self.low <= value <= self.high


LINK_BANDWIDTH_GB_S = PlausibleRange(
    unit="GB/s",
    # Low: 100 Mb/s Fast Ethernet is 0.0125 GB/s, the slowest network anyone would train over.
    # High: NVLink 5 is 900 GB/s per direction per GPU (NVIDIA Blackwell datasheet, 2024) and
    # HBM3e about 8,000 GB/s (B200); no link between two devices reaches 10,000 GB/s.
    low=0.01,
    high=10_000.0,
    what="a link bandwidth per direction per device",
    slips=(
        ("bytes/s", lambda v: v / 1e9),
        ("bits/s", lambda v: v / 8e9),
        ("MB/s", lambda v: v / 1e3),
        ("seconds per byte (1/bandwidth, the β of the α-β model)", lambda v: 1 / v / 1e9),
    ),
)
"""``bandwidth_GB_s`` of a link: 0.01 to 10,000 GB/s."""

LINK_LATENCY_US = PlausibleRange(
    unit="µs",
    # Low: 1 ns is one clock cycle at 1 GHz and ~20 cm of signal travel; a message between two
    # chips takes longer (NVLink ~1-2 µs per NCCL step, InfiniBand ~1-5 µs). Tests that want a
    # negligible latency write 0.001 (tests/planner/test_planner_cases.py) or 0, both accepted.
    # High: 1 s is several times a round trip around the Earth in fibre (~0.2 s).
    low=0.001,
    high=1e6,
    what="a link latency",
    slips=(
        ("seconds", lambda v: v * 1e6),
        ("nanoseconds", lambda v: v / 1e3),
    ),
    zero_ok=True,
)
"""``latency_us`` of a link: 0 (no latency), or 0.001 µs (1 ns) to 10^6 µs (1 s)."""

PEAK_FLOPS_PER_S = PlausibleRange(
    unit="FLOP/s",
    # Low: 1 GFLOP/s is below one core of any CPU of this century (the catalog's emulated CPU
    # device is 100e9). High: the largest chip, Cerebras WSE-3, is quoted at 125 PFLOP/s (1.25e17,
    # sparse, Cerebras 2024); one B200 is 4.5e15 dense fp8 (NVIDIA 2024).
    low=1e9,
    high=1e18,
    what="a dense peak FLOP/s figure",
    slips=(("TFLOP/s", lambda v: v * 1e12), ("GFLOP/s", lambda v: v * 1e9)),
)
"""``peak_flops_per_s.<dtype>``: 10^9 to 10^18 FLOP/s."""

DEVICE_MEMORY_BYTES = PlausibleRange(
    unit="bytes",
    # Low: 1 kB. The slip to catch is GB written as a number (memory_bytes: 80), which gives
    # values below 1,000 for every device built so far (the largest HBM is 288 GB, MI355X, 2025).
    # Real accelerators have far more than 1 kB (Groq LPU 230 MB SRAM, H200 141 GB), but tests
    # model deliberately tiny devices of a few kB to make layers not fit
    # (tests/planner/test_layer_costs.py: 1,706 bytes), so the bound is not set higher.
    # High: 100 TB is far above any device's memory (a CPU host has a few TB).
    low=1e3,
    high=1e14,
    what="device memory",
    slips=(("GB", lambda v: v * 1e9), ("MB", lambda v: v * 1e6)),
)
"""``memory_bytes``: 10^3 to 10^14 bytes."""

HBM_BANDWIDTH_BYTES_PER_S = PlausibleRange(
    unit="bytes/s",
    # Low: 1 GB/s is below one DDR3 channel (12.8 GB/s); the catalog's emulated CPU device has
    # 10e9. High: Cerebras WSE-3's on-chip SRAM is quoted at 21 PB/s (Cerebras 2024); HBM3e on
    # a B200 is 8e12.
    low=1e9,
    high=1e17,
    what="a device-memory bandwidth",
    slips=(("GB/s", lambda v: v * 1e9), ("TB/s", lambda v: v * 1e12)),
)
"""``hbm_bandwidth_bytes_per_s``: 10^9 to 10^17 bytes/s."""


def _suggestions(value: float, plausible: PlausibleRange) -> str:
    """``"if you wrote bytes/s, write 300"`` for each slip that brings ``value`` into range."""
    hits = []
    for unit, convert in plausible.slips:
        try:
            meant = convert(value)
        except ZeroDivisionError:
            continue
        if plausible.low <= meant <= plausible.high:
            hits.append(f"if you wrote {unit}, write {meant:.6g}")
    return "; ".join(hits)


def check_plausible(
    value: float, where: Where, plausible: PlausibleRange, *, key: str, written: object = None
) -> None:
    """Warns when ``value`` (already checked to be a finite number) is outside ``plausible``.

    Args:
      value: the figure, in ``plausible.unit``.
      where: its location (file, line, key path).
      plausible: the figure's range.
      key: the key's name for the message (``bandwidth_GB_s``).
      written: the value as the file or dict gives it (``25000``, not ``25000.0``), shown in
        the message; default ``value``.

    Warns:
      ShardplanWarning: naming the key path, the value with its unit, the range, and the value
        probably meant where a common unit slip explains it.
    """
    if plausible.contains(value):
        return
    side = "below" if value < plausible.low else "above"
    zero = " (or 0)" if plausible.zero_ok else ""
    meant = _suggestions(value, plausible)
    remedy = (
        f"{key} is in {plausible.unit}: "
        + (meant + "; " if meant else "")
        + f"real values lie in {plausible.low:g} .. {plausible.high:g} {plausible.unit}{zero}"
    )
    warn(
        where,
        f"{key} = {value:g} {plausible.unit} is {side} the plausible range of {plausible.what} "
        f"({plausible.low:g} .. {plausible.high:g} {plausible.unit}); is the unit right?",
        value if written is None else written,
        remedy,
    )
