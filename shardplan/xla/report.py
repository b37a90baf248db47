"""What XLA compiled: collectives, FLOPs, memory and shardings of a ``jax.stages.Compiled``.

:func:`read_compiled` summarises a compiled program for plan verification, cost-model tests
and reports; :func:`read_hlo_text` does the HLO part alone on a module's text.

**Collectives** are found by :func:`~shardplan.xla.collectives.find_collectives`, one
:class:`~shardplan.xla.collectives.Collective` per collective instruction, counted as often as
its computation runs (a psum in a 5-step ``lax.scan`` counts 5), with the bytes of its result
on one device; :mod:`shardplan.xla.collectives` gives the rules for async forms.

**FLOPs** are counted by :func:`~shardplan.xla.flops.hlo_flops` like XLA's ``HloCostAnalysis``
(which ``compiled.cost_analysis()`` runs), each while loop once; with ``scale_loops=True`` a
loop with a known trip count ``n`` counts ``n`` times, and the difference is the loop
correction that :attr:`CompiledReport.flops_loop_corrected` adds to XLA's figure.
:mod:`shardplan.xla.flops` gives the per-op rules and how they were verified.

Example:
    >>> import jax, jax.numpy as jnp
    >>> compiled = jax.jit(lambda a: a @ a).lower(jnp.ones((4, 4))).compile()
    >>> report = read_compiled(compiled)
    >>> report.flops, report.flops_loop_corrected   # 2·4·4·4
    (128.0, 128.0)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from shardplan.xla.collectives import COLLECTIVE_KINDS as COLLECTIVE_KINDS
from shardplan.xla.collectives import Collective as Collective
from shardplan.xla.collectives import Collectives, find_collectives
from shardplan.xla.flops import hlo_flops
from shardplan.xla.hlo import HloModule, Loop, parse_hlo

if TYPE_CHECKING:
    import jax

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "Collectives",
    "CompiledReport",
    "HloReport",
    "MemoryReport",
    "find_collectives",
    "hlo_flops",
    "read_compiled",
    "read_hlo_text",
]


@dataclass(frozen=True)
class HloReport:
    """What the HLO text of a program says: collectives, loops and flops.

    Attributes:
      modules: the parsed modules.
      collectives: every collective, in module and text order.
      loops: every while loop reachable from an entry computation.
      flops: flops counted with loops once (XLA's ``cost_analysis()`` convention).
      flops_loop_corrected: flops with loops multiplied by their known trip counts.
    """

    modules: tuple[HloModule, ...] = field(repr=False)
    collectives: Collectives
    loops: tuple[Loop, ...]
    flops: float
    flops_loop_corrected: float

    @property
    def loop_flops_correction(self) -> float:
        """``Σ (n − 1) × flops(body + condition)`` over loops with known trip count ``n``."""
        return self.flops_loop_corrected - self.flops

    def collective_summary(self, *, include_scalar: bool = True) -> dict[str, dict[str, int]]:
        """``{kind: {"count", "bytes"}}``; see :meth:`Collectives.summary`."""
        chosen = self.collectives if include_scalar else self.collectives.non_scalar()
        return chosen.summary()


def read_hlo_text(text: str | Sequence[str]) -> HloReport:
    """Parses HLO module text and summarises its collectives, loops and flops.

    Args:
      text: ``compiled.as_text()``, several modules' text, or a sequence of module texts.

    Returns:
      The report over all modules.

    Example:
        >>> report = read_hlo_text('''
        ... HloModule m, num_partitions=2
        ... %add (a: f32[], b: f32[]) -> f32[] {
        ...   %a = f32[] parameter(0)
        ...   %b = f32[] parameter(1)
        ...   ROOT %s = f32[] add(%a, %b)
        ... }
        ... ENTRY %main (p: f32[8]) -> f32[8] {
        ...   %p = f32[8]{0} parameter(0)
        ...   ROOT %r = f32[8]{0} all-reduce(%p), replica_groups=[1,2]<=[2], to_apply=%add
        ... }''')
        >>> report.collective_summary()
        {'all-reduce': {'count': 1, 'bytes': 32}}
        >>> report.collectives[0].replica_groups
        ((0, 1),)
    """
    modules = parse_hlo(text)
    return HloReport(
        modules=modules,
        collectives=Collectives(c for m in modules for c in find_collectives(m)),
        loops=tuple(loop for m in modules for loop in m.loops),
        flops=sum(hlo_flops(m) for m in modules),
        flops_loop_corrected=sum(hlo_flops(m, scale_loops=True) for m in modules),
    )


@dataclass(frozen=True)
class MemoryReport:
    """``compiled.memory_analysis()`` per device, in bytes.

    Attributes:
      argument_bytes: parameters.
      output_bytes: results.
      temp_bytes: temporaries (XLA's buffer assignment).
      alias_bytes: outputs that alias (donated) arguments.
      generated_code_bytes: the executable's code.
      peak_bytes: what the step allocates: ``argument + output + temp − alias`` (the
        arguments, the results not written into donated arguments, and the temporaries'
        preallocated block).
      xla_peak_bytes: XLA's own ``peak_memory_in_bytes`` (0 where the backend gives none). On
        XLA:CPU it is the arguments' bytes plus a few scalars, without the temporaries, so it
        is kept for reference only.
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    xla_peak_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @classmethod
    def from_stats(cls, stats: Any) -> MemoryReport:
        """Builds the report from a ``CompiledMemoryStats`` (or any object with its fields)."""

        def get(name: str) -> int:
            value = getattr(stats, name, 0)
            return int(value) if value is not None else 0

        return cls(
            argument_bytes=get("argument_size_in_bytes"),
            output_bytes=get("output_size_in_bytes"),
            temp_bytes=get("temp_size_in_bytes"),
            alias_bytes=get("alias_size_in_bytes"),
            generated_code_bytes=get("generated_code_size_in_bytes"),
            xla_peak_bytes=get("peak_memory_in_bytes"),
        )


@dataclass(frozen=True)
class CompiledReport:
    """What XLA made of a jitted program, per device.

    Attributes:
      flops: ``cost_analysis()["flops"]``, which counts each while loop once (the HLO count
        when XLA gives no cost analysis).
      flops_loop_corrected: ``flops`` plus ``Σ (n − 1) × flops(loop body + condition)`` over
        loops with known trip count ``n`` (nested loops multiply through).
      transcendentals: ``cost_analysis()["transcendentals"]`` (loops once).
      bytes_accessed: ``cost_analysis()["bytes accessed"]`` (loops once).
      memory: ``memory_analysis()``, or None when the backend gives none.
      collectives: every collective (see :class:`Collective`).
      loops: every while loop with its trip count.
      input_shardings: ``compiled.input_shardings`` (``(args, kwargs)`` of shardings).
      output_shardings: ``compiled.output_shardings``.
      hlo: the HLO-level report the fields above come from.
      cost_analysis: the raw ``cost_analysis()`` dict.
    """

    flops: float
    flops_loop_corrected: float
    transcendentals: float
    bytes_accessed: float
    memory: MemoryReport | None
    collectives: Collectives
    loops: tuple[Loop, ...]
    input_shardings: Any = field(repr=False)
    output_shardings: Any = field(repr=False)
    hlo: HloReport = field(repr=False)
    cost_analysis: Mapping[str, float] = field(repr=False, compare=False, hash=False)

    def collective_summary(self, *, include_scalar: bool = True) -> dict[str, dict[str, int]]:
        """``{kind: {"count": int, "bytes": int}}``, bytes per device over one execution.

        Args:
          include_scalar: keep collectives of scalars (e.g. the loss-mean all-reduce).
        """
        return self.hlo.collective_summary(include_scalar=include_scalar)


def _cost_dict(compiled: jax.stages.Compiled) -> dict[str, float]:
    """``compiled.cost_analysis()`` as one dict (older jax returned a list of dicts)."""
    cost: Any = compiled.cost_analysis()
    if isinstance(cost, Mapping):
        return {str(k): float(v) for k, v in cost.items()}
    if isinstance(cost, Iterable):
        merged: dict[str, float] = {}
        for part in cost:
            for k, v in dict(part).items():
                merged[str(k)] = merged.get(str(k), 0.0) + float(v)
        return merged
    return {}


def read_compiled(compiled: jax.stages.Compiled, /) -> CompiledReport:
    """Summarises a compiled program: flops, memory, collectives, loops and shardings.

    Args:
      compiled: ``jax.jit(f).lower(*args).compile()``.

    Returns:
      The report; every figure is per device.
    """
    hlo = read_hlo_text(compiled.as_text() or "")
    cost = _cost_dict(compiled)
    flops = cost.get("flops", 0.0) if cost else hlo.flops
    stats = compiled.memory_analysis()
    return CompiledReport(
        flops=flops,
        flops_loop_corrected=flops + hlo.loop_flops_correction,
        transcendentals=cost.get("transcendentals", 0.0),
        bytes_accessed=cost.get("bytes accessed", 0.0),
        memory=MemoryReport.from_stats(stats) if stats is not None else None,
        collectives=hlo.collectives,
        loops=hlo.loops,
        input_shardings=compiled.input_shardings,
        output_shardings=compiled.output_shardings,
        hlo=hlo,
        cost_analysis=MappingProxyType(cost),
    )
