"""The run config of ``shardplan train``: loading, overrides, errors, round trip, optimizer,
cluster forms; and the check that every YAML file under ``configs/`` is parsed by a test."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from shardplan.data import DataConfig
from shardplan.errors import ConfigError
from shardplan.planner.config import PlanConfig
from shardplan.train.config import (
    ClusterSection,
    LocalCluster,
    ModelSection,
    OptimizerConfig,
    RunConfig,
    TrainConfig,
    load_run_config,
)

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
TRAIN_FILES = sorted((CONFIGS / "train").glob("*.yaml"))
TINY = CONFIGS / "train" / "tiny.yaml"

PARSED_BY = {
    "models": "test_models.py::test_every_preset_parses",
    "clusters": "test_cluster.py::test_every_cluster_file_parses_and_round_trips",
    "devices": "test_cluster.py::test_every_device_file_parses_and_cites_every_number",
    "train": "test_run_config.py::test_every_train_config_parses_and_round_trips",
}
"""Each directory of ``configs/`` and the test that parses every ``*.yaml`` in it (those tests
glob one directory deep, so a file elsewhere would go unparsed)."""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def _error(path: Path, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_run_config(path, overrides)
    return str(info.value)


# --------------------------------------------------------------------------------------------
# every file under configs/


def test_every_yaml_file_under_configs_is_parsed_by_a_test() -> None:
    files = sorted(CONFIGS.rglob("*.yaml")) + sorted(CONFIGS.rglob("*.yml"))
    unparsed = [
        f
        for f in files
        if f.parent.parent != CONFIGS or f.parent.name not in PARSED_BY or f.suffix != ".yaml"
    ]
    assert not unparsed, f"no test parses {unparsed}: add the directory to PARSED_BY"
    assert {p.name for p in CONFIGS.iterdir() if p.is_dir()} == set(PARSED_BY)
    for test in PARSED_BY.values():
        module, name = test.split("::")
        (path,) = (REPO / "tests").rglob(module)  # tests/<stage>/test_x.py
        assert f"def {name}(" in path.read_text(), test


@pytest.mark.parametrize("path", TRAIN_FILES, ids=lambda p: p.stem)
def test_every_train_config_parses_and_round_trips(path: Path, tmp_path: Path) -> None:
    config = load_run_config(path)
    assert config.model.build().num_params() > 0
    stored = _write(tmp_path, config.to_yaml())
    assert load_run_config(stored) == config
    assert load_run_config(stored).to_dict() == config.to_dict()
    # The resolved file names every option of every section, defaults included.
    resolved = yaml.safe_load(stored.read_text())
    assert list(resolved) == ["model", "data", "optimizer", "cluster", "plan", "train", "output"]
    assert set(resolved["plan"]) == {"file"} | set(PlanConfig.__dataclass_fields__)
    assert set(resolved["data"]) == set(DataConfig.__dataclass_fields__)
    assert set(resolved["train"]) == set(TrainConfig.__dataclass_fields__)


def test_the_demo_is_a_pipeline_over_a_mixed_local_cluster() -> None:
    config = load_run_config(CONFIGS / "train" / "demo.yaml")
    model = config.model.build()
    # 4 blocks x 198,272 + 256 x 128 token + 128 x 128 position embeddings + final LayerNorm.
    assert model.num_params() == 842_496
    assert (model.vocab_size, model.n_layers, config.data.source) == (256, 4, "builtin")
    assert config.cluster.local == LocalCluster(types={"a100-80g": 4, "v100-32g": 4})
    assert config.plan.config.pipeline is True
    assert config.output.dir == "runs/demo" and 100 <= config.train.steps <= 1000
    cluster = config.cluster.build(jax.devices())
    assert cluster.device_types == ("a100-80g", "v100-32g") and cluster.num_devices == 8


def test_only_the_model_preset_must_be_given(tmp_path: Path) -> None:
    config = load_run_config(_write(tmp_path, "model: {preset: gpt-tiny}\n"))
    assert config == RunConfig(model=ModelSection("gpt-tiny"))
    assert config.cluster == ClusterSection(local=LocalCluster())
    assert config.plan.file is None and config.plan.config == PlanConfig()
    assert "missing the section 'model'" in _error(_write(tmp_path, "train: {steps: 5}\n"))


# --------------------------------------------------------------------------------------------
# overrides


def test_dotted_overrides_take_yaml_values_at_any_depth() -> None:
    config = load_run_config(
        TINY,
        (
            "--train.steps=7",  # int
            "output.resume=false",  # bool, without the dashes
            "--plan.schedules=[1f1b, gpipe]",  # list -> tuple
            "--plan.pipeline=null",  # null
            "--model.overrides.n_layers=3",  # into a free mapping
            "--optimizer.learning_rate=2e-3",  # YAML 1.1 reads this as a string
            "--optimizer.min_learning_rate=0",  # an int where a float is wanted
            "--train.sample_prompt=import os",  # a string with a space
        ),
    )
    assert config.train.steps == 7 and config.output.resume is False
    assert config.plan.config.schedules == ("1f1b", "gpipe") and config.plan.config.pipeline is None
    assert config.model.overrides == {"n_layers": 3} and config.model.build().n_layers == 3
    assert config.optimizer.learning_rate == 2e-3
    assert config.optimizer.min_learning_rate == 0.0
    assert isinstance(config.optimizer.min_learning_rate, float)
    assert config.train.sample_prompt == "import os"
    # A section that the file does not have is created; null under a key is replaced.
    swapped = load_run_config(
        TINY, ("--cluster.local=null", "--cluster.path=configs/clusters/dgx-a100.yaml")
    )
    assert swapped.cluster == ClusterSection(path="configs/clusters/dgx-a100.yaml")
    typed = load_run_config(TINY, ("--cluster.local.types.cpu=8",))
    assert typed.cluster.local == LocalCluster(types={"cpu": 8})


@pytest.mark.parametrize(
    ("override", "path", "suggestion"),
    [
        ("--train.stesp=3", "train.stesp", "'steps'"),
        ("--trian.steps=3", "trian", "'train'"),
        ("--data.seq_lenn=16", "data.seq_lenn", "'seq_len'"),
        ("--plan.pipelin=true", "plan.pipelin", "'pipeline'"),
        ("--cluster.local.typse={}", "cluster.local.typse", "'types'"),
        ("--model.overrides.n_layer=3", "model.overrides.n_layer", "'n_layers'"),
    ],
)
def test_an_unknown_key_in_an_override_names_it_with_a_did_you_mean(
    override: str, path: str, suggestion: str
) -> None:
    message = _error(TINY, (override,))
    assert path in message and f"did you mean {suggestion}?" in message
    assert override in message


@pytest.mark.parametrize(
    "override", ["train.steps", "--=3", "--train..steps=3", "--train.steps.x=3", "--train.steps=[1"]
)
def test_a_malformed_override_names_it(override: str) -> None:
    assert override in _error(TINY, (override,))


# --------------------------------------------------------------------------------------------
# errors in the file


@pytest.mark.parametrize(
    ("text", "path", "suggestion"),
    [
        ("modle: {preset: gpt-tiny}\n", "modle", "'model'"),
        ("model: {preset: gpt-tiny}\ntrain: {stesp: 3}\n", "train.stesp", "'steps'"),
        (
            "model: {preset: gpt-tiny}\noptimizer: {warmup: 3}\n",
            "optimizer.warmup",
            "'warmup_steps'",
        ),
        ("model: {preset: gpt-tiny}\ndata: {batchsize: 3}\n", "data.batchsize", "'batch_size'"),
        ("model: {preset: gpt-tiny}\nplan: {fille: p.json}\n", "plan.fille", "'file'"),
        (
            "model: {preset: gpt-tiny}\ncluster: {local: {type: {}}}\n",
            "cluster.local.type",
            "'types'",
        ),
        (
            "model: {preset: gpt-tiny}\noutput: {keep_checkpoint: 2}\n",
            "output.keep_checkpoint",
            "'keep_checkpoints'",
        ),
        (
            "model: {preset: gpt-tiny, overrides: {d_modle: 32}}\n",
            "model.overrides.d_modle",
            "'d_model'",
        ),
    ],
)
def test_an_unknown_key_in_the_file_names_the_key_path_and_the_file(
    tmp_path: Path, text: str, path: str, suggestion: str
) -> None:
    file = _write(tmp_path, text)
    message = _error(file)
    assert f"where: {path}" in message and f"did you mean {suggestion}?" in message
    assert str(file) in message


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("train: {steps: abc}", "train.steps"),
        ("train: {steps: 2.5}", "train.steps"),
        ("train: {eval_every: true}", "train.eval_every"),
        ("output: {resume: 'yes'}", "output.resume"),
        ("optimizer: {learning_rate: [1]}", "optimizer.learning_rate"),
        ("optimizer: {b1: fast}", "optimizer.b1"),
        ("data: {seq_len: x}", "data.seq_len"),
        ("plan: {max_stages: two}", "plan.max_stages"),
        ("plan: {file: 3}", "plan.file"),
        ("cluster: {local: {types: {cpu: '8'}}}", "cluster.local.types.cpu"),
        ("model: {preset: gpt-tiny, overrides: {n_layers: four}}", "n_layers"),
        ("train: 5", "train"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_key(tmp_path: Path, text: str, path: str) -> None:
    if not text.startswith("model"):
        text = "model: {preset: gpt-tiny}\n" + text
    message = _error(_write(tmp_path, text + "\n"))
    assert path in message and "value:" in message


def test_out_of_range_values_name_the_key_and_value() -> None:
    assert "where: train.steps\n  value: 0" in _error(TINY, ("--train.steps=0",))
    assert "optimizer.min_learning_rate" in _error(
        TINY, ("--optimizer.min_learning_rate=1.0",)
    )  # above learning_rate
    assert "output.keep_checkpoints" in _error(TINY, ("--output.keep_checkpoints=0",))
    assert "cluster.local.types.cpu" in _error(TINY, ("--cluster.local.types={cpu: 0}",))
    with pytest.raises(ConfigError, match=r"train\.eval_every"):
        TrainConfig(eval_every=0)


def test_the_sections_must_agree() -> None:
    message = _error(TINY, ("--data.seq_len=64",))
    assert "where: data.seq_len" in message and "max_seq_len=32" in message
    message = _error(TINY, ("--model.overrides.vocab_size=100",))
    assert "byte-level" in message and "vocab_size: 256" in message


def test_unreadable_files_name_the_file_and_yaml_errors_the_line_and_column(tmp_path: Path) -> None:
    assert "where: " + str(tmp_path / "none.yaml") in _error(tmp_path / "none.yaml")
    file = _write(tmp_path, "model:\n  preset: gpt-tiny\ntrain:\n  steps: [3\n")
    assert f"where: {file}:5:1" in _error(file)
    file = _write(tmp_path, "model:\n  preset: gpt-tiny\n\tsteps: 3\n")
    assert f"where: {file}:3:1" in _error(file)
    assert "mapping of sections" in _error(_write(tmp_path, "- 1\n"))


# --------------------------------------------------------------------------------------------
# the optimizer


def test_the_learning_rate_warms_up_linearly_then_decays_by_cosine_to_the_minimum() -> None:
    config = OptimizerConfig(learning_rate=1e-3, min_learning_rate=1e-4, warmup_steps=10)
    lr = config.schedule(110)
    # Warmup: 0 at step 0, linear to the peak at step 10.
    np.testing.assert_allclose([lr(0), lr(5), lr(10)], [0.0, 5e-4, 1e-3], rtol=1e-6)
    # Cosine over the remaining 100 steps: min + (peak - min) * (1 + cos(pi * t)) / 2.
    for step in (35, 60, 85):
        t = (step - 10) / 100
        want = 1e-4 + (1e-3 - 1e-4) * (1 + np.cos(np.pi * t)) / 2
        np.testing.assert_allclose(lr(step), want, rtol=1e-5)
    np.testing.assert_allclose([lr(110), lr(200)], [1e-4, 1e-4], rtol=1e-5)
    # A run no longer than its warmup (a smoke test) only warms up.
    short = config.schedule(5)
    np.testing.assert_allclose([short(0), short(3), short(5)], [0.0, 3e-4, 5e-4], rtol=1e-6)
    with pytest.raises(ConfigError, match=r"train\.steps"):
        config.schedule(0)


def test_the_optimizer_is_adamw_on_the_schedule_with_the_decay_mask() -> None:
    config = load_run_config(
        TINY, ("--optimizer.warmup_steps=2", "--train.steps=10", "--optimizer.weight_decay=0.5")
    )
    tx = config.optimizer_transform()
    params = {"w": jnp.ones((2,)), "bias": jnp.ones((2,))}
    state = tx.init(params)
    lr = config.optimizer.schedule(10)
    zero = jax.tree.map(jnp.zeros_like, params)
    for step in range(4):
        # With zero gradients AdamW's update is the decoupled decay alone: -lr(step) * wd * w,
        # and biases are not decayed.
        updates, state = tx.update(zero, state, params)
        np.testing.assert_allclose(updates["w"], -lr(step) * 0.5 * np.ones(2), rtol=1e-6)
        np.testing.assert_allclose(updates["bias"], np.zeros(2))
    # Clipping comes first: a gradient of norm 10 reaches Adam scaled to norm clip_norm = 1,
    # so Adam's first moment after one step is (1 - b1) * [0.6, 0.8].
    state = tx.init(params)
    _, state = tx.update({"w": jnp.array([6.0, 8.0]), "bias": jnp.zeros((2,))}, state, params)
    adam = state[1][0]  # chain(clip, adamw) -> adamw = chain(scale_by_adam, decay, lr)
    np.testing.assert_allclose(adam.mu["w"], 0.1 * np.array([0.6, 0.8]), rtol=1e-6)


# --------------------------------------------------------------------------------------------
# the cluster section


def test_the_cluster_section_is_a_file_or_the_local_devices() -> None:
    devices = jax.devices()
    from_file = ClusterSection(path=str(CONFIGS / "clusters" / "dgx-a100.yaml")).build(devices)
    assert from_file.name == "dgx-a100" and from_file.devices == tuple(devices)
    mixed = ClusterSection(local=LocalCluster(types={"a100-80g": 2, "v100-32g": 2})).build()
    assert mixed.device_types == ("a100-80g", "v100-32g") and mixed.devices == tuple(devices[:4])
    every = ClusterSection(local=LocalCluster()).build()
    assert every.num_devices == len(devices) == 8
    too_big = ClusterSection(path=str(CONFIGS / "clusters" / "a100x8_v100x8.yaml"))
    with pytest.raises(ConfigError, match="16 devices but jax sees 8") as info:
        too_big.build()
    assert "xla_force_host_platform_device_count=16" in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        "cluster: {path: configs/clusters/dgx-a100.yaml, local: {}}",
        "cluster: {}",
        "cluster: {path: null, local: null}",
    ],
)
def test_a_cluster_section_with_both_forms_or_neither_is_refused(tmp_path: Path, text: str) -> None:
    message = _error(_write(tmp_path, f"model: {{preset: gpt-tiny}}\n{text}\n"))
    assert "exactly one of `path` and `local`" in message and "where: cluster" in message


def test_the_plan_section_holds_a_plan_file_next_to_the_planner_options(tmp_path: Path) -> None:
    config = load_run_config(TINY, ("--plan.file=runs/p.json", "--plan.max_stages=2"))
    assert config.plan.file == "runs/p.json" and config.plan.config.max_stages == 2
    assert load_run_config(_write(tmp_path, config.to_yaml())) == config
