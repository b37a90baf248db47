"""Saved activations: the bytes the forward pass leaves for the backward pass.

Per remat policy (``none``, ``selective``, ``full``) and per layer, counted on the buffers of
:mod:`shardplan.cost.buffers`. Everything here is re-exported by :mod:`shardplan.cost.memory`,
whose estimate reads :func:`saved_activation_bytes`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from shardplan.cost.buffers import _buffers, buffer_tensors
from shardplan.trace.graph import OpGraph

__all__ = [
    "ActivationFacts",
    "RematPolicy",
    "activation_facts",
    "backward_work_bytes",
    "saved_activation_bytes",
    "saved_activation_bytes_by_layer",
]

RematPolicy = Literal["none", "selective", "full"]


def saved_activation_bytes(graph: OpGraph, local_bytes: Callable[[int], int],
                           policy: RematPolicy, *, layer: int | None = None) -> int:
    """Bytes of activations the forward pass leaves for the backward pass, under a remat policy.

    What XLA keeps, not what the jaxpr names: the buffers of the memory model (fusion, library
    fusions, in-place writes, dot layout copies; :mod:`shardplan.cost.buffers`) that a forward op
    writes and that live into the backward pass. A value the backward pass reads but XLA fuses into
    its reader (``2·x`` of a norm's variance, ``1 − tanh`` of a GELU) costs nothing of its own; its
    buffered operands stay alive instead. A loop's stacked results are kept whole: XLA fuses nothing
    across a loop's boundary. Only activations count, values that depend on the batch: a weight cast
    to the compute dtype or a mask built from ``iota`` is the same for any microbatch (a bf16
    model's weight casts: 2 bytes per parameter, 3.6e9 per GPT-3 175B block).

    * ``none`` keeps all of them.
    * ``selective`` recomputes the attention core (Korthikanti et al. 2022, section 4.2): the
      ``[.., s, s]`` results of a dot with batch dimensions (the scores) and every value
      computed from them alone (mask, softmax, its row sums), up to the dot that contracts
      them with the values; it keeps the rest, q, k and v included. As
      ``jax.checkpoint`` of the core alone, or ``save_anything_except_these_names`` on its
      values.
    * ``full`` keeps only each layer's input: the activations that earlier layers hand to it
      (``jax.checkpoint`` of the whole layer), and recomputes the rest.

    Measured against ``memory_analysis()`` of GPT train steps on one CPU device, float32: the
    temp bytes one block more adds per sample (two layer counts, two batch sizes), remat applied
    by a ``custom_vjp`` that recomputes the block or the attention core once the cotangent is
    there (``jax.checkpoint``'s recomputation is scheduled into the forward pass by XLA:CPU:
    no bytes saved). Per block and sample, predicted / XLA:

    * gpt-tiny (s 32, h 64, 4 heads), a list of blocks: none 231,424 / 231,424, selective
      197,632 / 197,376; a scan: none 329,984 / 329,728, selective 296,192 / 295,936, full
      8,192 / 8,192 (``tests/cost/test_cost_memory.py``);
    * gpt-small at s 256 (h 768, 12 heads), a scan: none 34.64e6 / 34.64e6, selective
      28.32e6 / 28.32e6; a list, batch 8 to 16: selective 22.04e6 / 22.03e6, none 28.3e6 /
      31.5e6: there XLA:CPU also writes out the softmax's broadcast divisor ``[b, a, s, s]``
      for the backward pass's library fusion, early, in the forward pass (not modelled, nor
      in the temp estimate, which is 6 % under XLA's on this step).

    Not measurable on CPU: bfloat16 (XLA:CPU computes and keeps bfloat16 values in float32),
    and full remat of a list of blocks (the peak is then elsewhere).

    Args:
      graph: the traced step (without remat: the policies are predicted from it).
      local_bytes: bytes of a tensor on one device.
      policy: the remat policy.
      layer: only the activations of this layer (default: all); a scanned stack's loop
        state is shared evenly by its layers.

    Example:
        >>> import models, shardplan as sp
        >>> config = models.load_model_config("gpt-tiny")
        >>> graphdef, state = models.abstract_train_state(config)
        >>> graph = sp.trace(models.make_train_step(graphdef), state,
        ...                  models.example_batch(config, 4, abstract=True))
        >>> [saved_activation_bytes(graph, lambda t: graph.tensors[t].nbytes, p, layer=1)
        ...  for p in ("none", "selective", "full")]
        [925696, 790528, 32768]
    """
    per_layer, total = _saved_activations(graph, local_bytes, activation_facts(graph))
    if layer is None:
        return total[policy]
    return per_layer.get(layer, {}).get(policy, 0)


def saved_activation_bytes_by_layer(graph: OpGraph, local_bytes: Callable[[int], int], *,
                                    facts: ActivationFacts | None = None
                                    ) -> dict[int, dict[RematPolicy, int]]:
    """Per layer index, :func:`saved_activation_bytes` of each policy, in one pass.

    Args:
      graph: the traced step.
      local_bytes: bytes of a tensor on one device.
      facts: ``activation_facts(graph)``, to share between shardings of one graph.
    """
    per_layer, _ = _saved_activations(graph, local_bytes, facts or activation_facts(graph))
    return {layer.index: dict(per_layer.get(layer.index, _no_activations()))
            for layer in graph.layers}


def backward_work_bytes(graph: OpGraph, local_bytes: Callable[[int], int], *,
                        facts: ActivationFacts | None = None
                        ) -> dict[int, dict[RematPolicy, int]]:
    """Per layer index and remat policy, the backward pass's working bytes on one device: the
    most, over the layer's backward ops, of the live buffers that backward ops write and
    backward ops last read (:mod:`shardplan.cost.buffers`; the traced batch). Not the saved
    activations (forward buffers) and not the gradients the update reads: what a pipeline
    stage's backward program allocates beside its arguments and results while it runs the
    layer. A scanned stack's layers share the body's buffers (one iteration's).

    Under ``selective`` the attention core's values are computed again when the layer's
    backward starts and live until their last backward reader, beside the backward's own
    buffers, so they are counted here (the demo's last stage, a block and the head at
    microbatch 1: 1,348 KiB predicted with them, 832 KiB without, 1,476 KiB compiled). Under
    ``full`` the recomputed forward is the stage's, counted against these bytes by the stage
    planner (``solver.pipeline.stage_work``); ``full`` and ``none`` are the same here.

    Measured against the backward programs of tiny GPT pipeline stages on XLA:CPU (one block,
    no remat, microbatch 2): 106,496 bytes per sample predicted, 107,648 compiled.

    Example:
        >>> import models, shardplan as sp
        >>> config = models.load_model_config("gpt-tiny")
        >>> graphdef, state = models.abstract_train_state(config)
        >>> graph = sp.trace(models.make_train_step(graphdef), state,
        ...                  models.example_batch(config, 2, abstract=True))
        >>> backward_work_bytes(graph, lambda t: graph.tensors[t].nbytes)[1]["none"]
        212992
    """
    facts = facts or activation_facts(graph)
    inputs = set(graph.inputs)
    outputs = {t for t in graph.outputs if t is not None}
    buffers = _buffers(graph, local_bytes, inputs, outputs, {}, facts.fused)
    backward = [op.phase in ("backward", "recompute") for op in graph.ops]
    delta = [0] * (len(graph.ops) + 1)
    intervals = [(a, b, size) for a, b, size in buffers.spans.values()]
    intervals += [(c[0], c[1], c[2]) for c in buffers.broadcasts.values()]
    intervals += [(c[0], c[1], c[2]) for copies in buffers.copies.values() for c in copies]
    for start, end, size in intervals:
        if backward[start] and backward[end]:
            delta[start] += size
            delta[end + 1] -= size
    first: dict[tuple[int, ...], int] = {}  # per layers, their first backward op
    for op in graph.ops:
        if backward[op.id] and op.layers:
            first.setdefault(op.layers, op.id)
    core = [0] * (len(graph.ops) + 1)  # the recomputed attention core (selective)
    for root, (_, end, size) in buffers.spans.items():
        producer = graph.ops[graph.tensors[root].producer or 0]
        if (producer.phase == "forward" and backward[end] and facts.varies[root]
                and facts.core[root] and producer.layers in first):
            core[min(first[producer.layers], end)] += size
            core[end + 1] -= size
    out: dict[int, dict[RematPolicy, int]] = {
        layer.index: {"none": 0, "selective": 0, "full": 0} for layer in graph.layers}
    live = live_core = 0
    for op in graph.ops:
        live += delta[op.id]
        live_core += core[op.id]
        if backward[op.id]:
            for i in op.layers:
                work = out[i]
                work["none"] = work["full"] = max(work["none"], live)
                work["selective"] = max(work["selective"], live + live_core)
    return out


@dataclasses.dataclass(frozen=True)
class ActivationFacts:
    """What the saved activations of a graph are, whatever its sharding (per tensor id).

    Attributes:
      fused: ``buffer_tensors(graph)``: written to memory by XLA's loop fusion.
      varies: depends on the batch (an activation), not on parameters and constants alone.
      core: a value of an attention core, which selective remat recomputes.
      layer_inputs: per layer, the activations its forward ops read that ops outside it
        wrote (what full remat keeps).
    """

    fused: tuple[bool, ...]
    varies: tuple[bool, ...]
    core: tuple[bool, ...]
    layer_inputs: Mapping[int, frozenset[int]]


def activation_facts(graph: OpGraph) -> ActivationFacts:
    """The sharding-independent part of :func:`saved_activation_bytes` of ``graph``."""
    varies = _batch_dependent(graph)
    return ActivationFacts(
        fused=tuple(buffer_tensors(graph)), varies=tuple(varies),
        core=tuple(_attention_core(graph, varies)),
        layer_inputs={i: frozenset(ts) for i, ts in _layer_inputs(graph, varies).items()})


def _no_activations() -> dict[RematPolicy, int]:
    return {"none": 0, "selective": 0, "full": 0}


def _saved_activations(graph: OpGraph, local_bytes: Callable[[int], int],
                       facts: ActivationFacts
                       ) -> tuple[dict[int, dict[RematPolicy, int]], dict[RematPolicy, int]]:
    """Per layer and in all, the saved activation bytes of each policy."""
    local_bytes = [local_bytes(t) for t in range(len(graph.tensors))].__getitem__  # read often
    inputs = set(graph.inputs)
    outputs = {t for t in graph.outputs if t is not None}
    buffers = _buffers(graph, local_bytes, inputs, outputs, {}, facts.fused)
    varies, core = facts.varies, facts.core
    backward = [op.phase in ("backward", "recompute") for op in graph.ops]
    # Bytes by the layers that own them (a loop body's: all of the stack's), then by layer.
    owned: dict[tuple[int, ...], dict[RematPolicy, int]] = collections.defaultdict(
        _no_activations)

    def keep(layers: tuple[int, ...], nbytes: int, in_core: bool) -> None:
        owned[layers]["none"] += nbytes
        if not in_core:
            owned[layers]["selective"] += nbytes

    for root, (_, end, nbytes) in buffers.spans.items():
        producer = graph.ops[graph.tensors[root].producer or 0]
        if producer.phase == "forward" and backward[end] and varies[root]:
            keep(producer.layers, nbytes, core[root])
    for t, copies in buffers.copies.items():
        producer_id = graph.tensors[t].producer
        if producer_id is None or graph.ops[producer_id].phase != "forward" or not varies[t]:
            continue
        for _, end, nbytes, *_ in copies:
            if backward[end]:
                keep(graph.ops[producer_id].layers, nbytes, core[t])
    for (t, _), (start, end, nbytes, *_) in buffers.broadcasts.items():
        # Written out at the activation's shape even when the broadcast value is a
        # parameter (a norm's scale); it belongs to the layer whose backward pass reads it.
        if not backward[start] and backward[end]:
            keep(graph.ops[end].layers, nbytes, core[t])
    per_layer: dict[int, dict[RematPolicy, int]] = collections.defaultdict(_no_activations)
    total = _no_activations()
    for layers, kept in owned.items():
        for policy, nbytes in kept.items():
            total[policy] += nbytes
            for i in layers:  # a loop's state is shared by the layers of its body
                per_layer[i][policy] += nbytes // len(layers)
    # Full remat: each layer keeps what earlier layers hand to it.
    for i, received in facts.layer_inputs.items():
        nbytes = sum(local_bytes(t) for t in received)
        per_layer[i]["full"] += nbytes
        total["full"] += nbytes
    return per_layer, total


def _batch_dependent(graph: OpGraph) -> list[bool]:
    """Per tensor, whether it depends on an input other than parameters and optimizer state
    (the batch): activations, not weights cast to another dtype or masks built from iota."""
    fixed = {p.tensor for p in graph.parameters if p.role in ("parameter", "optimizer_state")}
    varies = [False] * len(graph.tensors)
    for t in graph.inputs:
        varies[t] = t not in fixed
    for op in graph.ops:  # in program order: operands first
        if any(varies[t] for t in op.inputs):
            for t in op.outputs:
                varies[t] = True
    return varies


def _attention_core(graph: OpGraph, varies: Sequence[bool]) -> list[bool]:
    """Per tensor, whether selective remat recomputes it: the ``[.., s, s]`` result of a dot
    with batch dimensions (attention scores), and forward values computed from such values
    and constants alone (masked scores, softmax, its row sums, their stacks in a loop)."""
    core = [False] * len(graph.tensors)
    for op in graph.ops:
        if op.phase != "forward":
            continue
        operands = [t for t in op.inputs if varies[t]]
        if op.primitive == "dot_general" and op.attrs.get("lhs_batch"):
            shape = graph.tensors[op.outputs[0]].shape
            scores = len(shape) >= 2 and shape[-1] == shape[-2] > 1
            if scores and not any(core[t] for t in operands):
                core[op.outputs[0]] = True
            continue  # the dot of the probabilities with v ends the core
        if operands and all(core[t] for t in operands):
            for t in op.outputs:
                core[t] = True
    return core


def _layer_inputs(graph: OpGraph, varies: Sequence[bool]) -> dict[int, set[int]]:
    """Per layer, the activations its forward ops read that ops outside it wrote (graph
    inputs, such as the batch, are arguments and not counted). A scanned stack's layers share
    its body: each receives what enters the stack, the size of the loop's carry."""
    out: dict[int, set[int]] = collections.defaultdict(set)
    for op in graph.ops:
        if op.phase != "forward" or op.structural or not op.layers:
            continue
        for t in op.inputs:
            producer = graph.tensors[t].producer
            if producer is None or not varies[t]:
                continue
            writer = graph.ops[producer].layers
            if writer == op.layers:  # within the layer (a loop body's: within each)
                continue
            for i in set(op.layers).difference(writer):
                out[i].add(t)
    return out
