"""Value checks the plan's dataclasses share (jax-free), in the plan file's wording.

Every check names the field it guards (``where``) and raises a
:class:`~shardplan.errors.ConfigError` (wrong type or range) or, through ``_mismatch``, a
:class:`~shardplan.errors.PlanMismatchError` (fields that contradict each other). The
predicates, the message layout and :class:`~shardplan._schema.FrozenMap` are
:mod:`shardplan._schema`'s.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from shardplan._schema import FrozenMap, invalid, is_int, is_number
from shardplan.errors import PlanMismatchError, did_you_mean

__all__ = ["ACCUMULATIONS", "PLAN_SCHEDULES", "REMATS", "SHARED_LAYER", "Spec", "as_spec",
           "parse_type"]

ACCUMULATIONS = ("exact", "per_microbatch")
"""How a plan's microbatches combine (``Plan.accumulation``, ``PlanConfig.accumulation``):
``"exact"``, the microbatched step equals the whole-batch step up to float rounding (a step
that draws random numbers over the batch or uses batch statistics then runs whole batches);
``"per_microbatch"``, gradient accumulation: each microbatch draws random numbers with its own
key (the step's key folded with the index of its first sample) and computes its own batch
statistics."""

PLAN_SCHEDULES = ("none", "gpipe", "1f1b", "interleaved")
"""``Plan.schedule`` values: ``"none"`` (one stage, no pipeline) and the stage planner's
schedules (``shardplan.solver.stages.pipeline.SCHEDULES``, not imported: the solver package loads
OR-Tools; a test checks the two agree)."""

REMATS = ("none", "selective", "full")
"""``Stage.remat`` values: the stage planner's policies (``shardplan.solver.stages.pipeline.REMATS``;
a test checks the two agree)."""

SHARED_LAYER = "shared"
"""The layer of ops no block owns (``shardplan.trace``): every stage of a replica lists it,
unlike the other layers, which one stage of each replica runs."""

Spec = tuple[tuple[str, ...], ...]
"""A sharding: per array dimension, the mesh axes it is split over (``()``: replicated)."""

# --------------------------------------------------------------------------- value checks


_mismatch = functools.partial(invalid, error=PlanMismatchError)


def _check_str(value: object, *, where: str, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not empty_ok and not value):
        raise invalid("Expected a non-empty string.", where=where, value=value,
                      remedy="write a string such as 'a100-80g' or 'blocks.0'")
    return value


def _check_int(value: object, *, where: str, minimum: int = 0) -> int:
    if not is_int(value) or value < minimum:
        raise invalid(f"Expected an integer >= {minimum}.", where=where, value=value,
                      remedy=f"write a whole number >= {minimum}")
    return value


def _check_float(value: object, *, where: str) -> float:
    if not is_number(value) or not math.isfinite(float(value)) or float(value) < 0:
        raise invalid("Expected a finite number >= 0.", where=where, value=value,
                      remedy="write seconds as a non-negative finite number")
    return float(value)


def _sequence(value: object, *, where: str, example: str = "[...]") -> Sequence[Any]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise invalid("Expected a list.", where=where, value=value,
                      remedy=f"write a list such as {example}")
    return value


def _check_strs(value: object, *, where: str) -> tuple[str, ...]:
    items = _sequence(value, where=where, example="['data', 'model']")
    return tuple(_check_str(v, where=f"{where}[{i}]") for i, v in enumerate(items))


def _check_ints(value: object, *, where: str, minimum: int) -> tuple[int, ...]:
    items = _sequence(value, where=where, example="[2, 4]")
    return tuple(_check_int(v, where=f"{where}[{i}]", minimum=minimum) for i, v in enumerate(items))


def as_spec(value: object, /, *, where: str = "spec") -> Spec:
    """Normalises a sharding to a :data:`Spec`.

    Accepts the canonical form and ``PartitionSpec``-like entries: per dimension ``None`` (or
    ``()``) for replicated, an axis name, or a sequence of axis names.

    Args:
      value: the sharding, one entry per array dimension.
      where: the field or key path named by errors.

    Returns:
      A tuple with one tuple of axis names per dimension.

    Raises:
      ConfigError: an entry is not ``None``, a name or a sequence of names, or an axis repeats.

    Example:
        >>> as_spec((None, "model", ("data", "fsdp")))
        ((), ('model',), ('data', 'fsdp'))
    """
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise invalid(
            "A sharding must be a sequence with one entry per array dimension.", where=where,
            value=value, remedy="write e.g. [[\"data\"], []] (JSON) or ((\"data\",), ()) (Python)")
    dims: list[tuple[str, ...]] = []
    for d, entry in enumerate(value):
        if entry is None:
            dims.append(())
        elif isinstance(entry, str):
            dims.append((_check_str(entry, where=f"{where}[{d}]"),))
        else:
            dims.append(_check_strs(entry, where=f"{where}[{d}]"))
    axes = [a for dim in dims for a in dim]
    repeated = sorted({a for a in axes if axes.count(a) > 1})
    if repeated:
        raise invalid(
            f"A sharding uses mesh axis {repeated[0]!r} on more than one dimension.",
            where=where, value=tuple(dims),
            remedy="split each mesh axis over at most one array dimension")
    return tuple(dims)


_TYPE = re.compile(r"([A-Za-z0-9_]+(?:<[A-Za-z0-9_]+>)?)\[([^\]]*)\]")
_DIM = re.compile(r"[0-9]+")


def parse_type(text: object, /, *, where: str = "type") -> tuple[str, tuple[int, ...]]:
    """A ``state_types`` / ``batch_types`` entry, ``"dtype[d0,d1,...]"``, as (dtype, shape).

    Args:
      text: e.g. ``"float32[64,256]"``; a scalar ``"float32[]"``; a PRNG key ``"key<fry>[]"``.
      where: the key path named by errors.

    Raises:
      ConfigError: ``text`` is not a string of that form (a dimension that is not a
        non-negative integer included).

    Example:
        >>> parse_type("float32[64, 256]"), parse_type("key<fry>[]")
        (('float32', (64, 256)), ('key<fry>', ()))
    """
    m = _TYPE.fullmatch(text.strip()) if isinstance(text, str) else None
    dims = m.group(2).strip() if m else ""
    parts = [d.strip() for d in dims.split(",")] if dims else []
    if m is None or not all(_DIM.fullmatch(d) for d in parts):
        raise invalid(
            "Expected a leaf's type written as dtype[shape], its dimensions non-negative "
            "integers.", where=where, value=text,
            remedy="write e.g. 'float32[64,256]' ('float32[]' for a scalar), or write the plan "
                   "again with sp.make_plan")
    return m.group(1), tuple(int(d) for d in parts)


def _check_rank(spec: Spec, type_text: str, *, where: str) -> None:
    """Raises ConfigError when ``spec`` has more entries than the leaf of type ``type_text``
    (checked by :func:`parse_type`) has dimensions."""
    shape = parse_type(type_text)[1]
    if len(spec) > len(shape):
        example = list(list(dim) for dim in spec[:len(shape)])
        raise invalid(
            f"The sharding has {len(spec)} entries, but the leaf is {type_text} "
            f"(rank {len(shape)}): one entry per dimension at most.", where=where,
            value=[list(dim) for dim in spec],
            remedy=f"give at most {len(shape)} entries, one per dimension of {list(shape)} "
                   f"([] for a dimension not split), e.g. {example}")


def _freeze_json(value: object, *, where: str) -> object:
    """JSON-native value -> immutable equivalent (lists -> tuples, dicts -> FrozenMap)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise invalid("Non-finite numbers cannot be written to a plan.", where=where,
                          value=value, remedy="use None for an unknown value")
        return value
    if isinstance(value, Mapping):
        # (an empty key is a key path too: the path of a state that is one array)
        return FrozenMap({_check_str(k, where=f"{where} key", empty_ok=True):
                          _freeze_json(v, where=f"{where}.{k}") for k, v in value.items()})
    if isinstance(value, Sequence):
        return tuple(_freeze_json(v, where=f"{where}[{i}]") for i, v in enumerate(value))
    raise invalid("Expected a JSON value (None, bool, number, string, list, mapping).",
                  where=where, value=value, remedy="convert it to a JSON-native value")


