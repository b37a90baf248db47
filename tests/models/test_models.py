"""Tests of the reference models: configs, parameter counts, layouts, numerics and training.

XLA:CPU compilation dominates the time of these tests, so:

* everything that only needs shapes uses ``nnx.eval_shape`` / ``jax.jit(...).trace`` and never
  compiles;
* test inputs and small modules' parameters come from numpy, not from eager jax ops (each eager
  op is a compilation of its own);
* computations run as one program compiled at XLA's backend optimisation level 0
  (:func:`run_compiled`), which halves compile time and changes no result beyond rounding;
* each tiny model is initialised and trained once per session (:func:`_trained`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import shardplan_models as models
from flax import nnx
from shardplan_models.common import apply_rope, causal_attention, rope_tables
from shardplan_models.config import PRESETS_DIR
from shardplan_models.moe import MoEMLP, expert_capacity, load_balancing_loss
from shardplan_models.train import default_decay_mask

from shardplan.errors import ConfigError

TINY_PRESETS = ("gpt-tiny", "gpt-tiny-scan", "llama-tiny", "moe-tiny")
BIG_PRESETS = tuple(name for name in models.preset_names() if name not in TINY_PRESETS)


def keypaths(tree: object) -> dict[str, tuple[int, ...]]:
    """``{state key path: shape}`` with the project's key path convention."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape)
        for path, leaf in leaves
    }


FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""XLA compiler options for tests: no LLVM optimisation of the (tiny) CPU programs."""


def compile_fast(fn: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``jax.jit(fn)`` lowered for ``args`` and compiled with :data:`FAST_COMPILE`."""
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)


def run_compiled(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs ``jax.jit(fn)(*args)`` as one program compiled with :data:`FAST_COMPILE`."""
    return compile_fast(fn, *args)(*args)


def numpy_state(abstract: nnx.State, *, seed: int, std: float = 0.02) -> nnx.State:
    """Real parameters for an abstract state, drawn with numpy (no XLA compilation)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda leaf: jnp.asarray(rng.normal(0.0, std, leaf.shape).astype(leaf.dtype)), abstract
    )


@functools.cache
def _trained(preset: str, scan_layers: bool) -> dict[str, Any]:
    """Initialises a tiny model and runs 20 train steps on one fixed batch (cached)."""
    config = models.load_model_config(preset, overrides={"scan_layers": scan_layers})
    optimizer = models.make_optimizer(3e-3, weight_decay=0.0)
    graphdef, _ = models.abstract_train_state(config, optimizer=optimizer)
    state = run_compiled(lambda: models.init_train_state(config, seed=0, optimizer=optimizer)[1])
    batch = models.example_batch(config, 4, seq_len=16, seed=1)
    step = compile_fast(models.make_train_step(graphdef), state, batch)
    initial_state, losses, metrics = state, [], {}
    for _ in range(20):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return {
        "config": config,
        "graphdef": graphdef,
        "initial_state": initial_state,
        "state": state,
        "losses": losses,
        "metrics": metrics,
    }


# ---------------------------------------------------------------------------------------------
# Configs and presets
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", models.preset_names())
def test_every_preset_parses(preset: str) -> None:
    config = models.load_model_config(preset)
    assert config.name == preset
    assert config.model in ("gpt", "llama", "moe")
    assert config.num_params() > 0
    # The same file, read by path instead of by name, gives the same config.
    assert models.load_model_config(PRESETS_DIR / f"{preset}.yaml") == config


def test_expected_presets_exist() -> None:
    expected = {
        "gpt-tiny",
        "gpt-tiny-scan",
        "gpt-small",
        "gpt-1.3b",
        "gpt-2.7b",
        "gpt-6.7b",
        "gpt-13b",
        "gpt3-175b",
        "llama-tiny",
        "llama2-7b",
        "llama2-13b",
        "llama2-70b",
        "moe-tiny",
        "mixtral-8x7b",
    }
    assert expected <= set(models.preset_names())
    for name in ("gpt-tiny", "gpt-tiny-scan", "llama-tiny", "moe-tiny"):
        assert models.load_model_config(name).num_params() <= 1_000_000
    assert models.load_model_config("gpt-tiny-scan").scan_layers
    assert models.load_model_config("llama-tiny").n_kv_heads < 4


