"""shardplan: plans and runs sharded, pipelined JAX train steps on mixed GPU clusters.

The public API is re-exported here; see ``docs/architecture.md`` for the pipeline
(trace -> cluster + cost -> solver -> plan -> runtime -> viz).
"""

from shardplan import kernels as kernels
from shardplan._version import __version__ as __version__
from shardplan.api.auto import auto as auto
from shardplan.api.wiring import apply_plan as apply_plan
from shardplan.api.wiring import check_plan as check_plan
from shardplan.api.wiring import make_plan as make_plan
from shardplan.cluster import Cluster as Cluster
from shardplan.cluster import DeviceGroup as DeviceGroup
from shardplan.cluster import DeviceSpec as DeviceSpec
from shardplan.cluster import Link as Link
from shardplan.errors import CheckpointError as CheckpointError
from shardplan.errors import ClusterError as ClusterError
from shardplan.errors import ConfigError as ConfigError
from shardplan.errors import DataError as DataError
from shardplan.errors import InfeasibleError as InfeasibleError
from shardplan.errors import PipelineError as PipelineError
from shardplan.errors import PlanMismatchError as PlanMismatchError
from shardplan.errors import RuntimeFailure as RuntimeFailure
from shardplan.errors import ShardplanError as ShardplanError
from shardplan.errors import ShardplanWarning as ShardplanWarning
from shardplan.errors import SolverError as SolverError
from shardplan.errors import TraceError as TraceError
from shardplan.plan import Plan as Plan
from shardplan.plan import load_plan as load_plan
from shardplan.plan.diff import PlanDiff as PlanDiff
from shardplan.plan.diff import diff as diff
from shardplan.planner.config import PlanConfig as PlanConfig
from shardplan.runtime.distributed import initialize_distributed as initialize_distributed
from shardplan.trace import OpGraph as OpGraph
from shardplan.trace import trace as trace
from shardplan.viz import explain as _viz_explain  # noqa: F401  (registers Plan.explain's view)
from shardplan.viz import html as _viz_html  # noqa: F401  (registers Plan.to_html's views)
from shardplan.viz import report as _viz_report  # noqa: F401  (registers Plan.report's view)
from shardplan.viz.array import visualize as visualize

__all__ = [
    "CheckpointError",
    "Cluster",
    "ClusterError",
    "ConfigError",
    "DataError",
    "DeviceGroup",
    "DeviceSpec",
    "InfeasibleError",
    "Link",
    "OpGraph",
    "PipelineError",
    "Plan",
    "PlanConfig",
    "PlanDiff",
    "PlanMismatchError",
    "RuntimeFailure",
    "ShardplanError",
    "ShardplanWarning",
    "SolverError",
    "TraceError",
    "__version__",
    "apply_plan",
    "auto",
    "check_plan",
    "diff",
    "initialize_distributed",
    "kernels",
    "load_plan",
    "make_plan",
    "trace",
    "visualize",
]
