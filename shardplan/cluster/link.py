"""Links between devices: bandwidth per direction per device, and latency (the α-β model).

YAML writes a link as ``{bandwidth_GB_s, latency_us}`` (10^9 bytes/s, microseconds); a
:class:`Link` holds SI units, ``bandwidth_bytes_per_s`` and ``latency_s``.

Example:
    >>> Link(25e9, 5e-6).transfer_time_s(1e9)  # 1 GB over one 200 Gb/s NIC
    0.040005
"""

from __future__ import annotations

import dataclasses

from shardplan._schema import Where
from shardplan.cluster._ranges import LINK_BANDWIDTH_GB_S, LINK_LATENCY_US, check_plausible
from shardplan.cluster._schema import as_float, as_mapping, check_keys, short_float

__all__ = ["Link", "parse_link"]

_BYTES_PER_GB = 1e9
"""Link bandwidths are written in GB/s, decimal (10^9 bytes/s), per direction, per device."""

_US_PER_S = 1e6


@dataclasses.dataclass(frozen=True)
class Link:
    """A point-to-point link, as seen by one device: bandwidth per direction and latency.

    Attributes:
      bandwidth_bytes_per_s: bytes per second per direction per device (YAML: ``bandwidth_GB_s``,
        10^9 bytes/s). For a node with one 200 Gb/s NIC per GPU this is 25e9.
      latency_s: the latency α of one message over the link, i.e. of one step of a ring
        collective (YAML: ``latency_us``). A collective call also pays a start-up of a few
        such latencies (:mod:`shardplan.cost.collectives`, ``STARTUP_STEPS``).
    """

    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        where = Where(path="Link")
        as_float(
            self.bandwidth_bytes_per_s,
            where.key("bandwidth_bytes_per_s"),
            what="a bandwidth in bytes/s",
        )
        as_float(
            self.latency_s, where.key("latency_s"), what="a latency in seconds", allow_minimum=True
        )

    def transfer_time_s(self, num_bytes: float) -> float:
        """α-β time to send ``num_bytes`` once over this link: ``latency + bytes / bandwidth``."""
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, float]:
        """The YAML form, ``{bandwidth_GB_s, latency_us}``."""
        return {
            "bandwidth_GB_s": short_float(self.bandwidth_bytes_per_s / _BYTES_PER_GB),
            "latency_us": short_float(self.latency_s * _US_PER_S),
        }


def parse_link(value: object, where: Where) -> Link:
    """Parses ``{bandwidth_GB_s, latency_us}`` into a :class:`Link`.

    Raises:
      ClusterError: not a mapping, an unknown key, a missing or non-positive bandwidth, or a
        missing or negative latency.

    Warns:
      ShardplanWarning: a bandwidth or latency outside its plausible range (a unit slip such as
        bytes/s under ``bandwidth_GB_s``; see :mod:`shardplan.cluster._ranges`).
    """
    link = as_mapping(value, where, what="a link {bandwidth_GB_s, latency_us}")
    check_keys(
        link,
        where,
        allowed=("bandwidth_GB_s", "latency_us"),
        required=("bandwidth_GB_s", "latency_us"),
        remedies={
            "bandwidth_GB_s": "add 'bandwidth_GB_s: <GB/s per direction per device>' "
            "(e.g. 300 for NVLink 3, 25 for one 200 Gb/s NIC per GPU)",
            "latency_us": "add 'latency_us: <microseconds>' (e.g. 2 for NVLink, 5 for "
            "InfiniBand, 25 for TCP over Ethernet)",
        },
    )
    bandwidth = as_float(
        link["bandwidth_GB_s"], where.key("bandwidth_GB_s"), what="a bandwidth in GB/s"
    )
    latency = as_float(
        link["latency_us"],
        where.key("latency_us"),
        what="a latency in microseconds",
        allow_minimum=True,
    )
    check_plausible(
        bandwidth,
        where.key("bandwidth_GB_s"),
        LINK_BANDWIDTH_GB_S,
        key="bandwidth_GB_s",
        written=link["bandwidth_GB_s"],
    )
    check_plausible(
        latency,
        where.key("latency_us"),
        LINK_LATENCY_US,
        key="latency_us",
        written=link["latency_us"],
    )
    return Link(bandwidth * _BYTES_PER_GB, latency / _US_PER_S)
