"""PRNG keys are ordinary state: typed key arrays (``jax.random.key``, dtype ``key<fry>``, as an
``nnx.Rngs`` holds them) and raw ``uint32`` key data (``jax.random.PRNGKey``) in the state or
the batch, or made inside the step, are traced, planned (replicated, their key data's bytes),
stamped (``key<fry>[]``), cached by ``sp.auto``, pipelined and checkpointed.

The model is a small NNX language model written as a user would: an embedding, two pre-norm
blocks of causal attention and an MLP in a Python loop, each with ``nnx.Dropout``, a final
LayerNorm and a head; the ``nnx.Rngs(0, dropout=1)`` it was built with stays in its state. The
dropout rate is 0.1 unless said otherwise, so the keys are read and the streams' counters
advance: the planned steps equal the plain jitted step because jax draws the same bits
however the program is sharded (``jax_threefry_partitionable``) and one microbatch draws
them over the whole batch.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers.pipelines import staged_plan
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardplan as sp
from shardplan.api import auto as auto_module
from shardplan.trace.dtypes import KEY_IMPLS, dtype_name, is_prng_key, itemsize
from shardplan.train.checkpoint import Checkpointer, abstract_target
from shardplan.viz.data import dtype_bytes, parse_type, tensors
from shardplan.viz.terminal import show_text

VOCAB, WIDTH, HEADS, SEQ, BATCH = 32, 16, 2, 8, 8
RTOL = ATOL = 1e-4
MIXED = {"a100-80g": 4, "v100-32g": 4}
TWO_STAGES = [[("a100-80g", (0, 1), ("pre", "blocks.0")),
               ("v100-32g", (4, 5), ("blocks.1", "post"))]]


class Block(nnx.Module):
    """Pre-norm causal self-attention and a GELU MLP, each residual, each with dropout."""

    def __init__(self, width: int, rate: float, *, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(width, rngs=rngs)
        # No biases: the key projection's bias has no gradient (softmax ignores it), and Adam
        # would blow its rounding noise up past the tolerance.
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=width, decode=False,
                                           use_bias=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, rngs=rngs)
        self.dropout = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x: jax.Array, *, rngs: jax.Array | None = None) -> jax.Array:
        mask = nnx.make_causal_mask(x[..., 0])  # x: [batch, seq, width]; [batch, 1, seq, seq]
        x = x + self.dropout(self.attn(self.ln1(x), mask=mask), rngs=rngs)
        return x + self.dropout(self.down(jax.nn.gelu(self.up(self.ln2(x)))), rngs=rngs)


class LM(nnx.Module):
    """Embedding, two blocks, LayerNorm, head; keeps the Rngs it was built with."""

    def __init__(self, rate: float, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.blocks = nnx.List([Block(WIDTH, rate, rngs=rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)
        self.rngs = rngs

    def __call__(self, tokens: jax.Array, *, rngs: jax.Array | None = None) -> jax.Array:
        x = self.embed(tokens)  # [batch, seq] -> [batch, seq, width]
        for block in self.blocks:
            x = block(x, rngs=rngs)
        return self.head(self.norm(x))  # [batch, seq, vocab]


def _loss(model: LM, batch: dict[str, jax.Array], shared_key: bool = False) -> jax.Array:
    # shared_key: one dropout key for all blocks, drawn from the model's own Rngs
    logits = model(batch["inputs"], rngs=model.rngs.dropout() if shared_key else None)
    if "noise" in batch:  # per-sample keys
        logits += 0.1 * jax.vmap(lambda k: jax.random.normal(k, logits.shape[1:]))(batch["noise"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def lm_step(rate: float = 0.1, *, shared_key: bool = False):
    """``(train_step, state)``: the state is ``nnx.split((model, optimizer))``'s."""
    model = LM(rate, rngs=nnx.Rngs(0, dropout=1))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)))

    def train_step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(functools.partial(_loss, shared_key=shared_key))(
            model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return train_step, state


def reseeding_step(rate: float = 0.1):
    """A step that keeps raw key data (``uint32[2]``) beside the model and reseeds the
    dropout streams from it with ``jax.random.wrap_key_data`` each step."""
    model = LM(rate, rngs=nnx.Rngs(0, dropout=1))
    graphdef, train = nnx.split((model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)))
    state = {"train": train, "rng": jax.random.key_data(jax.random.key(7))}

    def train_step(state, batch):
        key, dropout_key = jax.random.split(jax.random.wrap_key_data(state["rng"]))
        model, optimizer = nnx.merge(graphdef, state["train"])
        nnx.reseed(model, dropout=dropout_key)
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, grads)
        return {"train": nnx.state((model, optimizer)), "rng": jax.random.key_data(key)}, loss

    return train_step, state


