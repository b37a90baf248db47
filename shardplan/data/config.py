"""``DataConfig``: where the training tokens come from and how they are cut into batches.

A frozen dataclass, checked when it is built: a bad value is a
:class:`~shardplan.errors.ConfigError` naming the field, the value and what to give instead.
:meth:`DataConfig.from_dict` builds one from a mapping (a YAML file's ``data:`` section) and
rejects unknown keys with a did-you-mean.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from shardplan._schema import (
    check_choice,
    invalid,
    is_int,
    is_number,
    options_from_mapping,
    reject_unknown_kwargs,
    require,
)

__all__ = ["DEFAULT_BUILTIN_BYTES", "SOURCES", "DataConfig", "Source"]

Source = Literal["builtin", "text", "bin"]

SOURCES: tuple[str, ...] = ("builtin", "text", "bin")
"""``builtin``: the Python installation's standard library sources (no download);
``text``: a UTF-8 text file or a directory of ``.txt`` files, tokenised at byte level;
``bin``: a pre-tokenised ``uint16`` token file (nanoGPT's ``train.bin`` format)."""

DEFAULT_BUILTIN_BYTES: int = 4 * 2**20
"""How much of the standard library the built-in corpus reads: 4 MiB, 4,194,304 byte tokens.
CPython ships about twice that outside the excluded directories (measured: 8.3 MB in 3.10.13,
8.6 MB in 3.11.7 and in Debian's 3.11.2, 8.6 MB in 3.12.1, 8.9 MB in 3.13.0), so the budget, not
the installation, sets the corpus size."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to train on and how to cut it into batches.

    Attributes:
      source: ``"builtin"``, ``"text"`` or ``"bin"`` (see :data:`SOURCES`).
      path: the text file, directory of ``.txt`` files, or ``.bin`` file; None for
        ``builtin``, which reads no path.
      seq_len: tokens per sequence (at most the model's ``max_seq_len``).
      batch_size: sequences per (global) batch.
      val_fraction: the fraction of the tokens, taken from the end, held out for validation;
        0 holds out nothing.
      seed: seed of the window shuffling; batch ``k`` is a function of ``(seed, k)`` alone.
      val_batches: batches per evaluation (a fixed set: every evaluation sees the same tokens).
      builtin_bytes: bytes of standard-library source the ``builtin`` corpus reads.

    Example:
      >>> DataConfig(seq_len=32, batch_size=8).source
      'builtin'
      >>> DataConfig.from_dict({"source": "text", "path": "corpus.txt"}).path
      'corpus.txt'
    """

    source: Source = "builtin"
    path: str | None = None
    seq_len: int = 32
    batch_size: int = 8
    val_fraction: float = 0.1
    seed: int = 0
    val_batches: int = 8
    builtin_bytes: int = DEFAULT_BUILTIN_BYTES

    def __new__(cls, *args: Any, **kwargs: Any) -> DataConfig:
        reject_unknown_kwargs(cls, kwargs)  # dataclass's __init__: a bare TypeError
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _check(dataclasses.asdict(self), "DataConfig")
        # 0 and 0.0 from YAML are one setting: one spelling keeps fingerprints equal.
        object.__setattr__(self, "val_fraction", float(self.val_fraction))

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], /, *, where: str = "data") -> DataConfig:
        """A config from a mapping of field names to values, e.g. a YAML file's ``data:``.

        Args:
          mapping: field name -> value; missing fields keep their defaults.
          where: how messages name the mapping (e.g. ``"train.yaml: data"``).

        Returns:
          The config.

        Raises:
          ConfigError: ``mapping`` is not a mapping, has an unknown key (with a did-you-mean),
            or a value is of the wrong type or out of range (naming ``where.key``).

        Example:
          >>> DataConfig.from_dict({"seq_len": 16, "val_fraction": 0.05}).seq_len
          16
        """
        given = options_from_mapping(cls, mapping, where=where, noun="data config", typed=False)
        values = {f.name: f.default for f in dataclasses.fields(cls)} | given
        _check(values, where)
        return cls(**given)


def _check(values: Mapping[str, Any], where: str) -> None:
    """Raises a ConfigError naming ``where.field`` for the first bad value in ``values``."""
    source = values["source"]
    check_choice(source, SOURCES, where=f"{where}.source", what="data source", label="sources",
                 match=str)
    path = values["path"]
    checks = [
        ("path", path is None or isinstance(path, str), "a file path (a string) or null"),
        ("seq_len", is_int(values["seq_len"]) and values["seq_len"] >= 1, "an integer >= 1"),
        ("batch_size", is_int(values["batch_size"]) and values["batch_size"] >= 1,
         "an integer >= 1"),
        ("val_fraction", is_number(values["val_fraction"])
         and 0.0 <= values["val_fraction"] < 1.0, "a fraction in [0, 1)"),
        ("seed", is_int(values["seed"]) and values["seed"] >= 0, "an integer >= 0"),
        ("val_batches", is_int(values["val_batches"]) and values["val_batches"] >= 1,
         "an integer >= 1"),
        ("builtin_bytes", is_int(values["builtin_bytes"]) and values["builtin_bytes"] >= 1,
         "an integer >= 1"),
    ]
    for name, ok, want in checks:
        require(ok, f"{where}.{name}", values[name], want, subject=f"DataConfig.{name}")
    if source == "builtin" and path is not None:
        raise invalid(
            "The builtin corpus reads no path.", where=f"{where}.path", value=path,
            remedy="remove path, or set source: text (a .txt file or directory) or "
                   "source: bin (a uint16 token file)")
    if source != "builtin" and not path:
        raise invalid(
            f"Data source {source!r} needs a path.", where=f"{where}.path", value=path,
            remedy="give the file (or, for text, a directory of .txt files) to read, or "
                   "use source: builtin")
