"""Training data: sources, the train/validation split, deterministic batches, errors, placement.

Most tests read a ``.bin`` file whose token at position ``p`` is ``p`` (``arange``), so a batch
shows exactly which corpus positions it was cut from.
"""

import math
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.data import (
    BYTE_VOCAB_SIZE,
    DataConfig,
    abstract_batch,
    load_data,
    place_batch,
    read_builtin,
)
from shardplan.errors import ConfigError, DataError


def _arange_bin(tmp_path: Path, n: int) -> str:
    """A .bin file whose token at position p is p."""
    path = tmp_path / "tokens.bin"
    np.arange(n, dtype=np.uint16).tofile(path)
    return str(path)


def _positions_config(tmp_path: Path, n: int = 1000, **kw) -> DataConfig:
    options = {"seq_len": 8, "batch_size": 4, "val_fraction": 0.1, "seed": 0} | kw
    return DataConfig(source="bin", path=_arange_bin(tmp_path, n), **options)


# ---- determinism ----------------------------------------------------------------------------


def test_same_seed_gives_same_batches_and_different_seeds_differ():
    config = DataConfig(seq_len=16, batch_size=4, seed=3, builtin_bytes=200_000)
    a, b = load_data(config), load_data(config)
    other = load_data(DataConfig(seq_len=16, batch_size=4, seed=4, builtin_bytes=200_000))
    for step in (0, 1, 17, 1000):
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(a.train_batch(step)[key], b.train_batch(step)[key])
        assert not np.array_equal(a.train_batch(step)["inputs"],
                                  other.train_batch(step)["inputs"])
    assert a.fingerprint == b.fingerprint != other.fingerprint
    assert a.corpus.fingerprint == other.corpus.fingerprint  # same tokens, different order


def test_resumed_run_sees_the_uninterrupted_runs_batches(tmp_path):
    # 900 training tokens / seq 8 = 112 windows per epoch; 100 steps of 4 = 400 samples cross
    # three epoch boundaries, at steps 28, 56 and 84 (a boundary inside a batch: next test).
    config = _positions_config(tmp_path, batch_size=4)
    uninterrupted = load_data(config)
    seen = [uninterrupted.train_batch(k) for k in range(100)]
    resumed = load_data(config)
    for k in (99, 57, 56, 55, 3, 84, 28):  # out of order: nothing depends on call history
        np.testing.assert_array_equal(resumed.train_batch(k)["inputs"], seen[k]["inputs"])
        np.testing.assert_array_equal(resumed.train_batch(k)["targets"], seen[k]["targets"])


def test_a_batch_spanning_an_epoch_boundary_is_deterministic(tmp_path):
    # 112 windows per epoch and 5 rows a batch: batch 22 holds samples 110..114, two epochs.
    config = _positions_config(tmp_path, batch_size=5)
    batch = load_data(config).train_batch(22)
    fresh = load_data(config)
    fresh.train_batch(500)  # fill its epoch cache with other epochs first
    np.testing.assert_array_equal(fresh.train_batch(22)["inputs"], batch["inputs"])


# ---- windows, targets and the split --------------------------------------------------------


def test_targets_are_inputs_shifted_by_one_and_windows_are_contiguous(tmp_path):
    data = load_data(_positions_config(tmp_path))
    batch = data.train_batch(5)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    assert batch["inputs"].shape == batch["targets"].shape == (4, 8)
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)  # token p is p
    np.testing.assert_array_equal(np.diff(batch["inputs"], axis=1), 1)


def test_an_epoch_shows_every_training_window_once(tmp_path):
    data = load_data(_positions_config(tmp_path, batch_size=4))
    assert (data.train_tokens, data.val_tokens, data.train_windows) == (900, 100, 112)
    starts = np.concatenate([data.train_batch(k)["inputs"][:, 0] for k in range(28)])
    assert len(set(starts.tolist())) == 112  # 28 batches x 4 = one epoch, no repeats
    offset = starts.min()
    assert 0 <= offset <= 900 - 1 - 112 * 8  # the slack: 3 tokens
    np.testing.assert_array_equal(np.sort(starts), offset + 8 * np.arange(112))


