"""Pallas kernels for the hot paths, with the sharding rules a planner needs to place them
(:mod:`shardplan.kernels.registry`)."""

from shardplan.kernels.flash_attention import flash_attention as flash_attention
from shardplan.kernels.flash_attention import flash_attention_reference as flash_attention_reference
from shardplan.kernels.grouped_matmul import grouped_matmul as grouped_matmul

__all__ = [
    "flash_attention",
    "flash_attention_reference",
    "grouped_matmul",
]