def test_overrides_replace_fields() -> None:
    config = models.load_model_config("gpt-tiny", overrides={"n_layers": 4, "scan_layers": True})
    assert (config.n_layers, config.scan_layers, config.d_model) == (4, True, 64)
    assert config.num_params() > models.load_model_config("gpt-tiny").num_params()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"d_model": 65}, "d_model"),
        ({"n_layers": 0}, "n_layers"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"dtype": "float16"}, "dtype"),
        ({"n_heads": "4"}, "n_heads"),
        ({"scan_layers": "yes"}, "scan_layers"),
    ],
)
def test_bad_common_values_name_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"GPTConfig\.{field}") as err:
        models.load_model_config("gpt-tiny", overrides=overrides)
    assert "fix:" in str(err.value)
    assert repr(overrides[field]) in str(err.value)


@pytest.mark.parametrize(
    ("preset", "overrides", "field"),
    [
        ("llama-tiny", {"n_kv_heads": 3}, "n_kv_heads"),
        ("llama-tiny", {"rope_theta": -1.0}, "rope_theta"),
        ("llama-tiny", {"d_model": 36, "n_heads": 4}, "d_model"),  # head_dim 9 is odd
        ("moe-tiny", {"top_k": 5}, "top_k"),
        ("moe-tiny", {"n_experts": 0}, "n_experts"),
        ("moe-tiny", {"capacity_factor": 0.0}, "capacity_factor"),
    ],
)
def test_bad_model_values_name_the_field(preset: str, overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"Config\.{field}"):
        models.load_model_config(preset, overrides=overrides)


def test_direct_construction_validates() -> None:
    with pytest.raises(ConfigError, match="n_kv_heads"):
        models.LlamaConfig(
            vocab_size=8, max_seq_len=8, d_model=16, n_layers=1, n_heads=4, n_kv_heads=3, d_ff=8
        )


def test_unknown_yaml_key_has_did_you_mean(tmp_path: Path) -> None:
    text = (PRESETS_DIR / "gpt-tiny.yaml").read_text().replace("n_layers:", "n_layer:")
    path = tmp_path / "typo.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        models.load_model_config(path)
    message = str(err.value)
    assert "'n_layer'" in message
    assert "did you mean 'n_layers'" in message
    assert str(path) in message


def test_unknown_override_preset_and_model_kind(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean 'n_kv_heads'"):
        models.load_model_config("llama-tiny", overrides={"n_kv_head": 1})
    with pytest.raises(ConfigError, match="did you mean 'gpt-tiny'"):
        models.load_model_config("gpt-tiyn")
    path = tmp_path / "kind.yaml"
    path.write_text("model: lama\nvocab_size: 8\n")
    with pytest.raises(ConfigError, match="did you mean 'llama'"):
        models.load_model_config(path)
    path.write_text("model: llama\nvocab_size: 8\n")
    with pytest.raises(ConfigError, match="missing required keys: max_seq_len"):
        models.load_model_config(path)
    with pytest.raises(ConfigError, match="not found"):
        models.load_model_config(tmp_path / "absent.yaml")


def test_yaml_float_without_dot_is_read() -> None:
    config = models.config_from_dict(
        {
            "model": "gpt",
            "vocab_size": 8,
            "max_seq_len": 8,
            "d_model": 8,
            "n_layers": 1,
            "n_heads": 2,
            "d_ff": 8,
            "layer_norm_eps": "1e-6",
        }
    )
    assert config.layer_norm_eps == 1e-6


# ---------------------------------------------------------------------------------------------
# Parameter counts
# ---------------------------------------------------------------------------------------------


TRAINED = [
    ("gpt-tiny", False),
    ("gpt-tiny-scan", True),
    ("llama-tiny", False),
    ("moe-tiny", False),
]
"""The tiny presets, trained in these tests (the stacked Llama and MoE are run forward only)."""


@pytest.mark.parametrize(("preset", "scan_layers"), TRAINED)
def test_tiny_num_params_equals_built_model(preset: str, scan_layers: bool) -> None:
    run = _trained(preset, scan_layers)
    model, _ = nnx.merge(run["graphdef"], run["initial_state"])
    params = nnx.state(model, nnx.Param)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params))
    assert sum(leaf.size for leaf in jax.tree.leaves(params)) == run["config"].num_params()