def test_train_and_validation_windows_do_not_overlap(tmp_path):
    data = load_data(_positions_config(tmp_path, n=1000, val_fraction=0.1))
    train_positions = np.concatenate(
        [np.concatenate([b["inputs"], b["targets"]]).ravel()
         for b in (data.train_batch(k) for k in range(200))])
    assert train_positions.max() < 900  # targets included: none reads a validation token
    val = [data.val_batch(j) for j in range(3)]
    for batch in val:
        positions = np.concatenate([batch["inputs"], batch["targets"]])
        assert positions.min() >= 900 and positions.max() < 1000
        np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)
    # (100 - 1) // 8 = 12 validation windows, taken in order: batch 0 = windows 0..3.
    assert data.val_windows == 12
    np.testing.assert_array_equal(val[0]["inputs"][:, 0], 900 + 8 * np.arange(4))
    # Batch 3 = windows 12..15, wrapped to 0..3: the same windows as batch 0.
    np.testing.assert_array_equal(data.val_batch(3)["inputs"], val[0]["inputs"])


def test_validation_batches_are_the_same_every_evaluation(tmp_path):
    config = _positions_config(tmp_path, val_batches=3)
    first = list(load_data(config).val_batches())
    data = load_data(config)
    data.train_batch(40)
    again = list(data.val_batches())
    assert len(first) == len(again) == 3
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_no_validation_split_when_val_fraction_is_zero(tmp_path):
    data = load_data(_positions_config(tmp_path, val_fraction=0.0))
    assert (data.train_tokens, data.val_tokens, data.val_windows) == (1000, 0, 0)
    with pytest.raises(DataError, match="no validation split") as info:
        data.val_batch(0)
    assert "data.val_fraction" in str(info.value) and "fix:" in str(info.value)


# ---- sources --------------------------------------------------------------------------------


def test_builtin_corpus_is_large_bytes_and_has_a_stable_fingerprint():
    first, second = read_builtin(max_bytes=2**20), read_builtin(max_bytes=2**20)
    assert first.n_tokens == 2**20  # the budget, exactly: the stdlib holds more
    assert first.tokens.dtype == np.uint8 and first.vocab_size == BYTE_VOCAB_SIZE
    assert first.fingerprint == second.fingerprint and first.files == second.files
    assert list(first.files) == sorted(first.files) and first.files[0].endswith(".py")
    assert not any(f.split("/")[0] in ("test", "site-packages", "encodings")
                   for f in first.files)
    # Python source: mostly printable ASCII, and it reads as UTF-8.
    text = first.tokens.tobytes()
    assert b"def " in text and b"import " in text
    assert np.mean((first.tokens >= 32) & (first.tokens < 127)) > 0.9
    assert read_builtin(max_bytes=1000).fingerprint != first.fingerprint


def test_builtin_dataset_default_budget():
    data = load_data(DataConfig(), vocab_size=256)
    assert data.corpus.n_tokens == 4 * 2**20 and data.corpus.max_token() < 256
    assert data.train_tokens + data.val_tokens == data.corpus.n_tokens


def test_text_file_round_trip(tmp_path):
    text = "héllo wörld, a small text file.\n" * 20
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    data = load_data(DataConfig(source="text", path=str(tmp_path / "corpus.txt"), seq_len=8,
                                batch_size=2, val_fraction=0.0))
    assert data.corpus.tokens.tobytes() == text.encode("utf-8")
    row = data.train_batch(0)["inputs"][0]
    assert bytes(row.astype(np.uint8)) in text.encode("utf-8")


def test_text_directory_reads_txt_files_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("second file\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third file\n")
    (tmp_path / "a.txt").write_text("first file\n")
    (tmp_path / "notes.md").write_text("not read\n")
    corpus = load_data(DataConfig(source="text", path=str(tmp_path), seq_len=4,
                                  val_fraction=0.0)).corpus
    assert corpus.tokens.tobytes() == b"first file\nsecond file\nthird file\n"
    assert [Path(f).name for f in corpus.files] == ["a.txt", "b.txt", "c.txt"]


