"""The solver stage: cost tables in, sharding decisions out. Imports nothing from jax.

``solve(problem)`` is the intra-op ILP (OR-Tools CP-SAT); ``evaluate(problem, assignment)`` is
its independent checker. Problems and solutions are plain frozen data that dump to JSON.
"""

from shardplan.solver.evaluate import CostBreakdown as CostBreakdown
from shardplan.solver.evaluate import Evaluation as Evaluation
from shardplan.solver.evaluate import Violation as Violation
from shardplan.solver.evaluate import ViolationKind as ViolationKind
from shardplan.solver.evaluate import evaluate as evaluate
from shardplan.solver.ilp import SALTIPLIER as SALTIPLIER
from shardplan.solver.ilp import solve as solve
from shardplan.solver.problem import SCHEMA_VERSION as SCHEMA_VERSION
from shardplan.solver.problem import Alias as Alias
from shardplan.solver.problem import Edge as Edge
from shardplan.solver.problem import Follower as Follower
from shardplan.solver.problem import MemoryCut as MemoryCut
from shardplan.solver.problem import MemoryMode as MemoryMode
from shardplan.solver.problem import Node as Node
from shardplan.solver.problem import Problem as Problem
from shardplan.solver.problem import Solution as Solution
from shardplan.solver.problem import SolutionStatus as SolutionStatus

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