def batch_of(seed: int, *, noise: bool = False) -> dict[str, jax.Array]:
    """Random tokens; ``noise``: with a typed key per sample."""
    tokens = jax.random.randint(jax.random.key(seed), (BATCH, SEQ + 1), 0, VOCAB)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if noise:
        batch["noise"] = jax.random.split(jax.random.key(seed + 100), BATCH)  # key<fry>[batch]
    return batch


def _abstract(tree: Any) -> Any:
    return jax.eval_shape(lambda: tree)


def _comparable(x: Any) -> np.ndarray:
    return np.asarray(jax.random.key_data(x) if is_prng_key(x.dtype) else x, np.float64)


def _three_steps(run, step, state, *, noise: bool = False) -> None:
    """Three steps of ``run`` equal three of the jitted ``step``: every leaf, keys too."""
    ref = got = state
    for i in range(3):
        got, loss = run(got, batch_of(i, noise=noise))
        ref, ref_loss = jax.jit(step)(ref, batch_of(i, noise=noise))
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    for (path, a), b in zip(got_leaves, jax.tree.leaves(ref), strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        np.testing.assert_allclose(_comparable(a), _comparable(b), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))


def _key_paths(types: Any) -> dict[str, str]:
    return {path: text for path, text in types.items() if text.startswith("key<")}


# ------------------------------------------------------------------- dtype names and sizes


def test_key_dtypes_are_named_and_sized_by_their_key_data() -> None:
    for impl in KEY_IMPLS:
        key = jax.random.key(0, impl=impl)
        name = dtype_name(key.dtype)
        assert is_prng_key(name) and is_prng_key(key.dtype)
        assert itemsize(name) == itemsize(key.dtype) == jax.random.key_data(key).nbytes
        assert dtype_bytes(name) == itemsize(name)  # the viewer's table (no jax) agrees
        assert parse_type(f"{name}[4]") == (name, (4,))
    raw = jax.random.PRNGKey(0)
    assert not is_prng_key(raw.dtype) and dtype_name(raw.dtype) == "uint32"


# ------------------------------------------------------------------------------- planning


def test_make_plan_stamps_replicates_and_round_trips_typed_keys(tmp_path) -> None:
    step, state = lm_step()
    cluster = sp.Cluster.local(types={"a100-80g": 8})
    plan = sp.make_plan(step, _abstract(state), _abstract(batch_of(0)), cluster=cluster,
                        config=sp.PlanConfig(time_limit_s=5))
    keys = _key_paths(plan.state_types)
    assert keys == {f"0/{where}/key/value": "key<fry>[]" for where in (
        "blocks/0/dropout/rngs", "blocks/1/dropout/rngs", "rngs/default", "rngs/dropout")}
    assert all(not any(plan.param_specs[path][1]) for path in keys)
    plan.save(tmp_path / "plan.json")
    loaded = sp.load_plan(tmp_path / "plan.json")
    assert loaded == plan and _key_paths(loaded.state_types) == keys
    sp.check_plan(step, loaded, state, batch_of(0), cluster=cluster)
    # The viewer reads the types back (8 bytes a key on every device) and draws the plan.
    assert {(t.path, t.dtype, t.bytes_per_device) for t in tensors(loaded)
            if t.path in keys} == {(path, "key<fry>", 8) for path in keys}
    assert show_text(loaded) and loaded.to_html()


def test_a_key_array_is_never_sharded_where_a_tie_would_shard_it() -> None:
    # An input only elementwise ops read is sharded on a tie (INPUT_BYTE_TIEBREAK_S); a key
    # array stays whole. The step also draws from a key it makes itself.
    n, width = 4096, 256

    def step(state, x):  # x: [n, width]
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(state["w"])
        keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(state["keys"])
        scale = jax.random.uniform(jax.random.key(1), minval=0.01, maxval=0.02)
        return {"w": state["w"] - scale * grad, "keys": keys}, loss

    for impl in ("threefry2x32", "rbg"):
        key_type = jax.random.key_dtype(impl)
        state = {"w": jax.ShapeDtypeStruct((width, width), jnp.float32),
                 "keys": jax.ShapeDtypeStruct((n,), key_type)}
        x = jax.ShapeDtypeStruct((n, width), jnp.float32)
        plan = sp.make_plan(step, state, x, cluster=sp.Cluster.local(devices=jax.devices()[:4]),
                            config=sp.PlanConfig(time_limit_s=5))
        assert plan.param_specs["keys"] == (0, ((),))
        assert any(plan.param_specs["w"][1])  # the weight is split: sharding was worth it
        assert plan.state_types["keys"] == f"{key_type}[{n}]"
        graph = sp.trace(step, state, x)
        keys = graph.param_by_path["keys"]
        assert keys.role != "parameter" and keys.nbytes == n * key_type.itemsize  # key data