def test_bin_file_round_trip_with_ids_above_255(tmp_path):
    ids = (np.arange(600, dtype=np.uint16) * 83) % 50257
    path = tmp_path / "train.bin"
    ids.tofile(path)
    data = load_data(DataConfig(source="bin", path=str(path), seq_len=16, batch_size=2,
                                val_fraction=0.0), vocab_size=50257)
    assert isinstance(data.corpus.tokens, np.memmap)
    np.testing.assert_array_equal(data.corpus.tokens, ids)
    assert data.corpus.max_token() == ids.max() > 255
    batch = data.train_batch(0)
    assert type(batch["inputs"]) is np.ndarray  # a copy, not a view of the memmap
    for row in range(2):  # each row is a contiguous run of the file
        start = int(np.flatnonzero(ids == batch["inputs"][row, 0])[0])
        np.testing.assert_array_equal(batch["inputs"][row], ids[start:start + 16])


def test_abstract_batch_matches_real_batches(tmp_path):
    config = _positions_config(tmp_path)
    batch, spec = load_data(config).train_batch(0), abstract_batch(config)
    for key in ("inputs", "targets"):
        assert (spec[key].shape, spec[key].dtype) == (batch[key].shape, batch[key].dtype)


# ---- errors ---------------------------------------------------------------------------------


def _data_error(config: DataConfig, vocab_size: int | None = None) -> str:
    with pytest.raises(DataError) as info:
        load_data(config, vocab_size=vocab_size)
    message = str(info.value)
    assert "fix:" in message
    return message


def test_missing_file_names_the_path(tmp_path):
    for source in ("text", "bin"):
        missing = str(tmp_path / "nope" / "train.bin")
        message = _data_error(DataConfig(source=source, path=missing))
        assert "does not exist" in message and "data.path" in message and missing in message
    with pytest.raises(DataError, match=r"where: train.yaml: data.path \('nope.txt'\)"):
        load_data(DataConfig(source="text", path="nope.txt"), where="train.yaml: data")


def test_empty_directory_and_directory_as_bin(tmp_path):
    (tmp_path / "other.md").write_text("no txt here")
    message = _data_error(DataConfig(source="text", path=str(tmp_path)))
    assert "no .txt files" in message and str(tmp_path) in message
    message = _data_error(DataConfig(source="bin", path=str(tmp_path)))
    assert "directory" in message and "train.bin" in message