def _check_replica_layers(replicas: Sequence[Sequence[int]], layers: Sequence[Sequence[str]], *,
                          listed: bool) -> None:
    """Raises ConfigError unless every replica runs each of its layers on one stage and all
    replicas run the same layers (:data:`SHARED_LAYER` aside: every stage lists it).

    Which layers the step has is for its graph to say, when the plan is applied.

    Args:
      replicas: per replica, its stage indices (``Plan.replicas[r].stages``).
      layers: per stage, its layer names (``Plan.stages[i].layers``).
      listed: whether the plan lists its replicas (else ``replicas`` is its one implicit one).
    """
    groups = list(replicas) if listed else [tuple(range(len(layers)))]
    owners: list[dict[str, int]] = []  # per replica: layer -> the stage that runs it
    for r, indices in enumerate(groups):
        if not indices:
            raise invalid(
                f"Replica {r} has no stages.", where=f"plan.replicas[{r}].stages", value=[],
                remedy="list the replica's stages, or remove the replica and its microbatches")
        owner: dict[str, int] = {}
        for s in indices:
            for name in layers[s]:
                if name in owner and name != SHARED_LAYER:
                    on = (f"twice on stage {s}" if owner[name] == s
                          else f"on stage {owner[name]} and on stage {s}")
                    whose = f"replica {r}" if listed else (
                        "the plan's one replica (plan.replicas is empty)")
                    raise invalid(
                        f"Layer {name!r} runs {on} of {whose}.",
                        where=f"plan.stages[{s}].layers", value=list(layers[s]),
                        remedy="run each layer on one stage of a replica" + (
                            "" if listed else "; if these stages are several data-parallel "
                            "copies of the model, list them in plan.replicas and set each "
                            "stage's replica"))
                owner.setdefault(name, s)
        owner.pop(SHARED_LAYER, None)
        owners.append(owner)
    first = owners[0]
    for r, owner in enumerate(owners[1:], start=1):
        lacking = [name for name in first if name not in owner]
        for name, s in owner.items():
            if name not in first:
                elsewhere = any(name in other for q, other in enumerate(owners) if q != r)
                raise invalid(
                    f"Stage {s} (replica {r}) runs layer {name!r}, which "
                    + ("replica 0 does not run." if elsewhere else "no other replica runs."),
                    where=f"plan.stages[{s}].layers", value=list(layers[s]),
                    remedy=f"{did_you_mean(name, lacking)}every replica runs the same layers, "
                           f"each on one of its stages; replica 0 runs {_names(list(first))}")
        if lacking:
            name = lacking[0]
            raise invalid(
                f"Replica {r} runs no stage with layer {name!r}, which replica 0 runs (on stage "
                f"{first[name]}).", where=f"plan.replicas[{r}]",
                value={s: list(layers[s]) for s in groups[r]},
                remedy=f"every replica runs the same layers: add {name!r} to one of replica "
                       f"{r}'s stages {list(groups[r])}, or remove it from stage {first[name]} "
                       "if the step has no such layer")


def _names(names: Sequence[str], shown: int = 8) -> str:
    """``'pre', 'blocks.0', ... and 4 more``: at most ``shown`` names."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(map(repr, names[:shown])) + more
