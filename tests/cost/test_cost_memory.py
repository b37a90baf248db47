"""The memory estimate's buffer model, on hand-built cases and against XLA:CPU on one device.

``tests/cost/test_cost_sharding.py`` checks whole train steps on 8 devices; these isolate one
mechanism each: result allocations reused by intermediates, XLA:CPU's library fusions (a layer
norm's gradient on both sides of ``YNN_MIN_ELEMENTS`` rows), scatters and layout copies (a tied
embedding's gradient).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax
import pytest
import shardplan_models as models
from flax import nnx

import shardplan as sp
from shardplan.cost.memory import (
    YNN_MIN_ELEMENTS,
    _max_live,
    _pack_into_results,
    estimate_memory,
    saved_activation_bytes,
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


# ---------------------------------------------------------------------------------------------
# Saved activations per remat policy, against XLA
# ---------------------------------------------------------------------------------------------

# A GPT of gpt-tiny's structure small enough to compile in seconds: per block, per sample,
# s h = 16 · 64 values of the residual stream.
_TINY = {"vocab_size": 64, "max_seq_len": 16, "n_layers": 2}
_POLICIES = ("none", "selective", "full")


def _apply_remat(monkeypatch: pytest.MonkeyPatch, policy: str, wrap) -> None:
    """Applies a remat policy to the reference GPT: ``selective`` wraps the attention core
    (``causal_attention``: the scores, mask, softmax and the product with v), ``full`` the
    whole block."""
    import shardplan_models.common as model_common
    import shardplan_models.gpt as model_gpt

    if policy == "selective":
        monkeypatch.setattr(model_common, "causal_attention",
                            wrap(model_common.causal_attention))
    elif policy == "full":
        call = model_gpt.GPTBlock.__call__

        def block(self, x, *rest):
            graphdef, params = nnx.split(self)
            return wrap(lambda p, h: call(nnx.merge(graphdef, p), h, *rest))(params, x)

        monkeypatch.setattr(model_gpt.GPTBlock, "__call__", block)


def _saved_per_sample(overrides: dict, batch: int) -> dict[str, float]:
    """``saved_activation_bytes`` of the first block, per sample, from the step without remat."""
    config = models.load_model_config("gpt-tiny", overrides=overrides)
    graphdef, state = models.abstract_train_state(config)
    graph = sp.trace(models.make_train_step(graphdef), state,
                     models.example_batch(config, batch, abstract=True))
    block = graph.layers[1].index
    return {p: saved_activation_bytes(graph, lambda t: graph.tensors[t].nbytes, p,
                                      layer=block) / batch for p in _POLICIES}


def _loss_residuals(graphdef):
    """The forward pass of the loss as a function whose results are the residuals it hands to
    the backward pass (the leaves of ``jax.vjp``'s function)."""
    def residuals(state, batch):
        def loss(state):
            logits, _ = nnx.merge(graphdef, state)(batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["targets"]).mean()

        return jax.vjp(loss, state)[1]

    return residuals


@pytest.mark.parametrize("policy", _POLICIES)
def test_saved_activations_are_the_residuals_xla_keeps_for_a_scanned_gpt(
        monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    # A scan's forward loop hands the backward loop its stacked residuals ([layers, batch,
    # ...]), which XLA cannot fuse into the backward pass: they are the compiled forward
    # pass's results. Per block and sample (float32, s = 16, h = 64, a = 4):
    # none 156,672 bytes: nine [s, h] values (per norm x - mean, 2 x, rsqrt · scale and its
    # output; the attention's output) 36,864, q, k, v 12,288, exp(scores) and the
    # probabilities [a, s, s] 8,192, their row values 512, six GELU values [s, 4h] 98,304,
    # norm statistics 512; selective 147,968 (the attention core's 8,704 bytes recomputed);
    # full 4,096 (the block's input, s h · 4 bytes). The prediction (from the step without
    # remat) is 128 bytes more: the final norm's four row statistics, which the trace
    # attributes to the stack.
    overrides, batch = {**_TINY, "scan_layers": True}, 3
    want = _saved_per_sample(overrides, batch)[policy]
    config = models.load_model_config("gpt-tiny", overrides=overrides)
    graphdef, state = models.abstract_state(config)
    _apply_remat(monkeypatch, policy, jax.checkpoint)
    compiled = jax.jit(_loss_residuals(graphdef)).trace(
        state, models.example_batch(config, batch, abstract=True)).lower().compile(
        compiler_options={"xla_backend_optimization_level": 0,
                          "xla_llvm_disable_expensive_passes": True})
    layers = config.n_layers
    stacked = [r for r in jax.tree.leaves(compiled.out_info) if r.shape[:2] == (layers, batch)]
    got = sum(r.size * r.dtype.itemsize for r in stacked) / (layers * batch)
    assert want == pytest.approx(got, rel=0.01)


def _recompute_in_backward(f):
    """``f``, with a backward pass that recomputes it from its inputs once the cotangent is
    there. ``jax.checkpoint`` cannot be measured on XLA:CPU: its optimization barrier covers
    the saved inputs only, and the scheduler computes the recomputation in the forward pass
    (the temp bytes of this GPT's step are those without remat, measured)."""
    @jax.custom_vjp
    def recomputed(*args):
        return f(*args)

    def forward(*args):
        return f(*args), args

    def backward(args, cotangent):
        # x + 0 · ct[0] is not simplified for floats: the inputs now depend on the cotangent.
        zero = jax.tree.leaves(cotangent)[0].ravel()[0].astype(jnp.float32) * 0.0
        args = jax.tree.map(lambda a: a + zero.astype(a.dtype)
                            if jnp.issubdtype(a.dtype, jnp.floating) else a, args)
        return jax.vjp(f, *args)[1](cotangent)

    recomputed.defvjp(forward, backward)
    return recomputed


@pytest.mark.slow
@pytest.mark.parametrize("policy", ("none", "selective"))
def test_saved_activations_are_what_xla_keeps_for_a_gpt(monkeypatch: pytest.MonkeyPatch,
                                                        policy: str) -> None:
    # Unrolled blocks: XLA fuses what it can into the backward pass (2 x of a norm's variance,
    # 1 - tanh of the GELU: computed again from a buffer that stays alive) and keeps dot
    # operands in the layouts the backward dots need. The temp bytes one block more adds per
    # sample (gpt-tiny, s = 32, h = 64, a = 4; two layer counts, two batch sizes): none
    # 231,424, selective 197,376 (the attention core's scores and probabilities, 2 · a s^2 ·
    # 4 bytes, and row values, recomputed). Full remat (the block's input, 8,192 bytes) is
    # not measurable this way: the peak is then elsewhere and does not grow with the layers.
    overrides = {"vocab_size": 64}
    want = _saved_per_sample({**overrides, "n_layers": 2}, 4)[policy]
    _apply_remat(monkeypatch, policy, _recompute_in_backward)
    temp = {}
    for layers in (2, 3):
        config = models.load_model_config("gpt-tiny", overrides={**overrides, "n_layers": layers})
        graphdef, state = models.abstract_train_state(config)
        for batch in (4, 8):
            step = jax.jit(models.make_train_step(graphdef), donate_argnums=0)
            compiled = step.trace(state, models.example_batch(config, batch, abstract=True)
                                  ).lower().compile()
            temp[(layers, batch)] = compiled.memory_analysis().temp_size_in_bytes
    got = (temp[(3, 8)] - temp[(3, 4)] - temp[(2, 8)] + temp[(2, 4)]) / 4
    assert want == pytest.approx(got, rel=0.01)