@pytest.mark.parametrize("preset", ["llama-tiny", "moe-tiny"])
def test_scanned_model_builds_and_runs(preset: str) -> None:
    config = models.load_model_config(preset, overrides={"scan_layers": True})
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16), dtype=np.int32)

    def build_and_run(tokens: jax.Array) -> tuple[nnx.State, jax.Array, jax.Array]:
        model = models.build_model(config, rngs=nnx.Rngs(0))
        logits, aux = model(tokens)
        return nnx.state(model, nnx.Param), logits, aux

    params, logits, aux = run_compiled(build_and_run, tokens)
    leaves = jax.tree.leaves(params)
    assert all(leaf.shape[0] == 2 for leaf in jax.tree.leaves(params["blocks"]))  # n_layers
    assert sum(leaf.size for leaf in leaves) == config.num_params()
    assert logits.shape == (2, 16, 256) and np.isfinite(np.asarray(logits)).all()
    if preset == "moe-tiny":
        # Mean over layers of the load-balancing loss: 1 when balanced, at most n_experts.
        assert 0.5 < float(aux) < 4.0
    else:
        assert float(aux) == 0.0


@pytest.mark.parametrize("preset", BIG_PRESETS)
def test_big_num_params_equals_abstract_model(preset: str) -> None:
    # Stacked layers trace one block, so this is fast at any depth; both layouts have the same
    # count (the tiny tests check both), and the unrolled GPT-3 175B is built further below.
    config = models.load_model_config(preset, overrides={"scan_layers": True})
    _, state = models.abstract_state(config)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(state))
    assert models.count_params(state) == config.num_params()


@pytest.mark.parametrize(
    ("preset", "published"),
    [
        # Brown et al. 2020 call it 175B; with tied embeddings the architecture has 174.6e9.
        ("gpt3-175b", 174.6e9),
        ("llama2-70b", 69e9),  # Touvron et al. 2023
        ("mixtral-8x7b", 46.7e9),  # Jiang et al. 2024
        ("gpt-small", 124e6),  # GPT-2 small
        ("llama2-7b", 6.74e9),
    ],
)
def test_big_presets_near_published_sizes(preset: str, published: float) -> None:
    assert models.load_model_config(preset).num_params() == pytest.approx(published, rel=0.015)


def test_counts_of_released_checkpoints() -> None:
    # Exact counts of the released Hugging Face checkpoints (safetensors metadata).
    assert models.load_model_config("gpt-small").num_params() == 124_439_808
    assert models.load_model_config("llama2-7b").num_params() == 6_738_415_616
    assert models.load_model_config("llama2-13b").num_params() == 13_015_864_320
    assert models.load_model_config("llama2-70b").num_params() == 68_976_648_192
    assert models.load_model_config("mixtral-8x7b").num_params() == 46_702_792_704


def test_untied_gpt_adds_lm_head() -> None:
    tied = models.load_model_config("gpt-tiny")
    untied = models.load_model_config("gpt-tiny", overrides={"tie_embeddings": False})
    _, state = models.abstract_state(untied)
    assert keypaths(state)["lm_head/kernel/value"] == (64, 256)
    assert "lm_head/kernel/value" not in keypaths(models.abstract_state(tied)[1])
    assert untied.num_params() - tied.num_params() == 64 * 256
    assert models.count_params(state) == untied.num_params()


def test_abstract_train_state_of_gpt3_175b() -> None:
    config = models.load_model_config("gpt3-175b")
    graphdef, state = models.abstract_train_state(config)
    paths = keypaths(state)
    assert paths["0/blocks/95/attn/q/kernel/value"] == (12288, 12288)
    assert paths["1/opt_state/1/0/mu/blocks/95/mlp/up/kernel/value"] == (12288, 49152)
    model_state = nnx.filter_state(state, nnx.Param)
    # The optimizer's moments are Params-shaped but are OptState, so only the model counts.
    assert models.count_params(model_state) == config.num_params()
    batch = models.example_batch(config, 8, abstract=True)
    assert batch["inputs"] == jax.ShapeDtypeStruct((8, 2048), jnp.int32)
    assert graphdef is not None


# ---------------------------------------------------------------------------------------------
# Layouts: state key paths and the scanned jaxpr
# ---------------------------------------------------------------------------------------------


