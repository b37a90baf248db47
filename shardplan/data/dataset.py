"""Train/validation split and batches: batch ``k`` is a pure function of ``(seed, k)``.

The last ``val_fraction`` of the corpus is the validation split; the rest is the training split.
Both are cut into non-overlapping windows of ``seq_len + 1`` tokens sharing their edges (window
``w`` covers tokens ``[w * seq_len, (w + 1) * seq_len]``): ``inputs`` are the first ``seq_len``
tokens of a window, ``targets`` the last ``seq_len``, so every next-token pair of a split is in
exactly one window.

Training batches go through the windows in shuffled order, one epoch after another (epoch
``e`` is a permutation of the windows drawn from ``(seed, e)``, and its windows start at an
offset, also drawn from ``(seed, e)``, within the tokens a whole number of windows leaves
over). Global sample ``i = k * batch_size + row`` is window ``i % n_windows`` of epoch
``i // n_windows``, so batch ``k`` depends on ``(seed, k)`` only: a run resumed at step ``k``
sees exactly the batches an uninterrupted run would have. What a checkpoint keeps of the data
is the step index and :attr:`Dataset.fingerprint`.

Shuffled windows rather than random offsets: each epoch shows every training token once, which
matters for the small corpora this is meant for.

Validation batches are fixed: batch ``j`` holds windows ``j * batch_size ..`` of the
validation split in order (wrapping around when there are fewer windows), so every evaluation
sees the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from shardplan._traceback import api_boundary
from shardplan.data.config import DataConfig
from shardplan.data.corpus import Corpus, read_bin, read_builtin, read_text
from shardplan.errors import DataError, format_error

__all__ = ["Batch", "Dataset", "load_data"]

Batch = dict[str, np.ndarray]
"""``{"inputs": int32[batch, seq], "targets": int32[batch, seq]}``, as the models' train step
takes it (``shardplan_models.train.example_batch``)."""

_TRAIN_STREAM = 0x5EED_DA7A
"""Mixed into the shuffling seed, so ``DataConfig.seed`` can equal the parameter seed without
the two random streams being the same numbers."""


class Dataset:
    """A corpus split into training and validation windows, served as numpy batches.

    Build one with :func:`load_data`.

    Attributes:
      config: the data config.
      corpus: the tokens and where they came from.
      train_tokens: tokens in the training split (the first ones).
      val_tokens: tokens in the validation split (the last ones; 0 when ``val_fraction`` is 0).
      train_windows: ``seq_len``-token training windows per epoch.
      val_windows: validation windows.
    """

    def __init__(self, corpus: Corpus, config: DataConfig, /, *, where: str = "data") -> None:
        self.config = config
        self.corpus = corpus
        seq = config.seq_len
        n = corpus.n_tokens
        if n < seq + 1:
            raise DataError(format_error(
                f"The data has {n} tokens, fewer than one sequence needs: seq_len + 1 = "
                f"{seq + 1} (inputs plus the next-token target).",
                where=corpus.where, value=n,
                remedy=f"give at least {seq + 1} tokens of data, or lower seq_len "
                       f"to at most {n - 1}"))
        self.val_tokens = int(n * config.val_fraction)
        self.train_tokens = n - self.val_tokens
        if config.val_fraction > 0 and self.val_tokens < seq + 1:
            need = math.ceil((seq + 1) / n * 1e4) / 1e4  # rounded up: int() floors
            raise DataError(format_error(
                f"The validation split holds {self.val_tokens} of {n} tokens, fewer than one "
                f"sequence needs (seq_len + 1 = {seq + 1}).",
                where=f"{where}.val_fraction (data: {corpus.where})",
                value=config.val_fraction,
                remedy=f"raise val_fraction to at least {need:.4g}, lower seq_len, give more "
                       "data, or set val_fraction: 0 to skip validation"))
        if self.train_tokens < seq + 1:
            raise DataError(format_error(
                f"The training split holds {self.train_tokens} of {n} tokens, fewer than one "
                f"sequence needs (seq_len + 1 = {seq + 1}).",
                where=f"{where}.val_fraction (data: {corpus.where})",
                value=config.val_fraction,
                remedy="lower val_fraction, lower seq_len, or give more data"))
        self.train_windows = (self.train_tokens - 1) // seq
        self.val_windows = (self.val_tokens - 1) // seq if self.val_tokens else 0
        # Tokens a whole number of windows leaves over: an epoch's windows start at an offset
        # in [0, slack], so the window edges move from epoch to epoch.
        self._slack = self.train_tokens - 1 - self.train_windows * seq
        self._epochs: dict[int, tuple[np.ndarray, int]] = {}  # the last two epochs' orders
        self._where = where

    @property
    def fingerprint(self) -> str:
        """``sha256:`` of the corpus fingerprint and every setting batch ``k`` depends on: equal
        fingerprints give equal training batches and equal validation windows (with numpy's
        ``Generator`` drawing the same permutations: numpy keeps them stable in practice but
        does not promise it across versions, NEP 19)."""
        c = self.config
        key = {"corpus": self.corpus.fingerprint, "seq_len": c.seq_len,
               "batch_size": c.batch_size, "val_fraction": c.val_fraction, "seed": c.seed,
               "order": "shuffled-windows-v1"}
        return "sha256:" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()

    def train_batch(self, step: int, /) -> Batch:
        """Training batch ``step`` (0-based): a function of ``(config.seed, step)`` only.

        Args:
          step: the step index (the number of batches an uninterrupted run took before).

        Returns:
          ``{"inputs": int32[batch_size, seq_len], "targets": int32[batch_size, seq_len]}``;
          ``targets[:, t] == inputs[:, t + 1]`` for ``t < seq_len - 1``.

        Raises:
          DataError: ``step`` is negative.

        Example:
          >>> data = load_data(DataConfig(seq_len=8, batch_size=2, builtin_bytes=10_000))
          >>> data.train_batch(3)["inputs"].shape
          (2, 8)
        """
        if step < 0:
            raise DataError(format_error(
                "A batch index must be >= 0.", where="train_batch(step)", value=step,
                remedy="pass the step index, counted from 0"))
        size = self.config.batch_size
        samples = np.arange(step * size, (step + 1) * size, dtype=np.int64)  # [batch]
        epochs, positions = np.divmod(samples, self.train_windows)
        starts = np.empty(size, dtype=np.int64)
        for epoch in np.unique(epochs):  # a batch spans at most two epochs unless tiny
            order, offset = self._epoch(int(epoch))
            rows = epochs == epoch
            starts[rows] = offset + order[positions[rows]] * self.config.seq_len
        return self._windows(starts)

    def val_batch(self, index: int, /) -> Batch:
        """Validation batch ``index``: windows ``index * batch_size ..`` of the validation
        split, in order and wrapping around; the same on every call.

        Raises:
          DataError: the config holds out no validation data (``val_fraction`` is 0).
        """
        if not self.val_windows:
            raise DataError(format_error(
                "There is no validation split.", where=f"{self._where}.val_fraction",
                value=self.config.val_fraction,
                remedy="set val_fraction > 0 (e.g. 0.1) to evaluate"))
        size = self.config.batch_size
        windows = np.arange(index * size, (index + 1) * size, dtype=np.int64) % self.val_windows
        return self._windows(self.train_tokens + windows * self.config.seq_len)

    def val_batches(self) -> Iterator[Batch]:
        """The ``config.val_batches`` validation batches of one evaluation, in order."""
        for index in range(self.config.val_batches):
            yield self.val_batch(index)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, int]:
        """Epoch ``epoch``'s window order (a permutation) and start offset; kept for reuse."""
        if epoch not in self._epochs:
            rng = np.random.default_rng([_TRAIN_STREAM, self.config.seed, epoch])
            order = rng.permutation(self.train_windows)
            offset = int(rng.integers(0, self._slack + 1))
            if len(self._epochs) >= 2:
                del self._epochs[min(self._epochs)]
            self._epochs[epoch] = (order, offset)
        return self._epochs[epoch]

    def _windows(self, starts: np.ndarray) -> Batch:
        """The windows of ``seq_len + 1`` tokens starting at ``starts`` as a batch."""
        seq = self.config.seq_len
        index = starts[:, None] + np.arange(seq + 1)  # [batch, seq + 1]
        tokens = self.corpus.tokens[index].astype(np.int32)  # [batch, seq + 1]
        return {"inputs": np.ascontiguousarray(tokens[:, :-1]),
                "targets": np.ascontiguousarray(tokens[:, 1:])}

    def __repr__(self) -> str:
        return (f"Dataset({self.corpus.description}; train {self.train_tokens} tokens / "
                f"{self.train_windows} windows, validation {self.val_tokens} tokens / "
                f"{self.val_windows} windows, seq_len={self.config.seq_len}, "
                f"batch_size={self.config.batch_size}, seed={self.config.seed})")


