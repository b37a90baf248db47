"""Does a plan belong to this step, these arguments and this cluster? Says what differs.

A plan records the types of the arguments it was made for (``state_types``,
``batch_types``), the op graph's fingerprint, the cluster's hash and outline. A plan applied
to something else is refused with a :class:`~shardplan.errors.PlanMismatchError` that names
the difference a user can act on: a state leaf added, missing or of another shape, a batch of
another size, a stage layer the step does not have, a cluster with other devices.

Example:
    >>> from shardplan.plan.plan import _example
    >>> import dataclasses
    >>> plan = dataclasses.replace(_example(), state_types={"0/w": "float32[4,4]"})
    >>> plan_differences(plan, state_types={"0/w": "float32[4,8]"})
    ['state/0/w: the plan has float32[4,4], the step gets float32[4,8]']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardplan.errors import PlanMismatchError, did_you_mean, format_error
from shardplan.plan.plan import Plan, natural_key

__all__ = ["check_plan_matches", "plan_differences"]

_SHOWN = 5
"""Differences of one kind named in a message before the rest are counted."""


def _type_differences(what: str, plan_types: Mapping[str, str],
                      types: Mapping[str, str]) -> list[str]:
    if not plan_types:  # a plan of schema version 3 records no types
        return []
    out = []
    changed = [k for k in sorted(set(plan_types) & set(types), key=natural_key)
               if plan_types[k] != types[k]]
    missing = sorted(set(plan_types) - set(types), key=natural_key)
    added = sorted(set(types) - set(plan_types), key=natural_key)
    for key in changed[:_SHOWN]:
        out.append(f"{what}/{key}: the plan has {plan_types[key]}, the step gets {types[key]}")
    for keys, text in ((missing, "the plan has {} the step does not get"),
                       (added, "the step gets {} the plan does not know")):
        if keys:
            shown = ", ".join(f"{what}/{k}" for k in keys[:_SHOWN])
            more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
            out.append(text.format(f"{len(keys)} leaves ({shown}{more})" if len(keys) > 1
                                   else f"{what}/{keys[0]}"))
    if len(changed) > _SHOWN:
        out.append(f"and {len(changed) - _SHOWN} more {what} leaves of another shape or dtype")
    return out


def _layer_differences(plan: Plan, names: Sequence[str]) -> list[str]:
    """The plan's stages' layers against the step's (by name)."""
    out = []
    have = dict.fromkeys(names)
    for i, stage in enumerate(plan.stages):
        for name in stage.layers:
            if name not in have:
                hint = did_you_mean(name, have).strip()
                out.append(f"stages[{i}].layers: {name!r} is not a layer of the step"
                           + (f" ({hint})" if hint else ""))
    run = {name for stage in plan.stages for name in stage.layers}
    idle = [name for name in names if name not in run]
    if idle:
        shown = ", ".join(map(repr, idle[:_SHOWN]))
        more = f" and {len(idle) - _SHOWN} more" if len(idle) > _SHOWN else ""
        out.append(f"layers: the step's {shown}{more} run in no stage of the plan "
                   f"(the plan has {len(run)} layers, the step {len(names)})")
    return out[:_SHOWN + 1]


def _cluster_differences(plan: Plan, cluster_hash: str, info: Mapping[str, Any]) -> list[str]:
    if cluster_hash == plan.cluster_hash:
        return []
    mine, theirs = plan.cluster_info, info
    if not mine:
        return [f"cluster: hash {plan.cluster_hash[:12]} in the plan, {cluster_hash[:12]} here"]
    out = []
    if mine.get("name") != theirs.get("name"):
        out.append(f"cluster: the plan's is {mine.get('name')!r}, this one {theirs.get('name')!r}")
    want: Mapping[str, Any] = mine.get("device_types", {})  # type: ignore[assignment]
    have: Mapping[str, Any] = theirs.get("device_types", {})
    for name in sorted(set(want) | set(have)):
        a, b = want.get(name), have.get(name)
        if a != b:
            out.append(f"devices {name}: the plan's cluster has {_devices(a)}, this one "
                       f"{_devices(b)}")
    if not out:
        out.append("cluster: same devices, other links or device figures (the cluster hash "
                   "differs)")
    return out


def _devices(entry: Any) -> str:
    if not entry:
        return "none"
    return f"{entry['count']} of {entry['memory_bytes'] / 1e9:g} GB"


def plan_differences(plan: Plan, /, *, state_types: Mapping[str, str] | None = None,
                     batch_types: Mapping[str, str] | None = None,
                     graph_fingerprint: str | None = None,
                     layer_names: Sequence[str] | None = None,
                     cluster_hash: str | None = None,
                     cluster_info: Mapping[str, Any] | None = None) -> list[str]:
    """What differs between what ``plan`` was made for and what is given (one line each);
    empty when everything given matches. Arguments left at None are not compared.

    ``layer_names`` are the step's layers: a plan's stage naming a layer the step does not
    have, or a step layer no stage runs, is named (with the closest name)."""
    out: list[str] = []
    if state_types is not None:
        out += _type_differences("state", plan.state_types, state_types)
    if batch_types is not None:
        out += _type_differences("batch", plan.batch_types, batch_types)
    if layer_names is not None:
        out += _layer_differences(plan, layer_names)
    if (graph_fingerprint is not None and graph_fingerprint != plan.graph_fingerprint
            and not out):
        out.append("the step computes something else on arguments of the same types: its "
                   "program differs from the one planned (another model, loss, or "
                   "learning-rate schedule of another form, such as a run no longer than "
                   f"its warmup; graph fingerprint {graph_fingerprint}, the plan's "
                   f"{plan.graph_fingerprint})")
    if cluster_hash is not None:
        out += _cluster_differences(plan, cluster_hash, cluster_info or {})
    return out


def check_plan_matches(plan: Plan, /, **given: Any) -> None:
    """Raises :class:`~shardplan.errors.PlanMismatchError` naming every difference
    :func:`plan_differences` finds (same keyword arguments)."""
    differences = plan_differences(plan, **given)
    if not differences:
        return
    raise PlanMismatchError(format_error(
        "The plan was made for another step, other arguments or another cluster: "
        + "; ".join(differences) + ".",
        where=f"plan {plan.content_hash[:12]}",
        remedy="make a plan for this step, its arguments and this cluster (sp.make_plan, or "
               "sp.auto, which plans again by itself)"))