def test_file_shorter_than_one_sequence_says_how_many_tokens(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("x" * 32)  # 32 tokens; seq_len 32 needs 33
    message = _data_error(DataConfig(source="text", path=str(path), seq_len=32))
    assert "has 32 tokens" in message and "seq_len + 1 = 33" in message
    assert str(path) in message and "at most 31" in message
    np.zeros(0, np.uint16).tofile(tmp_path / "empty.bin")
    message = _data_error(DataConfig(source="bin", path=str(tmp_path / "empty.bin")))
    assert "empty" in message and "empty.bin" in message


def test_validation_split_shorter_than_one_sequence(tmp_path):
    # 1000 tokens x 0.005 = 5 validation tokens < seq_len + 1 = 9.
    message = _data_error(_positions_config(tmp_path, val_fraction=0.005))
    assert "validation split holds 5 of 1000 tokens" in message
    assert "data.val_fraction" in message and "0.005" in message
    assert "at least 0.009" in message
    load_data(_positions_config(tmp_path, val_fraction=0.009))  # the fix works


def test_bin_size_not_a_multiple_of_two_bytes(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00\x02")
    message = _data_error(DataConfig(source="bin", path=str(path)))
    assert "3 bytes" in message and "uint16" in message and str(path) in message


def test_token_ids_at_or_above_the_vocab_size(tmp_path):
    path = _arange_bin(tmp_path, 1000)
    message = _data_error(DataConfig(source="bin", path=path), vocab_size=512)
    assert "Token id 999" in message and "vocab_size 512" in message and path in message
    load_data(DataConfig(source="bin", path=path), vocab_size=1000)  # 999 < 1000 passes
    # Byte-level text with bytes >= 128 and a 128-id vocabulary.
    (tmp_path / "t.txt").write_text("naïve " * 20, encoding="utf-8")
    message = _data_error(DataConfig(source="text", path=str(tmp_path / "t.txt"), seq_len=4),
                          vocab_size=128)
    assert "vocab_size 128" in message and "needs 256" in message


def test_text_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1") * 20)
    message = _data_error(DataConfig(source="text", path=str(path)))
    assert "not UTF-8" in message and "byte 3" in message and "source: bin" in message


# ---- config ---------------------------------------------------------------------------------


def test_unknown_source_and_keys_have_did_you_mean():
    with pytest.raises(ConfigError, match="did you mean 'builtin'") as info:
        DataConfig.from_dict({"source": "bultin"}, where="train.yaml: data")
    assert "train.yaml: data.source" in str(info.value) and "fix:" in str(info.value)
    with pytest.raises(ConfigError, match="did you mean 'seq_len'") as info:
        DataConfig.from_dict({"seqlen": 64}, where="train.yaml: data")
    assert "train.yaml: data.seqlen" in str(info.value)
    with pytest.raises(ConfigError, match="did you mean 'batch_size'"):
        DataConfig(batchsize=3)  # type: ignore[call-arg]


@pytest.mark.parametrize(("options", "field"), [
    ({"seq_len": 0}, "seq_len"),
    ({"seq_len": 8.0}, "seq_len"),
    ({"batch_size": True}, "batch_size"),
    ({"val_fraction": 1.0}, "val_fraction"),
    ({"seed": -1}, "seed"),
    ({"val_batches": 0}, "val_batches"),
    ({"builtin_bytes": 0}, "builtin_bytes"),
    ({"path": "x.txt"}, "path"),  # builtin reads no path
    ({"source": "bin"}, "path"),  # bin needs one
    ({"source": "text", "path": 3}, "path"),
])
def test_bad_config_values_name_the_field(options, field):
    with pytest.raises(ConfigError) as info:
        DataConfig.from_dict(options, where="train.yaml: data")
    assert f"train.yaml: data.{field}" in str(info.value) and "fix:" in str(info.value)
    with pytest.raises(ConfigError, match=f"DataConfig.{field}"):
        DataConfig(**options)


def test_from_dict_builds_the_config():
    config = DataConfig.from_dict({"source": "text", "path": "a.txt", "seq_len": 64,
                                   "val_fraction": 0})
    assert config == DataConfig(source="text", path="a.txt", seq_len=64, val_fraction=0)
    assert type(config.val_fraction) is float
    with pytest.raises(ConfigError, match="mapping"):
        DataConfig.from_dict(["source"])  # type: ignore[arg-type]


# ---- placement and a real step --------------------------------------------------------------


def test_place_batch_shards_rows_like_device_put():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    data = load_data(DataConfig(seq_len=16, batch_size=8, builtin_bytes=100_000))
    batch = data.train_batch(2)
    sharding = NamedSharding(mesh, P("data"))
    placed = place_batch(batch, {"inputs": sharding, "targets": sharding})
    reference = jax.device_put(batch, sharding)
    for key in ("inputs", "targets"):
        assert placed[key].sharding == reference[key].sharding
        np.testing.assert_array_equal(np.asarray(placed[key]), batch[key])
        assert placed[key].addressable_shards[3].data.shape == (1, 16)
        np.testing.assert_array_equal(placed[key].addressable_shards[3].data, batch[key][3:4])


def test_gpt_tiny_loss_on_the_builtin_corpus_is_finite():
    import optax
    from flax import nnx
    from shardplan_models.build import build_model
    from shardplan_models.config import load_model_config

    config = load_model_config("gpt-tiny")
    data = load_data(DataConfig(seq_len=config.max_seq_len, batch_size=4,
                                builtin_bytes=200_000), vocab_size=config.vocab_size)

    @jax.jit
    def loss(batch):
        logits, _ = build_model(config, rngs=nnx.Rngs(0))(batch["inputs"])  # [batch, seq, vocab]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    losses = [float(loss(data.train_batch(k))) for k in range(2)]
    assert all(math.isfinite(x) for x in losses)
    # An untrained model is near uniform over the 256 bytes: ln 256 = 5.55.
    assert all(abs(x - math.log(256)) < 1.0 for x in losses)