@api_boundary
def load_data(config: DataConfig, /, *, vocab_size: int | None = None,
              where: str = "data") -> Dataset:
    """Reads the corpus ``config`` names and splits it into training and validation windows.

    Args:
      config: the data config.
      vocab_size: the model's vocabulary; every token id must be below it (None: unchecked).
        For a ``.bin`` file this reads the whole file once.
      where: how messages name the config (e.g. ``"train.yaml: data"``).

    Returns:
      The dataset.

    Raises:
      DataError: the file or directory is missing or empty, a file is shorter than one
        sequence + 1 token, the validation split is shorter than that, a ``.bin`` file's size
        is not a multiple of 2 bytes, or a token id is >= ``vocab_size``; each message names
        the path or field, the value and a fix.

    Example:
      >>> data = load_data(DataConfig(seq_len=16, batch_size=4), vocab_size=256)
      >>> batch = data.train_batch(0)
      >>> (batch["inputs"][:, 1:] == batch["targets"][:, :-1]).all()
      np.True_
    """
    corpus = _read(config, where)
    if vocab_size is not None:
        corpus.check_vocab(vocab_size)
    return Dataset(corpus, config, where=where)


def _read(config: DataConfig, where: str) -> Corpus:
    if config.source == "builtin":
        return read_builtin(max_bytes=config.builtin_bytes, where=f"{where}.source ('builtin')")
    assert config.path is not None  # DataConfig checks this
    if config.source == "text":
        return read_text(Path(config.path), where=f"{where}.path")
    return read_bin(Path(config.path), where=f"{where}.path")
