"""Running plans whose replicas are one stage each: data parallelism across sub-meshes, device
types and uneven microbatch counts.

The stage planner often returns such plans (on a mixed cluster, each replica on one device type,
the faster ones taking more microbatches). Each replica is an SPMD program on its own sub-mesh
with its layout's shardings; the train step is cut into its gradient and update parts
(:mod:`shardplan.runtime.accumulate`):

1. replica ``r`` runs the gradient part on its ``m_r`` microbatches (the batch is cut into the
   plan's microbatches in replica order) and sums the results on its devices;
2. the replicas' sums move to replica 0's sub-mesh (``jax.device_put``), are added, and the
   mean-type values divided by the microbatch count: the cut values of the whole batch;
3. the update part runs once, on replica 0's sub-mesh; its new state is the step's result, and
   every replica reads it at the next step (``jax.device_put`` onto its sub-mesh: the
   broadcast that ends a data-parallel step).

The result equals the whole-batch step up to float rounding (for a loss that is a mean or a sum
over examples; :mod:`shardplan.runtime.accumulate`). Plans with several stages per replica
need the pipeline executor, which does not exist yet: :func:`~shardplan.runtime.spmd.
apply_plan` says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.errors import ConfigError, format_error
from shardplan.plan import Plan
from shardplan.runtime.accumulate import StepSplit, reduction_kinds, split_step
from shardplan.runtime.spmd import leaf_shardings, stage_mesh

__all__ = ["ReplicatedStep"]


class ReplicatedStep:
    """A train step bound to a plan of one-stage replicas: call it like the original step."""

    def __init__(self, train_step: Callable[..., Any], plan: Plan) -> None:
        self._step = train_step
        self.plan = plan
        self._stages = [replica.stages[0] for replica in plan.replicas]
        self._meshes = [stage_mesh(plan, s) for s in self._stages]
        self._counts = plan.replica_microbatches
        self._ready: tuple[StepSplit, tuple[str, ...], list[Any], Any, list[Any],
                           list[Any]] | None = None

    def _prepare(self, state: Any, parts: Sequence[Any]) -> None:
        split = split_step(self._step, state, parts[0])
        kinds = (reduction_kinds(self._step, state, parts[0], parts[1], split)
                 if len(parts) > 1 else tuple("mean" for _ in split.cut_avals))
        gradient = jcore.jaxpr_as_fun(split.gradient)
        grad_fns, state_shs = [], []
        for stage, mesh in zip(self._stages, self._meshes, strict=True):
            layout = self.plan.layouts[self.plan.stages[stage].layout]
            state_sh = leaf_shardings(state, layout.param_specs, mesh, "state")
            batch_sh = leaf_shardings(parts[0], layout.batch_specs, mesh, "batch")
            state_shs.append(state_sh)
            grad_fns.append(jax.jit(gradient, in_shardings=(*jax.tree.leaves(state_sh),
                                                            *jax.tree.leaves(batch_sh))))
        home = self._meshes[0]
        cut_sh = [NamedSharding(home, P()) for _ in split.cut_avals]
        update = jax.jit(jcore.jaxpr_as_fun(split.update),
                         in_shardings=(*jax.tree.leaves(state_shs[0]), *cut_sh))
        self._ready = (split, kinds, grad_fns, update, state_shs, cut_sh)

    def __call__(self, state: Any, batch: Any) -> Any:
        mb, total = self.plan.microbatch_size, sum(self._counts)
        sizes = sorted({int(np.shape(x)[0]) if np.ndim(x) else -1
                        for x in jax.tree.leaves(batch)})
        if sizes != [mb * total]:
            raise ConfigError(format_error(
                f"The plan runs {total} microbatches of {mb} samples: the batch must have "
                f"{mb * total} on every leaf.", where="batch leading dimensions", value=sizes,
                remedy="pass the batch the plan was made for"))
        parts = [jax.tree.map(lambda x, j=j: x[j * mb:(j + 1) * mb], batch)
                 for j in range(total)]
        if self._ready is None:
            self._prepare(state, parts)
        assert self._ready is not None
        split, kinds, grad_fns, update, state_shs, cut_sh = self._ready
        sums: list[list[Any]] = []
        first = 0
        for r, count in enumerate(self._counts):
            leaves = jax.tree.leaves(jax.device_put(state, state_shs[r]))
            acc: list[Any] | None = None
            for part in parts[first:first + count]:
                values = grad_fns[r](*leaves, *jax.tree.leaves(part))
                acc = list(values) if acc is None else [a + v for a, v in
                                                        zip(acc, values, strict=True)]
            first += count
            assert acc is not None
            sums.append(acc)
        cut = [jax.device_put(s, sh) for s, sh in zip(sums[0], cut_sh, strict=True)]
        for other in sums[1:]:
            cut = [c + jax.device_put(s, sh) for c, s, sh in zip(cut, other, cut_sh,
                                                                  strict=True)]
        cut = [(c / total).astype(a.dtype) if k == "mean" else c
               for c, k, a in zip(cut, kinds, split.cut_avals, strict=True)]
        home_state = jax.tree.leaves(jax.device_put(state, state_shs[0]))
        return jax.tree.unflatten(split.out_tree, update(*home_state, *cut))
