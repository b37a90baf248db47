"""The gradient all-reduce between data-parallel replicas that differ (another device type,
another layer split): a reduce-scatter and an all-gather over jax transfers between the
replicas' sub-meshes, each replica then updating its own layers.

Replicas that are identical run as one (:func:`~shardplan.runtime.spmd.identical_replicas`)
and all-reduce inside their stages' programs; what remains are *parties*: the merged replicas,
each holding, per cut value (a gradient sum, a metric), its sum over its own microbatches on
one of its stages. With ``G`` parties, every value's elements are cut into ``G`` chunks (the
value flattened, chunk ``q`` its ``q``-th ``1 / G``):

1. **scatter** (a program per stage holding values): each value flattened and cut, each chunk
   laid out over all the stage's devices (one 1-D shard each, padded to a length every stage
   holding the value divides);
2. chunk ``q`` goes to the stage of party ``q`` holding that value (``jax.device_put``);
3. **reduce** (per stage): party ``q``'s stage sums the ``G`` copies of its chunks, shard by
   shard with no communication (all copies of a chunk are padded and laid out alike);
4. the reduced chunk goes back to the stage of every other party holding the value;
5. **gather** (per stage): each party's stage joins the ``G`` reduced chunks of each value it
   holds into the value's own shape and sharding.

Each party's devices so receive ``2 (G - 1) / G`` of the bytes they hold, the ring all-reduce's
share (Patarasuk & Yuan 2009) that the stage planner prices
(:func:`~shardplan.solver.pipeline.sync_transfer_bytes`), and every party ends with the same
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


def _flat(mesh: jax.sharding.Mesh) -> NamedSharding:
    """A 1-D value laid out over every device of ``mesh``, one shard each."""
    return NamedSharding(mesh, P(tuple(mesh.axis_names)))


@dataclass(frozen=True)
class _Value:
    """One cut value of the exchange: its shape and dtype, per party its stage and sharding,
    its chunk bounds and the padded chunk length."""

    shape: tuple[int, ...]
    dtype: Any
    stages: tuple[int, ...]  # per party
    shardings: tuple[Any, ...]  # per party: the value's sharding there
    bounds: tuple[int, ...]  # G + 1 element offsets
    padded: int  # every chunk's length once padded

    def chunk(self, x: Any, q: int) -> Any:
        a, b = self.bounds[q], self.bounds[q + 1]
        return jnp.pad(x.reshape(-1)[a:b], (0, self.padded - (b - a)))

    def join(self, chunks: Sequence[Any]) -> Any:
        pieces = [c[:self.bounds[q + 1] - self.bounds[q]] for q, c in enumerate(chunks)]
        return jnp.concatenate(pieces).reshape(self.shape)


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
        self.values: list[_Value] = []
        for i, aval in enumerate(avals):
            n = int(np.prod(aval.shape, dtype=np.int64))
            holders = tuple(stages[p][i] for p in range(g))
            multiple = math.lcm(*(meshes[s].devices.size for s in holders))
            bounds = tuple(n * q // g for q in range(g + 1))
            longest = -(-n // g)  # the largest chunk
            self.values.append(_Value(tuple(aval.shape), aval.dtype, holders,
                                      tuple(shardings(p, i) for p in range(g)), bounds,
                                      -(-longest // multiple) * multiple))
        # per stage: its party and the values it holds, in order
        self.held: dict[int, tuple[int, list[int]]] = {}
        for p in range(g):
            for i in range(len(avals)):
                self.held.setdefault(stages[p][i], (p, []))[1].append(i)
        self.scatter = {s: self._scatter(s, idx) for s, (_, idx) in self.held.items()}
        self.reduce = {s: self._reduce(s, idx) for s, (_, idx) in self.held.items()}
        self.gather = {s: self._gather(s, p, idx) for s, (p, idx) in self.held.items()}

    def _scatter(self, stage: int, idx: list[int]) -> Program:
        flat = _flat(self.meshes[stage])

        def cut(xs: list[Any]) -> list[Any]:
            return [self.values[i].chunk(x, q) for i, x in zip(idx, xs, strict=True)
                    for q in range(self.parties)]

        return Program(-1, stage, jax.jit(cut, out_shardings=flat), (), ())

    def _reduce(self, stage: int, idx: list[int]) -> Program:
        flat = _flat(self.meshes[stage])

        def total(chunks: list[Any]) -> list[Any]:  # per value, its G copies of the chunk
            g = self.parties
            return [sum(chunks[n * g + 1:(n + 1) * g], chunks[n * g]).astype(self.values[i].dtype)
                    for n, i in enumerate(idx)]

        return Program(-1, stage, jax.jit(total, out_shardings=flat), (), ())

    def _gather(self, stage: int, party: int, idx: list[int]) -> Program:
        g = self.parties

        def join(chunks: list[Any]) -> list[Any]:  # per value, its G reduced chunks
            return [self.values[i].join(chunks[n * g:(n + 1) * g]) for n, i in enumerate(idx)]

        out = [self.values[i].shardings[party] for i in idx]
        return Program(-1, stage, jax.jit(join, out_shardings=out), (), ())

    def run(self, sums: Sequence[list[Any]],
            run: Callable[[Program, str, list[Any]], Any],
            move: Callable[[Any, Any, int, int, NamedSharding], Any],
            here: Callable[[int], bool]) -> list[list[Any]]:
        """Every party's totals of ``sums`` (per party, per cut value, its sum on its stage;
        ``None`` where the stage is another process's), on the same stages and shardings.

        Args:
          run: runs a program (``(program, name, args) -> outputs``).
          move: ``(x, aval, src stage, dst stage, sharding) -> x there`` (``None`` where the
            destination is not here).
          here: whether a stage's devices are this process's.
        """
        g = self.parties
        chunks: dict[tuple[int, int, int], Any] = {}  # (value, copy's party, chunk) -> on the
        # chunk's reducing stage (a copy made where it is reduced stays)
        for s, (p, idx) in self.held.items():
            outs = (run(self.scatter[s], f"exchange scatter {s}", [[sums[p][i] for i in idx]])
                    if here(s) else [None] * (len(idx) * g))
            for n, i in enumerate(idx):
                for q in range(g):
                    chunks[i, p, q] = outs[n * g + q]
        for (i, p, q), x in list(chunks.items()):
            if p != q:
                v = self.values[i]
                chunks[i, p, q] = move(x, self._chunk_aval(v), v.stages[p], v.stages[q],
                                       _flat(self.meshes[v.stages[q]]))
        reduced: dict[tuple[int, int], Any] = {}  # (value, party) -> reduced chunk, per party
        for s, (q, idx) in self.held.items():
            args = [chunks[i, p, q] for i in idx for p in range(g)]
            outs = (run(self.reduce[s], f"exchange reduce {s}", [args]) if here(s)
                    else [None] * len(idx))
            for i, x in zip(idx, outs, strict=True):
                reduced[i, q] = x
        del chunks
        copies: dict[tuple[int, int, int], Any] = {}  # (value, chunk, party receiving)
        for (i, q), x in reduced.items():
            v = self.values[i]
            for p in range(g):
                copies[i, q, p] = x if p == q else move(
                    x, self._chunk_aval(v), v.stages[q], v.stages[p],
                    _flat(self.meshes[v.stages[p]]))
        out: list[list[Any]] = [[None] * len(self.values) for _ in range(g)]
        for s, (p, idx) in self.held.items():
            args = [copies[i, q, p] for i in idx for q in range(g)]
            outs = (run(self.gather[s], f"exchange gather {s}", [args]) if here(s)
                    else [None] * len(idx))
            for i, x in zip(idx, outs, strict=True):
                out[p][i] = x
        return out

    @staticmethod
    def _chunk_aval(v: _Value) -> Any:
        return jax.ShapeDtypeStruct((v.padded,), v.dtype)
