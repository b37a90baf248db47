"""Brute force for the stage planner's tests: every feasible pipeline plan of a small problem.

:func:`all_plans` enumerates plans without any pruning beyond the device counts: every cut of
the layers into contiguous stages (or, interleaved, every stage count whose chunks divide the
layers), every (group, devices, remat) per stage, every multiset of such replicas that fits the
groups and every split of the microbatches over them. :func:`best` scores each with
:func:`~shardplan.solver.stages.pipeline.evaluate_pipeline` and keeps the smallest objective.
:func:`random_problem` draws small problems whose plan count stays in the thousands.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from shardplan.solver.stages.pipeline import (
    DeviceGroup,
    LayerKind,
    LayerOption,
    Link,
    PipelinePlan,
    PipelineProblem,
    Replica,
    Schedule,
    StagePlacement,
    evaluate_pipeline,
)

Stages = tuple[StagePlacement, ...]


def _types(problem: PipelineProblem, layers: tuple[int, ...]) -> list[tuple[int, int, str]]:
    """Every (group, devices, remat) with an option for each layer of ``layers``."""
    out = []
    for g, group in enumerate(problem.groups):
        sizes = sorted({o.devices for k in problem.kinds for o in k.options.get(g, ())})
        for d in sizes:
            if d <= group.count and all(problem.kinds[problem.layers[i]].option(g, d)
                                        for i in layers):
                out.extend((g, d, r) for r in problem.remats)
    return out


def _cuts(n: int) -> Iterator[list[tuple[int, ...]]]:
    for k in range(1, n + 1):
        for bounds in itertools.combinations(range(1, n), k - 1):
            edges = (0, *bounds, n)
            yield [tuple(range(a, b)) for a, b in itertools.pairwise(edges)]


def replica_structures(problem: PipelineProblem, chunks: int) -> list[Stages]:
    """Every replica's stage list (without microbatches) for ``chunks`` (1: not interleaved)."""
    n = len(problem.layers)
    if chunks == 1:
        parts_list = list(_cuts(n))
    else:
        parts_list = []
        for k in range(1, n + 1):
            if n % (k * chunks) == 0:
                size = n // (k * chunks)
                parts_list.append([tuple(j for c in range(chunks)
                                         for j in range((i + c * k) * size,
                                                        (i + c * k + 1) * size))
                                   for i in range(k)])
    out: list[Stages] = []
    for parts in parts_list:
        if problem.max_stages and len(parts) > problem.max_stages:
            continue
        for combo in itertools.product(*[_types(problem, p) for p in parts]):
            used = [0] * len(problem.groups)
            for g, d, _ in combo:
                used[g] += d
            if all(u <= grp.count for u, grp in zip(used, problem.groups, strict=True)):
                out.append(tuple(StagePlacement(g, d, p, r)  # type: ignore[arg-type]
                                 for (g, d, r), p in zip(combo, parts, strict=True)))
    return out


def _splits(total: int, steps: list[int]) -> Iterator[tuple[int, ...]]:
    """Every ``(m_0, ..., m_{R-1})``, ``m_r`` a positive multiple of ``steps[r]``, summing to
    ``total``."""
    if len(steps) == 1:
        if total >= steps[0] and total % steps[0] == 0:
            yield (total,)
        return
    for m in range(steps[0], total + 1, steps[0]):
        for rest in _splits(total - m, steps[1:]):
            yield (m, *rest)


def all_plans(problem: PipelineProblem) -> Iterator[PipelinePlan]:
    """Every structurally valid plan (memory and throughput unchecked)."""
    for mb in problem.microbatch_sizes:
        if problem.batch % mb:
            continue
        total = problem.batch // mb
        for schedule in problem.schedules:
            for v in (problem.chunks if schedule == "interleaved" else (1,)):
                structures = replica_structures(problem, v)
                yield from _plans(problem, structures, total, mb, schedule, v)


def _plans(problem: PipelineProblem, structures: list[Stages], total: int, mb: int,
           schedule: Schedule, v: int) -> Iterator[PipelinePlan]:
    usage = []
    for st in structures:
        used = [0] * len(problem.groups)
        for s in st:
            used[s.group] += s.devices
        usage.append(used)
    for pick in _multisets(usage, [g.count for g in problem.groups], 0, total):
        steps = [len(structures[i]) if v > 1 else 1 for i in pick]
        for ms in _splits(total, steps):
            yield PipelinePlan(tuple(Replica(structures[i], m) for i, m in
                                     zip(pick, ms, strict=True)), mb, schedule, v)


def _multisets(usage: list[list[int]], free: list[int], first: int,
               most: int) -> Iterator[tuple[int, ...]]:
    """Every non-empty multiset (ascending indices from ``first``) of at most ``most`` items
    whose usage fits ``free``."""
    if most == 0:
        return
    for i in range(first, len(usage)):
        left = [f - u for f, u in zip(free, usage[i], strict=True)]
        if min(left) < 0:
            continue
        yield (i,)
        for rest in _multisets(usage, left, i, most - 1):
            yield (i, *rest)


def objective(problem: PipelineProblem, plan: PipelinePlan) -> float:
    ev = evaluate_pipeline(problem, plan)
    if not ev.feasible:
        return float("inf")
    return ev.step_time_s if problem.objective == "time" else ev.cost_per_step


def best(problem: PipelineProblem) -> tuple[float, int]:
    """The smallest objective over every plan (``inf``: none feasible) and the plan count."""
    value, count = float("inf"), 0
    for plan in all_plans(problem):
        count += 1
        value = min(value, objective(problem, plan))
    return value, count