# ------------------------------------------------------------------------------- sp.auto


@pytest.mark.slow
def test_auto_runs_a_step_with_keys_in_its_state_and_plans_once(monkeypatch) -> None:
    made = []
    real = auto_module.make_plan
    monkeypatch.setattr(auto_module, "make_plan", lambda *a, **k: made.append(1) or real(*a, **k))
    step, state = lm_step()
    cluster = sp.Cluster.local(devices=jax.devices()[:4])
    run = sp.auto(step, cluster=cluster, config=sp.PlanConfig(time_limit_s=5))
    _three_steps(run, step, state)
    assert len(made) == 1 and len(run.plans) == 1
    assert run.plan_for(state, batch_of(0)) is run.plans[0]
    assert _key_paths(run.plans[0].state_types)
    # A new sp.auto (a new process) reads the plan, keys' types and all, back from disk.
    again = sp.auto(step, cluster=cluster, config=sp.PlanConfig(time_limit_s=5))
    again(state, batch_of(0))
    assert len(made) == 1 and list(again.sources.values()) == ["disk"]


# ------------------------------------------------------------------------------ pipelines


@pytest.fixture(scope="module")
def mixed_plan():
    """The one-stage plan of the LM step on 4 A100 + 4 V100, for ``staged_plan`` to rewrite."""
    step, state = lm_step()
    return sp.make_plan(step, _abstract(state), _abstract(batch_of(0)),
                        cluster=sp.Cluster.local(types=MIXED),
                        config=sp.PlanConfig(max_stages=1))


@pytest.mark.slow
def test_two_stages_with_typed_keys_in_the_state(mixed_plan) -> None:
    step, state = lm_step()
    _three_steps(sp.apply_plan(step, staged_plan(mixed_plan, TWO_STAGES, BATCH, [1])), step,
                 state)


@pytest.mark.slow
def test_two_stages_of_a_step_that_wraps_raw_key_data() -> None:
    step, state = reseeding_step()
    plan = sp.make_plan(step, _abstract(state), _abstract(batch_of(0)),
                        cluster=sp.Cluster.local(types=MIXED),
                        config=sp.PlanConfig(max_stages=1))
    assert plan.state_types["rng"] == "uint32[2]" and not any(plan.param_specs["rng"][1])
    _three_steps(sp.apply_plan(step, staged_plan(plan, TWO_STAGES, BATCH, [1])), step, state)


@pytest.mark.slow
def test_two_stages_without_dropout_equal_the_step(mixed_plan) -> None:
    # Rate 0: the keys are state that no op reads; two microbatches. (The plan's layouts
    # fit: the state and batch have the types the rate-0.1 step's had.)
    step, state = lm_step(0.0)
    _three_steps(sp.apply_plan(step, staged_plan(mixed_plan, TWO_STAGES, BATCH // 2, [2])), step,
                 state)


@pytest.mark.slow
def test_a_key_drawn_on_the_first_stage_and_read_on_the_second(mixed_plan) -> None:
    # One dropout key for both blocks, drawn where the model starts: it crosses the stages.
    step, state = lm_step(shared_key=True)
    _three_steps(sp.apply_plan(step, staged_plan(mixed_plan, TWO_STAGES, BATCH, [1])), step,
                 state)


@pytest.mark.slow
def test_two_stages_with_a_typed_key_per_sample_in_the_batch() -> None:
    step, state = lm_step()
    plan = sp.make_plan(step, _abstract(state), _abstract(batch_of(0, noise=True)),
                        cluster=sp.Cluster.local(types=MIXED),
                        config=sp.PlanConfig(max_stages=1))
    assert plan.batch_types["noise"] == f"key<fry>[{BATCH}]"
    _three_steps(sp.apply_plan(step, staged_plan(plan, TWO_STAGES, BATCH, [1])), step, state,
                 noise=True)


# ---------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_restores_keys_of_the_same_implementation(tmp_path) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ("x",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    _, model_state = lm_step()
    state = {
        "model": model_state,
        "fry": jax.random.split(jax.random.key(3), 16),
        "rbg": jax.device_put(jax.random.split(jax.random.key(4, impl="rbg"), 8),
                              NamedSharding(mesh, P("x"))),
        "raw": jax.random.PRNGKey(5),
    }
    with Checkpointer(tmp_path, every_steps=1, keep=1) as ckpt:
        ckpt.save(1, state, meta={})
        target = abstract_target(state, jax.tree.map(lambda x: x.sharding, state))
        restored = ckpt.restore(target=target).state
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.sharding == b.sharding
        if is_prng_key(b.dtype):
            assert str(jax.random.key_impl(a)) == str(jax.random.key_impl(b))
        np.testing.assert_array_equal(_comparable(a), _comparable(b), strict=True)
