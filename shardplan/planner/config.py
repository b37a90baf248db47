"""``PlanConfig``: the options of :func:`~shardplan.make_plan`, typed and
checked, from keyword arguments or a mapping (a YAML file's section)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any, Literal

from shardplan._schema import options_from_mapping, reject_unknown_kwargs, require
from shardplan.plan._values import ACCUMULATIONS
from shardplan.solver.stages.pipeline import REMATS, SCHEDULES, Remat, Schedule

__all__ = ["PlanConfig"]


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """Options of :func:`make_plan`.

    Attributes:
      memory_budget_bytes: per-device bytes the state and batch may take (None: the device's
        memory).
      time_limit_s: the solver's limit per candidate mesh.
      relative_gap: accept a sharding whose predicted cost is within this fraction of the
        proven optimum (the LP bound); 1 % by default, above the 0.1 % tie-breaking salt.
      tie_periods: layer-tying periods to try (1: every block alike; 2: alternating pairs).
      max_mesh_axes: most logical mesh axes (see :mod:`shardplan.planner.mesh`; 3 makes
        the problem about 17 times larger).
      memory_headroom: the fraction of each device's memory kept free (for the framework,
        fragmentation and what the model does not see) when ``memory_budget_bytes`` is None.
      pipeline: ``None``: multi-stage plans (the stage planner) on clusters with several device
        types, one mesh otherwise; ``True``: the stage planner on any cluster; ``False``: one
        mesh (refused on clusters with several device types).
      microbatch_sizes: candidate microbatch sizes in samples (empty: the powers of two that
        divide the batch, and the batch); stage planner only.
      schedules: pipeline schedules to consider (``gpipe``, ``1f1b``, ``interleaved``).
      remats: rematerialisation policies to consider per stage (``none``, ``selective``,
        ``full``).
      chunks: model chunks per stage the interleaved schedule may use.
      max_stages: most stages per replica (0: no limit).
      objective: ``"time"`` (minimum step time) or ``"cost"`` (minimum dollars per step at
        the catalog's prices, subject to ``min_throughput``).
      min_throughput: the cost objective's floor in samples per second.
      reference_microbatch: the microbatch size (samples) the layer cost tables are solved
        at (at most the batch); their times and bytes scale per sample from there. 2 by
        default: at one sample XLA's fusion treats the batch dimension as absent (size-1
        dimensions are bitcasts), and the saved activations and backward buffers per sample
        read low (the tiny GPT's block: 198,656 saved bytes and 32,768 working bytes per
        sample at 1; 231,424 and 106,496 at 2, 4 and 8).
      stage_time_limit_s: the stage planner's budget: past it, the best plan found so far is
        returned with a proven lower bound (``plan.solver["status"] == "feasible"``, a
        :class:`~shardplan.errors.ShardplanWarning` gives the gap); small problems finish
        within it, proven optimal.
      stage_work_limit: the stage planner's work budget (labels, states and sweep steps;
        0, the default: none). A search cut by it returns the same plan on any machine
        under any load (a search cut by the clock may not); the time limit stays the
        safety net.
      respect_annotations: place every state leaf the user annotated (``nnx.with_partitioning``,
        ``nn.with_partitioning``, ``nn.with_logical_partitioning``) exactly as annotated, on a
        mesh whose axes are the user's axis names (see
        :mod:`shardplan.planner.annotations`); the rest is planned freely. One-mesh plans
        only so far.
      axis_rules: ``(logical name, mesh axis or None)`` pairs turning logical annotation
        names into mesh axes, as ``flax.linen.logical_axis_rules`` takes them; their mesh
        axes, in this order, are the mesh's first axes.
      strict: refuse a step with primitives shardplan has no cost or sharding rule for
        (:class:`~shardplan.errors.TraceError` naming each and its source line); ``False``
        plans them with their operands and results replicated and warns
        (:class:`~shardplan.errors.ShardplanWarning`).
      accumulation: how a multi-stage plan's microbatches (and data-parallel replicas)
        combine. ``"exact"`` (the default): the pipelined step equals the whole-batch step;
        a step that draws random numbers over the batch (dropout) or uses batch statistics
        in its forward pass (BatchNorm) is planned with one microbatch per replica and one
        replica (whole-batch stages; the plan's notes say why), and a loss normalised by a
        sum over the batch (``sum(ce * w) / sum(w)``) is exact with any microbatches (the
        sum is taken over the whole batch first). ``"per_microbatch"``: gradient
        accumulation semantics, as a training loop accumulating over the plan's
        microbatches computes it: each microbatch draws random numbers with the step's key
        folded with the index of its first sample (deterministic, but dependent on the
        plan's microbatch size) and computes its own batch statistics.

    Unknown keyword arguments are a :class:`~shardplan.errors.ConfigError` with a
    did-you-mean; :meth:`from_dict` builds a config from a mapping (a YAML file's).
    """

    memory_budget_bytes: float | None = None
    time_limit_s: float = 30.0
    relative_gap: float = 0.01
    tie_periods: tuple[int, ...] = (1, 2)
    max_mesh_axes: int = 2
    memory_headroom: float = 0.1
    pipeline: bool | None = None
    microbatch_sizes: tuple[int, ...] = ()
    schedules: tuple[Schedule, ...] = SCHEDULES
    remats: tuple[Remat, ...] = REMATS
    chunks: tuple[int, ...] = (2,)
    max_stages: int = 0
    objective: Literal["time", "cost"] = "time"
    min_throughput: float = 0.0
    reference_microbatch: int = 2
    stage_time_limit_s: float = 2.5
    stage_work_limit: int = 0
    respect_annotations: bool = False
    axis_rules: tuple[tuple[str, str | None], ...] = ()
    strict: bool = True
    accumulation: Literal["exact", "per_microbatch"] = "exact"

    def __new__(cls, *args: Any, **kwargs: Any) -> PlanConfig:
        reject_unknown_kwargs(cls, kwargs)  # dataclass's __init__: a bare TypeError
        return super().__new__(cls)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], /, *,
                  where: str = "PlanConfig") -> PlanConfig:
        """A config from a mapping of field names to values, e.g. a YAML file's section.

        Lists become tuples; every value is checked against the field's type.

        Args:
          mapping: field name -> value.
          where: how messages name the mapping (e.g. ``"plan.yaml: config"``).

        Raises:
          ConfigError: an unknown key (with a did-you-mean), or a value of the wrong type
            (naming the key path, the value and the type wanted).

        Example:
          >>> PlanConfig.from_dict({"time_limit_s": 5, "schedules": ["1f1b"]}).schedules
          ('1f1b',)
        """
        return cls(**options_from_mapping(cls, mapping, where=where, noun="plan config"))

    def __post_init__(self) -> None:
        if isinstance(self.axis_rules, list | tuple) and all(
                isinstance(r, list | tuple) for r in self.axis_rules):  # lists from JSON
            object.__setattr__(self, "axis_rules", tuple(tuple(r) for r in self.axis_rules))
        checks = [
            ("memory_headroom", 0.0 <= self.memory_headroom < 1.0, "a fraction in [0, 1)"),
            ("objective", self.objective in ("time", "cost"), "'time' or 'cost'"),
            ("schedules", bool(self.schedules) and set(self.schedules) <= set(SCHEDULES),
             f"a non-empty subset of {SCHEDULES}"),
            ("remats", bool(self.remats) and set(self.remats) <= set(REMATS),
             f"a non-empty subset of {REMATS}"),
            ("chunks", all(isinstance(c, int) and c >= 2 for c in self.chunks),
             "integers >= 2"),
            ("microbatch_sizes", all(isinstance(m, int) and m >= 1
                                     for m in self.microbatch_sizes), "positive integers"),
            ("max_stages", isinstance(self.max_stages, int) and self.max_stages >= 0,
             "an integer >= 0"),
            ("min_throughput", self.min_throughput >= 0, "a number >= 0"),
            ("reference_microbatch", isinstance(self.reference_microbatch, int)
             and self.reference_microbatch >= 1, "an integer >= 1"),
            ("stage_time_limit_s", self.stage_time_limit_s > 0, "a number of seconds > 0"),
            ("stage_work_limit", isinstance(self.stage_work_limit, int)
             and self.stage_work_limit >= 0, "an integer >= 0"),
            ("respect_annotations", isinstance(self.respect_annotations, bool), "True or False"),
            ("strict", isinstance(self.strict, bool), "True or False"),
            ("accumulation", self.accumulation in ACCUMULATIONS,
             " or ".join(repr(a) for a in ACCUMULATIONS)),
            ("axis_rules", isinstance(self.axis_rules, tuple) and all(
                isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str)
                and (r[1] is None or isinstance(r[1], str)) for r in self.axis_rules),
             "(logical name, mesh axis or None) pairs"),
        ]
        for name, ok, want in checks:
            require(ok, f"PlanConfig.{name}", getattr(self, name), want, verb="pass",
                    show_none=False)

    def content_hash(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]
