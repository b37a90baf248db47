"""Reading compiled XLA programs: HLO text, collectives, flops, memory, shardings."""

from shardplan.xla.collectives import COLLECTIVE_KINDS as COLLECTIVE_KINDS
from shardplan.xla.collectives import Collective as Collective
from shardplan.xla.collectives import Collectives as Collectives
from shardplan.xla.collectives import find_collectives as find_collectives
from shardplan.xla.flops import hlo_flops as hlo_flops
from shardplan.xla.hlo import CallSite as CallSite
from shardplan.xla.hlo import Computation as Computation
from shardplan.xla.hlo import HloModule as HloModule
from shardplan.xla.hlo import Instruction as Instruction
from shardplan.xla.hlo import Loop as Loop
from shardplan.xla.hlo import parse_hlo as parse_hlo
from shardplan.xla.hlo import parse_hlo_module as parse_hlo_module
from shardplan.xla.replica_groups import parse_replica_groups as parse_replica_groups
from shardplan.xla.replica_groups import parse_source_target_pairs as parse_source_target_pairs
from shardplan.xla.report import CompiledReport as CompiledReport
from shardplan.xla.report import HloReport as HloReport
from shardplan.xla.report import MemoryReport as MemoryReport
from shardplan.xla.report import read_compiled as read_compiled
from shardplan.xla.report import read_hlo_text as read_hlo_text
from shardplan.xla.shapes import ArrayShape as ArrayShape
from shardplan.xla.shapes import Shape as Shape
from shardplan.xla.shapes import TupleShape as TupleShape
from shardplan.xla.shapes import parse_shape as parse_shape

__all__ = [
    "COLLECTIVE_KINDS",
    "ArrayShape",
    "CallSite",
    "Collective",
    "Collectives",
    "CompiledReport",
    "Computation",
    "HloModule",
    "HloReport",
    "Instruction",
    "Loop",
    "MemoryReport",
    "Shape",
    "TupleShape",
    "find_collectives",
    "hlo_flops",
    "parse_hlo",
    "parse_hlo_module",
    "parse_replica_groups",
    "parse_shape",
    "parse_source_target_pairs",
    "read_compiled",
    "read_hlo_text",
]
