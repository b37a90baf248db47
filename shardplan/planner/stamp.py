"""The planner's stamp on the plans it makes: the argument types and cluster outline
(:mod:`shardplan.plan.stamp`) and the memory per device each was made for."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from shardplan.cluster import Cluster
from shardplan.plan import Plan
from shardplan.plan.stamp import cluster_info
from shardplan.trace.args import arg_types

__all__ = ["memory_budgets", "stamped"]


def memory_budgets(cluster: Cluster, config: Any, /) -> dict[str, int]:
    """Per device type of ``cluster``, the bytes per device the planner may fill under
    ``config`` (a :class:`~shardplan.planner.config.PlanConfig`; ``None``: the default):
    ``memory_budget_bytes``, else the capacity less ``memory_headroom``. What a plan records
    in ``plan.solver["memory_budget_bytes"]`` and its compiled programs are held to.

    Example:
      >>> import jax
      >>> from shardplan.planner.config import PlanConfig
      >>> one = Cluster.local(types={"a100-80g": 1}, devices=jax.devices()[:1])
      >>> memory_budgets(one, PlanConfig(memory_budget_bytes=3.6e6))
      {'a100-80g': 3600000}
    """
    from shardplan.planner.config import PlanConfig
    from shardplan.planner.multi import memory_budget

    config = config if config is not None else PlanConfig()
    return {group.device.name: int(memory_budget(config, group.device.memory_bytes))
            for group in cluster.groups}


def stamped(make_plan: Callable[..., Plan], /) -> Callable[..., Plan]:
    """Wraps a planner ``(train_step, state, batch, /, *, cluster, ...) -> Plan`` so that the
    plan it returns records the argument types, the cluster's outline and the memory per
    device it was made for (:func:`memory_budgets`, in ``plan.solver``)."""

    @functools.wraps(make_plan)
    def wrapper(train_step: Callable[..., Any], state: Any, batch: Any, /, *args: Any,
                **kwargs: Any) -> Plan:
        plan = make_plan(train_step, state, batch, *args, **kwargs)
        cluster = kwargs["cluster"]
        solver = {**plan.solver,
                  "memory_budget_bytes": memory_budgets(cluster, kwargs.get("config"))}
        return dataclasses.replace(plan, state_types=arg_types(state),
                                   batch_types=arg_types(batch),
                                   cluster_info=cluster_info(cluster), solver=solver)

    return wrapper