def test_gpt_state_paths_loop_and_scan() -> None:
    loop = keypaths(models.abstract_state(models.load_model_config("gpt-tiny"))[1])
    scan = keypaths(models.abstract_state(models.load_model_config("gpt-tiny-scan"))[1])
    block = {
        "attn/q/kernel": (64, 64),
        "attn/q/bias": (64,),
        "attn/k/kernel": (64, 64),
        "attn/k/bias": (64,),
        "attn/v/kernel": (64, 64),
        "attn/v/bias": (64,),
        "attn/o/kernel": (64, 64),
        "attn/o/bias": (64,),
        "ln1/scale": (64,),
        "ln1/bias": (64,),
        "ln2/scale": (64,),
        "ln2/bias": (64,),
        "mlp/up/kernel": (64, 256),
        "mlp/up/bias": (256,),
        "mlp/down/kernel": (256, 64),
        "mlp/down/bias": (64,),
    }
    top = {
        "wte/embedding/value": (256, 64),
        "wpe/embedding/value": (32, 64),
        "ln_f/scale/value": (64,),
        "ln_f/bias/value": (64,),
    }
    expected_loop = {
        f"blocks/{i}/{name}/value": shape for i in range(2) for name, shape in block.items()
    }
    expected_scan = {f"blocks/{name}/value": (2, *shape) for name, shape in block.items()}
    assert loop == {**top, **expected_loop}
    assert scan == {**top, **expected_scan}


def test_llama_state_paths_have_gqa_shapes() -> None:
    paths = keypaths(models.abstract_state(models.load_model_config("llama-tiny"))[1])
    # 4 query heads of width 16 share 2 key/value heads: k and v project to 2 * 16 = 32.
    assert paths["blocks/0/attn/q/kernel/value"] == (64, 64)
    assert paths["blocks/0/attn/k/kernel/value"] == (64, 32)
    assert paths["blocks/1/attn/v/kernel/value"] == (64, 32)
    assert paths["blocks/0/mlp/gate/kernel/value"] == (64, 128)
    assert paths["blocks/0/attn_norm/scale/value"] == (64,)
    assert paths["lm_head/kernel/value"] == (64, 256)
    assert not [p for p in paths if "bias" in p]


def test_moe_experts_are_stacked_parameters() -> None:
    config = models.load_model_config("moe-tiny", overrides={"scan_layers": True})
    paths = keypaths(models.abstract_state(config)[1])
    assert paths["blocks/mlp/w_gate/value"] == (2, 4, 64, 128)
    assert paths["blocks/mlp/w_up/value"] == (2, 4, 64, 128)
    assert paths["blocks/mlp/w_down/value"] == (2, 4, 128, 64)
    assert paths["blocks/mlp/router/kernel/value"] == (2, 64, 4)


