"""Training data that needs no download: corpora, the train/validation split, and batches.

``load_data(DataConfig(...), vocab_size=...)`` reads the built-in corpus (the Python standard
library's sources), a text file or directory, or a pre-tokenised ``uint16`` ``.bin`` file, and
serves batches ``{"inputs", "targets"}`` where batch ``k`` is a function of ``(seed, k)`` alone.
"""

from shardplan.data.config import DEFAULT_BUILTIN_BYTES as DEFAULT_BUILTIN_BYTES
from shardplan.data.config import SOURCES as SOURCES
from shardplan.data.config import DataConfig as DataConfig
from shardplan.data.corpus import BYTE_VOCAB_SIZE as BYTE_VOCAB_SIZE
from shardplan.data.corpus import Corpus as Corpus
from shardplan.data.corpus import read_bin as read_bin
from shardplan.data.corpus import read_builtin as read_builtin
from shardplan.data.corpus import read_text as read_text
from shardplan.data.dataset import Batch as Batch
from shardplan.data.dataset import Dataset as Dataset
from shardplan.data.dataset import load_data as load_data
from shardplan.data.place import abstract_batch as abstract_batch
from shardplan.data.place import place_batch as place_batch

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DEFAULT_BUILTIN_BYTES",
    "SOURCES",
    "Batch",
    "Corpus",
    "DataConfig",
    "Dataset",
    "abstract_batch",
    "load_data",
    "place_batch",
    "read_bin",
    "read_builtin",
    "read_text",
]
