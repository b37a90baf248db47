"""Checkpoints (``shardplan.train.checkpoint``): bit-exact round trips, keep-K, restoring onto
another layout (sub-meshes), another model's checkpoint named, damaged steps, and a save killed
with SIGKILL leaving the previous step loadable."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import shardplan_models as models
from flax import nnx
from helpers.processes import child_env
from helpers.sigkill import kill_while_saving
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.errors import CheckpointError, ConfigError
from shardplan.train.checkpoint import Checkpointer, abstract_target, leaf_infos

ROOT = Path(__file__).parents[2]


def _mesh(devices: list[Any], shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(
        np.array(devices).reshape(shape),
        names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(names),
    )


def _spread(tree: Any) -> Any:
    """Every leaf split over all 8 devices on its first divisible axis (else replicated)."""
    mesh = _mesh(jax.devices(), (8,), ("x",))

    def spec(x: Any) -> P:
        for axis, size in enumerate(np.shape(x)):
            if size % 8 == 0:
                return P(*([None] * axis), "x")
        return P()

    return jax.device_put(tree, jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), tree))


def _assert_bit_equal(got: Any, want: Any) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)


def _target_like(state: Any) -> Any:
    return abstract_target(state, jax.tree.map(lambda x: x.sharding, state))


def _small_state(scale: float = 1.0) -> dict[str, Any]:
    return {
        "params": {
            "w": jnp.arange(64, dtype=jnp.float32).reshape(8, 8) * scale,
            "b": jnp.linspace(-1, 1, 6, dtype=jnp.float32) * scale,
            "e": jnp.ones((16, 4), jnp.bfloat16) * scale,
        },
        "step": jnp.asarray(int(scale), jnp.int32),
    }


def test_nnx_state_round_trip_is_bit_exact(tmp_path: Path) -> None:
    config = models.load_model_config("gpt-tiny")
    _, state = models.init_train_state(config, seed=0)
    state = _spread(jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t))(state))  # moments != 0
    meta = {
        "data": {"position": 8, "fingerprint": "abc"},
        "plan_hash": "p1",
        "config": {"lr": 3e-4},
    }
    with Checkpointer(tmp_path, every_steps=1, keep=2) as ckpt:
        assert ckpt.save(1, state, meta=meta)
    with Checkpointer(tmp_path, every_steps=1, keep=2) as again:  # a resumed run
        assert again.latest_step() == 1
        restored = again.restore(target=_target_like(state))
    assert restored.step == 1 and restored.meta == meta
    assert isinstance(restored.state, nnx.State)
    _assert_bit_equal(restored.state, state)


def test_linen_train_state_round_trip(tmp_path: Path) -> None:
    from helpers.linen_case import linen_case  # tests/ is on sys.path (pytest pythonpath)

    state = linen_case((16, 8))[0].replace(step=jnp.asarray(3))
    state = _spread(jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t))(state))  # moments != 0
    with Checkpointer(tmp_path, every_steps=1, keep=1) as ckpt:
        ckpt.save(1, state, meta={})
        restored = ckpt.restore(target=_target_like(state)).state
    assert type(restored) is type(state) and restored.apply_fn is state.apply_fn
    _assert_bit_equal(restored, state)


def test_plain_dict_round_trip_and_meta(tmp_path: Path) -> None:
    state = _spread(_small_state())
    with Checkpointer(tmp_path, every_steps=5, keep=None) as ckpt:
        ckpt.save(5, state, meta={"data": {"position": 40}})
        assert ckpt.read_meta() == {"data": {"position": 40}}
        restored = ckpt.restore(5, target=_target_like(state))
    _assert_bit_equal(restored.state, state)
    assert [(i.path, i.shape, i.dtype) for i in leaf_infos(state)][:2] == [
        ("params/b", (6,), "float32"),
        ("params/e", (16, 4), "bfloat16"),
    ]


def test_asynchronous_save_round_trip(tmp_path: Path) -> None:
    state = _spread(_small_state())
    with Checkpointer(tmp_path, every_steps=1, keep=1, asynchronous=True) as ckpt:
        ckpt.save(1, state, meta={})
        ckpt.wait()
        assert ckpt.all_steps() == [1]
        restored = ckpt.restore(target=_target_like(state))
        _assert_bit_equal(restored.state, state)
        assert restored.verified  # the checksums written once the background save committed


def test_keeps_the_last_k_and_saves_every_n(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, every_steps=3, keep=2) as ckpt:
        assert [s for s in range(1, 10) if ckpt.should_save(s)] == [3, 6, 9]
        assert ckpt.should_save(10, final=True) and not ckpt.should_save(10)
        for s in range(1, 6):
            assert ckpt.save(s, _small_state(s), meta={"step": s})
        assert ckpt.all_steps() == [4, 5]
        assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["4", "5"]
        assert not ckpt.save(5, _small_state(9), meta={"step": 9})  # already saved: kept
        assert ckpt.read_meta(5) == {"step": 5}
        with pytest.raises(CheckpointError, match="resume picking step 5"):
            ckpt.save(3, _small_state(3), meta={})
        with pytest.raises(CheckpointError, match="not JSON"):
            ckpt.save(6, _small_state(6), meta={"x": object()})
    with pytest.raises(ConfigError, match="every_steps"):
        Checkpointer(tmp_path, every_steps=0, keep=2)
    with Checkpointer(tmp_path, every_steps=None, keep=2) as at_the_end:
        assert not at_the_end.should_save(100) and at_the_end.should_save(7, final=True)


def test_restores_onto_other_sub_meshes(tmp_path: Path) -> None:
    """Saved 8-way over all devices; restored with leaves split between devices 0-3 and 4-7
    (a 2-stage pipeline's layout), each with other specs."""
    state = _spread(_small_state())
    devices = jax.devices()
    first = _mesh(devices[:4], (4,), ("data",))
    second = _mesh(devices[4:], (2, 2), ("data", "model"))
    shardings = {
        "params": {
            "w": NamedSharding(first, P(None, "data")),
            "b": NamedSharding(second, P("model")),
            "e": NamedSharding(second, P("data", "model")),
        },
        "step": NamedSharding(first, P()),
    }
    with Checkpointer(tmp_path, every_steps=1, keep=1) as ckpt:
        ckpt.save(1, state, meta={})
        restored = ckpt.restore(target=abstract_target(state, shardings)).state
    _assert_bit_equal(restored, state)
    for leaf, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding == sharding


def test_another_models_checkpoint_names_the_leaves(tmp_path: Path) -> None:
    state = _small_state()
    with Checkpointer(tmp_path, every_steps=1, keep=1) as ckpt:
        ckpt.save(1, state, meta={})
        other = dict(
            state,
            params={
                "w": jnp.zeros((8, 16)),
                "bias": state["params"]["b"],
                "e": state["params"]["e"],
            },
        )
        with pytest.raises(CheckpointError) as caught:
            ckpt.restore(target=_target_like(other))
    message = str(caught.value)
    assert "params/w: checkpoint float32[8,8], target float32[8,16]" in message
    assert "params/b: only in the checkpoint (float32[6])" in message
    assert "params/bias: only in the target (float32[6])" in message
    assert "another directory" in message and "start fresh" in message


def test_a_target_must_fit_its_leaf(tmp_path: Path) -> None:
    state = _small_state()
    mesh = _mesh(jax.devices()[:4], (4,), ("data",))
    with Checkpointer(tmp_path, every_steps=1, keep=1) as ckpt:
        ckpt.save(1, state, meta={})
        unsharded = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        with pytest.raises(CheckpointError, match=r"(?s)no sharding.*params/b"):
            ckpt.restore(target=unsharded)
        shardings = jax.tree.map(lambda x: NamedSharding(mesh, P()), state)
        shardings["params"]["b"] = NamedSharding(mesh, P("data"))  # 6 rows over 4 devices
        with pytest.raises(CheckpointError, match=r"(?s)does not fit.*params/b.*float32\[6\]"):
            ckpt.restore(target=abstract_target(state, shardings))


def test_an_empty_directory_is_a_fresh_start(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "new", every_steps=1, keep=1) as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(CheckpointError, match="no checkpoint to restore"):
            ckpt.restore(target=_target_like(_small_state()))


def test_a_damaged_latest_step_names_the_intact_one(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, every_steps=1, keep=3) as ckpt:
        ckpt.save(1, _small_state(1), meta={"step": 1})
        ckpt.save(2, _small_state(2), meta={"step": 2})
    for name in ("manifest.ocdbt", "d"):  # the arrays' index and data files
        path = tmp_path / "2" / "state" / name
        if path.is_file():
            path.unlink()
        else:
            shutil.rmtree(path)
    target = _target_like(_small_state())
    with Checkpointer(tmp_path, every_steps=1, keep=3) as ckpt:
        with pytest.raises(CheckpointError) as caught:
            ckpt.restore(target=target)
        message = str(caught.value)
        assert str(tmp_path / "2") in message and "step 1 is intact" in message
        _assert_bit_equal(ckpt.restore(1, target=target).state, _small_state(1))


def _flip(path: Path, offset: int, count: int = 64) -> None:
    """Inverts ``count`` bytes of ``path`` from ``offset`` (the file keeps its size)."""
    data = bytearray(path.read_bytes())
    for i in range(offset, min(offset + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_bytes_in_a_checkpoint_file_are_named_not_restored(tmp_path: Path) -> None:
    # 64 bytes of the arrays' data inverted in place, the size unchanged: before checksums,
    # orbax restored the damaged values without a word.
    with Checkpointer(tmp_path, every_steps=1, keep=3) as ckpt:
        ckpt.save(1, _small_state(1), meta={"step": 1})
        ckpt.save(2, _small_state(2), meta={"step": 2})
    assert (tmp_path / "2" / "checksums.json").is_file()
    data = max((p for p in (tmp_path / "2" / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)  # the largest file: array data
    size = data.stat().st_size
    _flip(data, size // 2)
    assert data.stat().st_size == size
    target = _target_like(_small_state())
    with Checkpointer(tmp_path, every_steps=1, keep=3) as ckpt:
        verdict = ckpt.verify(2)
        assert not verdict.ok and verdict.file == data and "SHA-256 differs" in verdict.problem
        with pytest.raises(CheckpointError) as caught:
            ckpt.restore(target=target)
        message = str(caught.value)
        assert "step 2 is damaged" in message and str(data) in message
        assert "step 1 is intact" in message and ckpt.intact_before(2) == 1
        restored = ckpt.restore(1, target=target)
        assert restored.verified
        _assert_bit_equal(restored.state, _small_state(1))


def test_a_step_without_checksums_restores_as_unverified(tmp_path: Path) -> None:
    # a step written before checksums existed, or killed between orbax's commit and them
    with Checkpointer(tmp_path, every_steps=1, keep=3) as ckpt:
        ckpt.save(1, _small_state(1), meta={"step": 1})
    (tmp_path / "1" / "checksums.json").unlink()
    with Checkpointer(tmp_path, every_steps=1, keep=3) as ckpt:
        restored = ckpt.restore(target=_target_like(_small_state()))
    assert not restored.verified
    _assert_bit_equal(restored.state, _small_state(1))


_KILLED_SAVE = """
    import sys
    import jax.numpy as jnp
    from shardplan.train.checkpoint import Checkpointer

    ckpt = Checkpointer(sys.argv[1], every_steps=1, keep=3)
    for step in (1, 2):
        state = {"params": {"w": jnp.full((512, 512), float(step))}, "step": jnp.asarray(step)}
        ckpt.save(step, state, meta={"step": step})
    print("the save was not stopped", flush=True)
"""


@pytest.mark.parametrize(
    "stall_at",
    [
        "2.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp",  # mid-save: the arrays not final
        "2.orbax-checkpoint-tmp",  # everything written, just before the rename
    ],
)
@pytest.mark.slow
def test_a_save_killed_by_sigkill_leaves_the_previous_step(tmp_path: Path, stall_at: str) -> None:
    directory, marker = tmp_path / "ckpt", tmp_path / "stalled"
    env = child_env(JAX_PLATFORMS="cpu")
    kill_while_saving(_KILLED_SAVE, [str(directory)], stall_at=stall_at, marker=marker,
                      env=env, timeout_s=120)
    assert (directory / "2.orbax-checkpoint-tmp").is_dir()  # the killed save's leftover

    def state(step: int) -> dict[str, Any]:
        return {"params": {"w": jnp.full((512, 512), float(step))}, "step": jnp.asarray(step)}

    target = _target_like(state(0))
    with Checkpointer(directory, every_steps=1, keep=3) as ckpt:
        assert ckpt.latest_step() == 1
        restored = ckpt.restore(target=target)
        assert restored.meta == {"step": 1}
        _assert_bit_equal(restored.state, state(1))
        assert ckpt.save(2, state(2), meta={"step": 2})  # the leftover does not get in the way
        assert ckpt.all_steps() == [1, 2]
        _assert_bit_equal(ckpt.restore(target=target).state, state(2))
    assert sorted(p.name for p in directory.iterdir() if p.is_dir()) == ["1", "2"]


@pytest.mark.slow
def test_two_processes_save_stage_leaves_and_reshard(tmp_path: Path) -> None:
    """2 processes x 4 CPU devices (``shardplan launch``): a pipeline layout's leaves, each held
    by one process (a placeholder on the other), saved and restored onto a mesh over both
    processes and onto the swapped stages; then saved from that mesh and restored onto the
    stages (``tests/data/checkpoint_worker.py`` checks each process's shards)."""
    worker = ROOT / "tests" / "data" / "checkpoint_worker.py"
    env = child_env(own_devices=True)  # 4 devices per process
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardplan.cli.main",
            "launch",
            "--nprocs",
            "2",
            "--cpu-devices",
            "4",
            "--",
            sys.executable,
            str(worker),
            str(tmp_path / "ckpt"),
        ],
        env=env,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for p in range(2):
        for line in (
            "restored onto both processes",
            "restored onto swapped stages",
            "restored step 2 onto the stages",
            f"process {p} ok",
        ):
            assert f"[p{p}] {line}" in done.stdout, done.stdout[-3000:]
    assert sorted(f.name for f in (tmp_path / "ckpt" / "1" / "owned").glob("*.npy")) == [
        "0.npy",
        "1.npy",
        "2.npy",
        "3.npy",
    ]  # step 1's leaves each written by the process holding it