def _scan_eqns(jaxpr: jax.extend.core.Jaxpr) -> list[jax.extend.core.JaxprEqn]:
    """All ``scan`` equations, also inside nested jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.extend(_scan_eqns(sub))
    return found


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny", "moe-tiny"])
def test_scanned_step_has_one_scan_of_n_layers(preset: str) -> None:
    config = models.load_model_config(preset, overrides={"scan_layers": True, "n_layers": 3})
    graphdef, state = models.abstract_train_state(config)
    batch = models.example_batch(config, 2, seq_len=8, abstract=True)
    traced = jax.jit(models.make_train_step(graphdef)).trace(state, batch)
    scans = _scan_eqns(traced.jaxpr.jaxpr)
    assert scans, "no scan equation in the traced train step"
    assert all(eqn.params["length"] == 3 for eqn in scans)
    # One forward scan over the blocks; its body holds one block (plus its backward scan).
    assert len(scans) == 2
    assert jax.tree.structure(traced.out_info[0]) == jax.tree.structure(state)

    loop_config = models.load_model_config(preset, overrides={"scan_layers": False})
    graphdef, state = models.abstract_train_state(loop_config)
    traced = jax.jit(models.make_train_step(graphdef)).trace(state, batch)
    assert not _scan_eqns(traced.jaxpr.jaxpr)


def test_forward_scan_body_is_one_gpt_block() -> None:
    config = models.load_model_config("gpt-tiny", overrides={"scan_layers": True, "n_layers": 5})
    graphdef, state = models.abstract_state(config)
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)

    def forward(state: nnx.State, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        return nnx.merge(graphdef, state)(tokens)

    (scan,) = _scan_eqns(jax.make_jaxpr(forward)(state, tokens).jaxpr)
    assert scan.params["length"] == 5
    body = scan.params["jaxpr"].jaxpr
    dots = [e for e in body.eqns if e.primitive.name == "dot_general"]
    # q, k, v, o projections, scores and weighted values, MLP up and down.
    assert len(dots) == 8


# ---------------------------------------------------------------------------------------------
# Forward shapes and dtypes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", TINY_PRESETS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_shapes(preset: str, dtype: str) -> None:
    config = models.load_model_config(preset, overrides={"dtype": dtype})
    graphdef, state = models.abstract_state(config)
    tokens = jax.ShapeDtypeStruct((3, 16), jnp.int32)
    logits, aux = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)
    assert logits.shape == (3, 16, 256)
    assert logits.dtype == jnp.dtype(dtype)
    assert aux.shape == () and aux.dtype == jnp.float32
    assert {leaf.dtype for leaf in jax.tree.leaves(state)} == {jnp.dtype("float32")}


def test_gpt_rejects_sequences_longer_than_max_seq_len() -> None:
    config = models.load_model_config("gpt-tiny")
    graphdef, state = models.abstract_state(config)
    tokens = jax.ShapeDtypeStruct((1, 33), jnp.int32)
    with pytest.raises(ValueError, match="max_seq_len=32"):
        jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("preset", "scan_layers"), TRAINED)
def test_train_steps_lower_the_loss(preset: str, scan_layers: bool) -> None:
    run = _trained(preset, scan_layers)
    losses = run["losses"]
    assert all(math.isfinite(loss) for loss in losses)
    # Random tokens over a 256-token vocabulary start near ln(256) = 5.55; memorising one
    # fixed batch must bring it well below.
    assert losses[0] == pytest.approx(math.log(256), abs=0.1)
    assert losses[-1] < losses[0] - 0.5
    assert set(run["metrics"]) == {"loss", "ce_loss", "aux_loss", "grad_norm"}
    assert jax.tree.structure(run["state"]) == jax.tree.structure(run["initial_state"])


def test_moe_trains_with_aux_loss() -> None:
    metrics = _trained("moe-tiny", False)["metrics"]
    # The load-balancing loss is 1 for balanced routing; the aux term keeps it near there.
    assert 0.5 < float(metrics["aux_loss"]) < 1.5
    assert float(metrics["loss"]) == pytest.approx(
        float(metrics["ce_loss"]) + 0.01 * float(metrics["aux_loss"]), rel=1e-6
    )


def test_dense_aux_loss_is_zero() -> None:
    assert float(_trained("llama-tiny", False)["metrics"]["aux_loss"]) == 0.0


def test_example_batch() -> None:
    config = models.load_model_config("gpt-tiny")
    batch = jax.tree.map(np.asarray, models.example_batch(config, 2, seq_len=8, seed=3))
    assert batch["inputs"].shape == batch["targets"].shape == (2, 8)
    assert batch["inputs"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert batch["inputs"].min() >= 0 and batch["inputs"].max() < 256
    abstract = models.example_batch(config, 2, abstract=True)
    assert abstract["targets"] == jax.ShapeDtypeStruct((2, 32), jnp.int32)  # max_seq_len
    with pytest.raises(ConfigError, match="seq_len"):
        models.example_batch(config, 2, seq_len=33)
    with pytest.raises(ConfigError, match="batch_size"):
        models.example_batch(config, 0)


def test_optimizer_accepts_schedule_and_masks_decay() -> None:
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)
    tx = models.make_optimizer(schedule, clip_norm=0.5)
    params = {"lin": {"kernel": np.ones((2, 2)), "bias": np.ones(2)}, "ln": {"scale": np.ones(2)}}
    updates = run_compiled(lambda p: tx.update(p, tx.init(p), p)[0], params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    assert default_decay_mask(params) == {
        "lin": {"kernel": True, "bias": False},
        "ln": {"scale": False},
    }


# ---------------------------------------------------------------------------------------------
# Attention and rotary embeddings
# ---------------------------------------------------------------------------------------------


def _reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal attention by explicit loops; query head h reads key/value head h // group."""
    batch, seq, n_heads, head_dim = q.shape
    group = n_heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(n_heads):
            for i in range(seq):
                keys, values = k[b, : i + 1, h // group], v[b, : i + 1, h // group]
                scores = keys @ q[b, i, h] / math.sqrt(head_dim)  # [i + 1]
                weights = np.exp(scores - scores.max())
                out[b, i, h] = weights @ values / weights.sum()
    return out


def test_grouped_query_attention_matches_reference() -> None:
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 5, 4, 8)).astype(np.float32)
    k = rng.normal(size=(2, 5, 2, 8)).astype(np.float32)  # 2 key/value heads for 4 query heads
    v = rng.normal(size=(2, 5, 2, 8)).astype(np.float32)
    expected = _reference_attention(*(x.astype(np.float64) for x in (q, k, v)))
    np.testing.assert_allclose(run_compiled(causal_attention, q, k, v), expected, atol=1e-5)


