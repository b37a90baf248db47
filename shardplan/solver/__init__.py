"""The solver stage: cost tables in, sharding decisions out. Imports nothing from jax.

``solve(problem)`` is the intra-op ILP (OR-Tools CP-SAT); ``evaluate(problem, assignment)`` is
its independent checker. Problems and solutions are plain frozen data that dump to JSON.
"""

from shardplan.solver.intraop.evaluate import CostBreakdown as CostBreakdown
from shardplan.solver.intraop.evaluate import Evaluation as Evaluation
from shardplan.solver.intraop.evaluate import Violation as Violation
from shardplan.solver.intraop.evaluate import ViolationKind as ViolationKind
from shardplan.solver.intraop.evaluate import evaluate as evaluate
from shardplan.solver.intraop.ilp import SALTIPLIER as SALTIPLIER
from shardplan.solver.intraop.ilp import solve as solve
from shardplan.solver.intraop.problem import SCHEMA_VERSION as SCHEMA_VERSION
from shardplan.solver.intraop.problem import Alias as Alias
from shardplan.solver.intraop.problem import Edge as Edge
from shardplan.solver.intraop.problem import Follower as Follower
from shardplan.solver.intraop.problem import MemoryCut as MemoryCut
from shardplan.solver.intraop.problem import MemoryMode as MemoryMode
from shardplan.solver.intraop.problem import Node as Node
from shardplan.solver.intraop.problem import Problem as Problem
from shardplan.solver.intraop.problem import Solution as Solution
from shardplan.solver.intraop.problem import SolutionStatus as SolutionStatus

__all__ = [
    "SALTIPLIER",
    "SCHEMA_VERSION",
    "Alias",
    "CostBreakdown",
    "Edge",
    "Evaluation",
    "Follower",
    "MemoryCut",
    "MemoryMode",
    "Node",
    "Problem",
    "Solution",
    "SolutionStatus",
    "Violation",
    "ViolationKind",
    "evaluate",
    "solve",
]
