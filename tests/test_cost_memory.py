"""The memory estimate's buffer model, on hand-built cases and against XLA:CPU on one device.

``tests/test_cost_sharding.py`` checks whole train steps on 8 devices; these isolate one
mechanism each: result allocations reused by intermediates, XLA:CPU's library fusions (a layer
norm's gradient on both sides of ``YNN_MIN_ELEMENTS`` rows), scatters and layout copies (a tied
embedding's gradient).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest

import models
import shardplan as sp
from shardplan.cost.memory import (
    YNN_MIN_ELEMENTS,
    _max_live,
    _pack_into_results,
    estimate_memory,
)
from shardplan.xla import read_compiled


def _estimate_and_compile(fn, *args):
    graph = sp.trace(fn, *args)
    estimate = estimate_memory(graph, lambda t: graph.tensors[t].nbytes)
    memory = read_compiled(jax.jit(fn).lower(*args).compile()).memory
    return estimate, memory


def test_intermediates_use_result_allocations_they_do_not_overlap() -> None:
    # One result of 100 bytes, written at op 10. Largest first: A (ops 0-5) ends before the
    # result is written and takes its allocation; B (60 bytes, ops 3-8) overlaps A there and C
    # (ops 12-15) overlaps the result, so both go to the heap, whose peak is B's 60 bytes.
    a, b, c = (0, 5, 100), (3, 8, 60), (12, 15, 50)
    heap = _pack_into_results([b, c, a], [(10, 20, 100)])
    assert sorted(heap) == [b, c]
    assert _max_live(heap, 21) == 60


def test_an_intermediate_larger_than_every_result_stays_on_the_heap() -> None:
    # A result allocation holds only buffers up to its own size.
    assert _pack_into_results([(0, 1, 200)], [(5, 9, 100)]) == [(0, 1, 200)]


def _layer_norm_loss(x, scale, bias, w):
    mean = x.mean(-1, keepdims=True)  # [rows, 1]
    var = (x * x).mean(-1, keepdims=True) - mean * mean  # [rows, 1]
    y = (x - mean) * (jax.lax.rsqrt(var + 1e-5) * scale) + bias  # [rows, d]
    return jnp.sum((y @ w) ** 2)


@pytest.mark.parametrize("rows", [YNN_MIN_ELEMENTS - 1, YNN_MIN_ELEMENTS])
def test_layer_norm_gradient_temp_matches_xla(rows: int) -> None:
    # From YNN_MIN_ELEMENTS rows on, one library fusion computes the norm's backward pass and
    # reads the product rsqrt·scale from memory: a [rows, 64] buffer more.
    d = 64
    args = (jnp.ones((rows, d)), jnp.ones(d), jnp.ones(d), jnp.ones((d, d)))
    estimate, memory = _estimate_and_compile(jax.grad(_layer_norm_loss, argnums=(0, 1, 2, 3)),
                                             *args)
    assert estimate.temp_bytes == pytest.approx(memory.temp_bytes, rel=0.01)


def _tied_embedding_loss(table, tokens):
    x = table[tokens]  # [batch, seq, d]
    logits = x @ table.T  # [batch, seq, vocab]
    return jax.nn.logsumexp(logits, -1).sum()


def test_tied_embedding_gradient_temp_matches_xla() -> None:
    # The logits' gradient is written in two layouts (for the table's gradient, contracted over
    # batch and sequence, and for the input's), both from exp(logits), which stays alive until
    # both are written; the lookup's scatter-add then goes into the first in place.
    args = (jnp.ones((256, 64)), jnp.zeros((64, 32), jnp.int32))
    estimate, memory = _estimate_and_compile(jax.grad(_tied_embedding_loss), *args)
    assert estimate.temp_bytes == pytest.approx(memory.temp_bytes, rel=0.01)
    assert estimate.peak_bytes == pytest.approx(
        memory.argument_bytes + memory.output_bytes + memory.temp_bytes - memory.alias_bytes,
        rel=0.01)


@pytest.mark.slow
def test_estimate_is_fast_on_gpt3_175b() -> None:
    config = models.load_model_config("gpt3-175b", overrides={"scan_layers": True})
    graphdef, state = models.abstract_train_state(config)
    step = models.make_train_step(graphdef)
    graph = sp.trace(step, state, models.example_batch(config, 1536, abstract=True))
    start = time.perf_counter()
    estimate = estimate_memory(graph, lambda t: graph.tensors[t].nbytes // 64)
    assert time.perf_counter() - start < 1.0
    assert estimate.temp_bytes > 0