def test_attention_is_causal() -> None:
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(1, 6, 2, 4)).astype(np.float32) for _ in range(3))
    changed_future = v.copy()
    changed_future[:, 4:] = rng.normal(size=(1, 2, 2, 4))
    attend = compile_fast(causal_attention, q, k, v)
    before, after = np.asarray(attend(q, k, v)), np.asarray(attend(q, k, changed_future))
    np.testing.assert_array_equal(before[:, :4], after[:, :4])
    assert not np.allclose(before[:, 4:], after[:, 4:])


def test_rope_scores_depend_on_relative_position_only() -> None:
    rng = np.random.default_rng(2)
    q = np.broadcast_to(rng.normal(size=8), (1, 16, 1, 8)).astype(np.float32)
    k = np.broadcast_to(rng.normal(size=8), (1, 16, 1, 8)).astype(np.float32)

    def rotate(q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        cos, sin = rope_tables(16, 8, 10000.0)
        return apply_rope(q, cos, sin)[0, :, 0], apply_rope(k, cos, sin)[0, :, 0]  # [seq, 8]

    rq, rk = (np.asarray(x, np.float64) for x in run_compiled(rotate, q, k))
    # <R(m) q, R(n) k> = <q, R(n - m) k>: positions (3, 1) and (10, 8) give the same score.
    np.testing.assert_allclose(rq[3] @ rk[1], rq[10] @ rk[8], rtol=1e-5)
    np.testing.assert_allclose(
        np.linalg.norm(rq, axis=-1), np.linalg.norm(q[0, :, 0], axis=-1), rtol=1e-5
    )
    np.testing.assert_allclose(rq[0], q[0, 0, 0], rtol=1e-6)  # position 0 is not rotated


# ---------------------------------------------------------------------------------------------
# Mixture of experts
# ---------------------------------------------------------------------------------------------


def test_expert_capacity() -> None:
    assert expert_capacity(32, n_experts=4, top_k=2, capacity_factor=1.25) == 20
    assert expert_capacity(8, n_experts=2, top_k=1, capacity_factor=0.25) == 1
    assert expert_capacity(8, n_experts=2, top_k=1, capacity_factor=0.01) == 1  # at least one
    assert expert_capacity(8, n_experts=2, top_k=2, capacity_factor=4.0) == 8  # at most seq
    config = models.load_model_config("moe-tiny")
    assert config.expert_capacity(32) == expert_capacity(
        32, n_experts=4, top_k=2, capacity_factor=1.25
    )


def test_load_balancing_loss_formula() -> None:
    # Uniform router probabilities: the loss is 1.0 whatever the assignments.
    uniform = np.full((2, 6, 3), 1 / 3)
    skewed_mask = np.zeros((2, 6, 3))
    skewed_mask[..., 0] = 1
    # Worked case, 2 experts, 4 tokens, all assigned to expert 0: f = [1, 0];
    # mean probabilities P = [(0.9 + 0.8 + 0.7 + 0.6) / 4, ...] = [0.75, 0.25];
    # loss = 2 * (1 * 0.75 + 0 * 0.25) = 1.5.
    probs = np.array([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])
    to_expert_0 = np.array([[1, 0], [1, 0], [1, 0], [1, 0]])
    # Top-2 of 2 experts: every token uses both, f = [0.5, 0.5], loss = 2 * 0.5 * 1 = 1.
    both = np.ones((4, 2))

    def losses() -> tuple[jax.Array, ...]:
        return (
            load_balancing_loss(uniform, skewed_mask),
            load_balancing_loss(probs, to_expert_0),
            load_balancing_loss(probs, both),
        )

    assert [float(x) for x in run_compiled(losses)] == pytest.approx([1.0, 1.5, 1.0])


def _moe_mlp(*, seed: int = 0, **kwargs: Any) -> tuple[nnx.GraphDef, nnx.State]:
    """A small MoEMLP (d_model 16, d_ff 32) split into graphdef and numpy-drawn parameters."""
    options = {"n_experts": 4, "top_k": 2, "capacity_factor": 4.0, **kwargs}
    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: MoEMLP(16, 32, rngs=nnx.Rngs(0), **options))
    )
    return graphdef, numpy_state(abstract, seed=seed, std=0.3)


