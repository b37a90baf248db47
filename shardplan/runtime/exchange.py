"""The gradient all-reduce between data-parallel replicas that differ (another device type,
another layer split): a reduce-scatter and an all-gather over jax transfers between the
replicas' sub-meshes, each replica then updating its own layers.

Replicas that are identical run as one (:func:`~shardplan.runtime.spmd.identical_replicas`)
and all-reduce inside their stages' programs; what remains are *parties*: the merged replicas,
each holding, per cut value (a gradient sum, a metric), its sum over its own microbatches on
one of its stages. With ``G`` parties, every value's elements are cut into ``G`` chunks (the
value flattened, chunk ``q`` its ``q``-th ``1 / G``):

1. **scatter** (a program per stage holding values): each value flattened and cut, each chunk
   padded to a multiple of ``M`` elements (the least common multiple of the stages' device
   counts) and laid out as ``M`` rows over the stage's devices; the chunks bound for one
   stage, of one dtype, joined side by side into one *bucket* (as data-parallel training
   buckets its gradients): a row of a bucket lies on the same device for every chunk in it;
2. each bucket goes to its stage (one ``jax.device_put`` for them all);
3. **reduce** (per stage): party ``q``'s stage sums the ``G`` copies of its chunks, row by row
   with no communication (every copy of a chunk has its rows on the same devices);
4. the reduced chunks go back to the stages of the other parties holding their values, in
   buckets again;
5. **gather** (per stage): each party's stage joins the ``G`` reduced chunks of each value it
   holds into the value's own shape and sharding.

Each party's devices so receive ``2 (G - 1) / G`` of the bytes they hold, the ring all-reduce's
share (Patarasuk & Yuan 2009) that the stage planner prices
(:func:`~shardplan.solver.stages.pipeline.sync_transfer_bytes`), and every party ends with the same
bits of every sum (each chunk is reduced once, by one party, and copied). The transfers are
counted by the bytes their destination devices receive, per stage
(``plan.measured["sync_moved_bytes"]``). Flattening a value sharded on another dimension than
its first is a relayout inside the stage (an all-to-all on the stage's own links), which the
programs' compiled collectives show.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.runtime.partition import Program

__all__ = ["Exchange"]

Route = tuple[Any, Any, int, int, NamedSharding]
"""A transfer: ``(x, aval, source stage, destination stage, sharding there)``."""


def _rows(mesh: jax.sharding.Mesh) -> NamedSharding:
    """A bucket's layout on ``mesh``: its rows over every device of the mesh."""
    return NamedSharding(mesh, P(tuple(mesh.axis_names), None))


@dataclass(frozen=True)
class _Value:
    """One cut value of the exchange: its shape and dtype, per party its stage and sharding,
    its chunk bounds, and each chunk's width once padded and laid out as ``rows`` rows."""

    shape: tuple[int, ...]
    dtype: Any
    stages: tuple[int, ...]  # per party
    shardings: tuple[Any, ...]  # per party: the value's sharding there
    bounds: tuple[int, ...]  # G + 1 element offsets
    rows: int
    width: int

    def chunk(self, x: Any, q: int) -> Any:  # [rows, width]
        a, b = self.bounds[q], self.bounds[q + 1]
        flat = jnp.pad(x.reshape(-1)[a:b], (0, self.rows * self.width - (b - a)))
        return flat.reshape(self.rows, self.width)

    def join(self, chunks: Sequence[Any]) -> Any:
        pieces = [c.reshape(-1)[:self.bounds[q + 1] - self.bounds[q]]
                  for q, c in enumerate(chunks)]
        return jnp.concatenate(pieces).reshape(self.shape)


Key = tuple[int, int, str]
"""A bucket: ``(source stage, destination stage, dtype)``; equal stages: a party's own."""