def count_plans(problem: PipelineProblem, limit: int) -> int:
    """Plans :func:`all_plans` yields; past ``limit`` (plans, or ``limit // 20`` replica
    structures for some schedule, or ``10 * limit`` replica multisets tried) it stops and
    returns ``limit + 1``."""
    tried = count = 0
    for mb in problem.microbatch_sizes:
        if problem.batch % mb:
            continue
        total = problem.batch // mb
        for schedule in problem.schedules:
            for v in (problem.chunks if schedule == "interleaved" else (1,)):
                if _structure_count(problem, v) > limit // 20:
                    return limit + 1
                structures = replica_structures(problem, v)
                usage = []
                for st in structures:
                    used = [0] * len(problem.groups)
                    for stage in st:
                        used[stage.group] += stage.devices
                    usage.append(used)
                for pick in _multisets(usage, [g.count for g in problem.groups], 0, total):
                    tried += 1
                    steps = [len(structures[i]) if v > 1 else 1 for i in pick]
                    count += sum(1 for _ in _splits(total, steps))
                    if count > limit or tried > 10 * limit:
                        return limit + 1
    return count


def _structure_count(problem: PipelineProblem, chunks: int) -> int:
    n = len(problem.layers)
    if chunks > 1:
        return len(replica_structures(problem, chunks))
    total = 0
    for parts in _cuts(n):
        if problem.max_stages and len(parts) > problem.max_stages:
            continue
        prod = 1
        for p in parts:
            prod *= len(_types(problem, p))
        total += prod
    return total


def random_problem(rng: random.Random) -> PipelineProblem:
    """A small random problem: 1-8 layers of 1-2 kinds, 1-3 groups of 1-8 devices, random
    costs, memory, links (some pairs of groups with a link of their own) and candidates. The
    caller rejects draws with too many plans."""
    n_groups = rng.choice((1, 1, 2, 2, 3))
    n = rng.choice((1, 2, 2, 3, 3, 4, 4, 4, 5, 6, 8)) if n_groups < 3 else rng.choice((1, 2, 3, 4))
    groups = []
    for g in range(n_groups):
        count = rng.choice((1, 2, 2, 3, 4, 4, 6, 8))
        per_node = rng.choice([d for d in (1, 2, 4, 8) if d <= max(count, 1)])
        intra = Link(rng.uniform(1.0, 50.0), rng.uniform(0.0, 0.05))
        inter = Link(rng.uniform(0.5, 10.0), rng.uniform(0.0, 0.2))
        groups.append(DeviceGroup(f"g{g}", count, per_node, rng.uniform(4.0, 40.0),
                                  rng.uniform(0.5, 4.0), intra, inter))
    remats = tuple(rng.sample(("none", "selective", "full"), rng.choice((1, 1, 2, 3))))
    n_kinds = rng.choice((1, 1, 2))
    kinds = []
    sizes_per_group = []
    for grp in groups:
        fits = [d for d in (1, 2, 4) if d <= grp.count]
        sizes_per_group.append(sorted(rng.sample(fits, min(len(fits), rng.choice((1, 1, 2))))))
    for k in range(n_kinds):
        options = {}
        for g, sizes in enumerate(sizes_per_group):
            if k and rng.random() < 0.15:
                continue  # a kind this group cannot run
            opts = []
            for d in sizes:
                speed = d ** rng.uniform(0.5, 1.0)
                rec = {"none": (0.0, 0.0), "selective": (rng.uniform(0, 0.1), rng.uniform(0, 0.3)),
                       "full": (rng.uniform(0, 0.2), rng.uniform(0.2, 1.0))}
                act = {"none": rng.uniform(1.0, 4.0) / d, "selective": rng.uniform(0.3, 1.5) / d,
                       "full": rng.uniform(0.05, 0.5)}
                opts.append(LayerOption(
                    d, (rng.uniform(0, 0.2), rng.uniform(0.1, 1.0) / speed),
                    (rng.uniform(0, 0.3), rng.uniform(0.2, 2.0) / speed),
                    {r: rec[r] for r in remats}, {r: act[r] for r in remats},
                    rng.uniform(1.0, 12.0) / d, rng.uniform(0.0, 0.3) / d))
            options[g] = tuple(opts)
        kinds.append(LayerKind(f"k{k}", options, rng.uniform(0.1, 3.0), rng.uniform(0.5, 8.0)))
    layers = tuple(rng.randrange(n_kinds) for _ in range(n))
    mb_all = rng.sample((1, 2, 3), rng.choice((1, 2)))
    mb_base = 1
    for m in mb_all:
        mb_base = mb_base * m // _gcd(mb_base, m)
    batch = mb_base * rng.choice((1, 2, 2, 3, 4, 4, 6))
    schedules = tuple(rng.sample(("gpipe", "1f1b", "interleaved"), rng.choice((1, 2, 3))))
    objective = "cost" if rng.random() < 0.25 else "time"
    between = Link(rng.uniform(0.3, 20.0), rng.uniform(0.0, 0.3))
    # Some pairs of groups get their own link (faster or slower, lower or higher latency).
    group_links = {(a, b): Link(rng.uniform(0.3, 20.0), rng.uniform(0.0, 0.3))
                   for a, b in itertools.combinations(range(n_groups), 2) if rng.random() < 0.5}
    return PipelineProblem(
        tuple(kinds), layers, tuple(groups), between, batch, tuple(sorted(mb_all)),
        schedules=schedules, remats=remats,  # type: ignore[arg-type]
        chunks=tuple(sorted(rng.sample((1, 2, 3) if rng.random() < 0.1 else (2, 3),
                                       rng.choice((1, 2))))),
        max_stages=rng.choice((0, 0, 0, 2, 3)),
        objective=objective,  # type: ignore[arg-type]
        min_throughput=rng.uniform(0.0, 0.6) if objective == "cost" else 0.0,
        group_links=group_links)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
