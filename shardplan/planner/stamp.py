"""What a plan records about the step and cluster it was made for, so that applying it to
another one can say what differs (``Plan.state_types``, ``batch_types``, ``cluster_info``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from shardplan.cluster import Cluster
from shardplan.plan import Plan
from shardplan.trace.dtypes import dtype_name

__all__ = ["arg_types", "cluster_info", "memory_budgets", "stamped", "type_text"]


def type_text(shape: tuple[int, ...], dtype: Any) -> str:
    """``"float32[8,16]"`` (``"int32[]"`` for a scalar, ``"key<fry>[]"`` for a PRNG key): how
    plans write an argument leaf's type.

    Example:
      >>> type_text((8, 16), "float32")
      'float32[8,16]'
    """
    return f"{dtype_name(dtype)}[{','.join(map(str, shape))}]"


def arg_types(tree: Any, /) -> dict[str, str]:
    """``{key path: "dtype[shape]"}`` of every leaf of ``tree`` (arrays, scalars or
    ``jax.ShapeDtypeStruct``s), key paths as in :attr:`Plan.param_specs`.

    Leaves that are not arrays are left out: the planner reports them itself.

    Example:
      >>> import jax.numpy as jnp
      >>> arg_types({"w": jnp.zeros((2, 3)), "b": jax.ShapeDtypeStruct((3,), jnp.int32)})
      {'b': 'int32[3]', 'w': 'float32[2,3]'}
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        try:
            aval = jax.typeof(leaf)
        except TypeError:
            continue
        out[jax.tree_util.keystr(path, simple=True, separator="/")] = type_text(
            tuple(aval.shape), aval.dtype)
    return out


def cluster_info(cluster: Cluster, /) -> dict[str, Any]:
    """The outline of ``cluster`` a plan keeps: its name and, per device type, how many devices
    and how much memory each has.

    Example:
      >>> one = Cluster.local(types={"a100-80g": 1}, devices=jax.devices()[:1])
      >>> cluster_info(one)["device_types"]
      {'a100-80g': {'count': 1, 'memory_bytes': 80000000000}}
    """
    types: dict[str, dict[str, int]] = {}
    for group in cluster.groups:
        entry = types.setdefault(group.device.name,
                                 {"count": 0, "memory_bytes": group.device.memory_bytes})
        entry["count"] += len(group.device_ids)
    return {"name": cluster.name, "device_types": types}


def memory_budgets(cluster: Cluster, config: Any, /) -> dict[str, int]:
    """Per device type of ``cluster``, the bytes per device the planner may fill under
    ``config`` (a :class:`~shardplan.planner.config.PlanConfig`; ``None``: the default):
    ``memory_budget_bytes``, else the capacity less ``memory_headroom``. What a plan records
    in ``plan.solver["memory_budget_bytes"]`` and its compiled programs are held to.

    Example:
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