def _apply(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return nnx.merge(graphdef, state)(x)


def test_moe_uniform_router_gives_aux_loss_one() -> None:
    graphdef, state = _moe_mlp()
    state["router"]["kernel"][...] = jnp.zeros((16, 4))  # every expert gets p = 1/4
    x = np.random.default_rng(0).normal(size=(2, 8, 16)).astype(np.float32)
    _, aux = run_compiled(functools.partial(_apply, graphdef), state, x)
    assert float(aux) == pytest.approx(1.0, abs=1e-6)


def test_moe_tokens_over_capacity_are_dropped() -> None:
    # 2 experts, top-1, capacity ceil(0.25 * 8 * 1 / 2) = 1 slot per expert per sequence; the
    # router sends every (positive) token to expert 0, so only each sequence's first token gets
    # a slot and the 7 others get a zero output (they pass through the residual only).
    graphdef, state = _moe_mlp(n_experts=2, top_k=1, capacity_factor=0.25)
    state["router"]["kernel"][...] = np.stack([np.ones(16), -np.ones(16)], axis=1)  # [d, e]
    x = np.abs(np.random.default_rng(1).normal(size=(3, 8, 16))).astype(np.float32) + 0.1
    y, _ = run_compiled(functools.partial(_apply, graphdef), state, x)
    y = np.asarray(y)
    assert np.all(y[:, 1:] == 0.0)
    assert np.all(np.abs(y[:, 0]).sum(axis=-1) > 0)


def test_moe_without_drops_matches_per_token_reference() -> None:
    graphdef, state = _moe_mlp()  # capacity_factor 4 = n_experts / top_k: nothing is dropped
    x = np.random.default_rng(2).normal(size=(2, 8, 16)).astype(np.float32)
    y, _ = run_compiled(functools.partial(_apply, graphdef), state, x)
    router = np.asarray(state["router"]["kernel"][...], np.float64)  # [d_model, experts]
    w_gate, w_up, w_down = (
        np.asarray(state[name][...], np.float64) for name in ("w_gate", "w_up", "w_down")
    )
    expected = np.zeros(x.shape)
    for b in range(2):
        for s in range(8):
            xt = x[b, s].astype(np.float64)
            logits = xt @ router
            probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            top = np.argsort(-probs)[:2]
            for gate, e in zip(probs[top] / probs[top].sum(), top, strict=True):
                hidden = xt @ w_gate[e]
                hidden = hidden / (1 + np.exp(-hidden)) * (xt @ w_up[e])  # silu(gate) * up
                expected[b, s] += gate * (hidden @ w_down[e])
    np.testing.assert_allclose(y, expected, atol=1e-5)


def test_moe_grads_reach_router_and_experts() -> None:
    graphdef, state = _moe_mlp(capacity_factor=1.0)
    x = np.random.default_rng(3).normal(size=(2, 8, 16)).astype(np.float32)

    def loss(state: nnx.State) -> jax.Array:
        y, aux = _apply(graphdef, state, x)
        return jnp.sum(y**2) + aux

    grads = run_compiled(jax.grad(loss), state)
    for name in ("router", "w_gate", "w_up", "w_down"):
        leaves = [np.asarray(g) for g in jax.tree.leaves(grads[name])]
        assert all(np.isfinite(g).all() for g in leaves)
        assert any(np.abs(g).sum() > 0 for g in leaves), name
