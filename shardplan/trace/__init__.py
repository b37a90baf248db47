"""Trace stage: a function and example arguments -> :class:`OpGraph`."""

from shardplan.trace.api import trace as trace
from shardplan.trace.graph import Layer as Layer
from shardplan.trace.graph import Op as Op
from shardplan.trace.graph import OpGraph as OpGraph
from shardplan.trace.graph import Parameter as Parameter
from shardplan.trace.graph import Tensor as Tensor

__all__ = ["Layer", "Op", "OpGraph", "Parameter", "Tensor", "trace"]
