"""The plan artifact: frozen, jax-free, JSON-serialisable, versioned, content-hashed.

``docs/plan-format.md`` describes the JSON layout field by field.
"""

from shardplan.plan.io import load_plan as load_plan
from shardplan.plan.plan import SCHEMA_VERSION as SCHEMA_VERSION
from shardplan.plan.plan import MeshSpec as MeshSpec
from shardplan.plan.plan import Plan as Plan
from shardplan.plan.plan import Predicted as Predicted
from shardplan.plan.plan import Stage as Stage
from shardplan.plan.timeline import TimelineEvent as TimelineEvent
from shardplan.plan.timeline import timeline_events as timeline_events

__all__ = ["SCHEMA_VERSION", "MeshSpec", "Plan", "Predicted", "Stage", "TimelineEvent",
           "load_plan", "timeline_events"]