class Exchange:
    """The all-reduce of every cut value over ``G`` parties (the module docstring).

    Args:
      stages: per party, per cut value, the stage (index into ``plan.stages``) holding it.
      avals: per cut value, its shape and dtype.
      shardings: ``(party, value) -> sharding`` of the value's sum on its stage (what the
        gather gives back).
      meshes: per stage, its mesh.
    """

    def __init__(self, stages: Sequence[Sequence[int]], avals: Sequence[Any],
                 shardings: Callable[[int, int], Any],
                 meshes: dict[int, jax.sharding.Mesh]) -> None:
        g = len(stages)
        self.parties = g
        self.meshes = meshes
        self.party = {s: p for p in range(g) for s in stages[p]}
        rows = math.lcm(*(meshes[s].devices.size for s in self.party))
        self.values: list[_Value] = []
        for i, aval in enumerate(avals):
            n = int(np.prod(aval.shape, dtype=np.int64))
            longest = -(-n // g)  # elements of the largest chunk
            self.values.append(_Value(
                tuple(aval.shape), aval.dtype, tuple(stages[p][i] for p in range(g)),
                tuple(shardings(p, i) for p in range(g)),
                tuple(n * q // g for q in range(g + 1)), rows, -(-longest // rows)))
        # per bucket, its values in order (a reduce-scatter bucket from party p's stage to
        # party q's holds the values the two hold there; the all-gather bucket back, the same)
        self.buckets: dict[Key, list[int]] = {}
        for i, v in enumerate(self.values):
            for p in range(g):
                for q in range(g):
                    key = (v.stages[p], v.stages[q], str(np.dtype(v.dtype)))
                    self.buckets.setdefault(key, []).append(i)
        self.held = {s: [i for i, v in enumerate(self.values) if v.stages[self.party[s]] == s]
                     for s in self.party}
        self.programs = {s: (self._scatter(s), self._reduce(s), self._gather(s))
                         for s, idx in self.held.items() if idx}

    def _out(self, stage: int, inward: bool) -> list[Key]:
        """The buckets leaving ``stage`` (or, ``inward``, arriving there), in order."""
        return sorted(k for k in self.buckets if k[1 if inward else 0] == stage)

    def _scatter(self, stage: int) -> Program:
        keys = self._out(stage, inward=False)

        def cut(xs: list[Any]) -> list[Any]:
            mine = dict(zip(self.held[stage], xs, strict=True))
            return [jnp.concatenate([self.values[i].chunk(mine[i], self.party[dst])
                                     for i in self.buckets[src, dst, dt]], axis=1)
                    for src, dst, dt in keys]

        return Program(-1, stage, jax.jit(cut, out_shardings=_rows(self.meshes[stage])), (),
                       ())

    def _columns(self, buckets: dict[Key, Any], key: Key, i: int) -> Any:
        """Value ``i``'s chunk in bucket ``key``."""
        at = 0
        for j in self.buckets[key]:
            if j == i:
                return buckets[key][:, at:at + self.values[i].width]
            at += self.values[j].width
        raise KeyError((key, i))

    def _reduce(self, stage: int) -> Program:
        into, keys = self._out(stage, inward=True), self._out(stage, inward=False)
        g = self.parties

        def total(arrived: list[Any]) -> list[Any]:
            buckets = dict(zip(into, arrived, strict=True))
            reduced = {}
            for i in self.held[stage]:
                v = self.values[i]
                copies = [self._columns(buckets, (v.stages[p], stage, str(np.dtype(v.dtype))),
                                        i) for p in range(g)]
                reduced[i] = sum(copies[1:], copies[0]).astype(v.dtype)
            return [jnp.concatenate([reduced[i] for i in self.buckets[key]], axis=1)
                    for key in keys]

        return Program(-1, stage, jax.jit(total, out_shardings=_rows(self.meshes[stage])),
                       (), ())

    def _gather(self, stage: int) -> Program:
        p, into = self.party[stage], self._out(stage, inward=True)
        g = self.parties

        def join(arrived: list[Any]) -> list[Any]:
            buckets = dict(zip(into, arrived, strict=True))
            return [self.values[i].join([
                self._columns(buckets, (self.values[i].stages[q], stage,
                                        str(np.dtype(self.values[i].dtype))), i)
                for q in range(g)]) for i in self.held[stage]]

        out = [self.values[i].shardings[p] for i in self.held[stage]]
        return Program(-1, stage, jax.jit(join, out_shardings=out), (), ())

    def run(self, sums: Sequence[list[Any]],
            run: Callable[[Program, str, list[Any]], Any],
            move: Callable[[list[Route]], list[Any]],
            here: Callable[[int], bool]) -> list[list[Any]]:
        """Every party's totals of ``sums`` (per party, per cut value, its sum on its stage;
        ``None`` where the stage is another process's), on the same stages and shardings.

        Args:
          run: runs a program (``(program, name, args) -> outputs``).
          move: each :data:`Route` of a list there (``None`` where the destination is not
            here), all in one call.
          here: whether a stage's devices are this process's.
        """
        buckets: dict[Key, Any] = {}
        for s, (scatter, _, _) in self.programs.items():
            keys = self._out(s, inward=False)
            args = [sums[self.party[s]][i] for i in self.held[s]]
            outs = (run(scatter, f"exchange scatter {s}", [args]) if here(s)
                    else [None] * len(keys))
            buckets.update(zip(keys, outs, strict=True))
        self._send(buckets, move)
        arrived: dict[Key, Any] = {}
        for s, (_, reduce, _) in self.programs.items():
            keys = self._out(s, inward=False)
            args = [buckets[k] for k in self._out(s, inward=True)]
            outs = (run(reduce, f"exchange reduce {s}", [args]) if here(s)
                    else [None] * len(keys))
            arrived.update(zip(keys, outs, strict=True))
        del buckets
        self._send(arrived, move)
        out: list[list[Any]] = [[None] * len(self.values) for _ in range(self.parties)]
        for s, (_, _, gather) in self.programs.items():
            args = [arrived[k] for k in self._out(s, inward=True)]
            outs = (run(gather, f"exchange gather {s}", [args]) if here(s)
                    else [None] * len(self.held[s]))
            for i, x in zip(self.held[s], outs, strict=True):
                out[self.party[s]][i] = x
        return out

    def _send(self, buckets: dict[Key, Any], move: Callable[[list[Route]], list[Any]]) -> None:
        """Every bucket bound for another stage moved there (in place in ``buckets``)."""
        sent = [k for k in buckets if k[0] != k[1]]
        routes: list[Route] = []
        for key in sent:
            src, dst, dt = key
            width = sum(self.values[i].width for i in self.buckets[key])
            rows = self.values[self.buckets[key][0]].rows
            routes.append((buckets[key], jax.ShapeDtypeStruct((rows, width), np.dtype(dt)),
                           src, dst, _rows(self.meshes[dst])))
        for key, x in zip(sent, move(routes), strict=True):
            buckets[key] = x
