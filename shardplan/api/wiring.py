"""The public entry points that join the planner and the runtime: :func:`make_plan` (the
planner, with the runtime's compiled-memory measurement passed in), :func:`check_plan` (a plan
against the step it is applied to, fingerprinted as the planner does) and :func:`apply_plan`
(the SPMD or the MPMD runtime by the plan's kind, both a :class:`~shardplan.runtime.spmd.Step`).
This package sits above ``planner/`` and ``runtime/``, so neither imports the other through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardplan._traceback import api_boundary
from shardplan.cluster import Cluster
from shardplan.errors import ConfigError, format_error
from shardplan.plan import Plan
from shardplan.plan.match import check_plan_matches
from shardplan.plan.stamp import cluster_info
from shardplan.planner.config import PlanConfig
from shardplan.planner.single import (
    FINGERPRINT_SAMPLES,
    check_api_arguments,
    plan_step,
    step_fingerprint,
)
from shardplan.runtime.pipeline import PipelinedStep
from shardplan.runtime.spmd import PlannedStep, Step
from shardplan.runtime.verify import MEASURE_STEPS, compiled_peak
from shardplan.trace.args import arg_types

__all__ = ["apply_plan", "check_plan", "make_plan"]


@api_boundary  # outermost: no shardplan frame above JAX's traceback filter
def make_plan(train_step: Callable[..., Any], state: Any, batch: Any, /, *, cluster: Cluster,
              config: PlanConfig | None = None,
              annotations: Mapping[str, Sequence[Any]] | None = None) -> Plan:
    """Plans ``train_step(state, batch)`` on ``cluster`` without running it.

    On a cluster of one device type (and ``PlanConfig.pipeline`` not ``True``): one mesh over
    all its devices, every op's sharding chosen by the intra-op ILP. With several device types
    (or ``pipeline=True``): a multi-stage plan from the stage planner
    (:func:`shardplan.planner.multi.make_pipeline_plan`): data-parallel replicas of pipeline
    stages, each stage on a sub-mesh of one device type, with microbatches, schedule and remat.

    Args:
      train_step: ``(state, batch) -> (state, metrics)``.
      state: the state pytree (arrays or ``ShapeDtypeStruct``s).
      batch: the batch pytree (every leaf's leading axis is the samples).
      cluster: the cluster.
      config: planning options.
      annotations: with ``PlanConfig.respect_annotations``, the user's shardings
        ``{state key path: spec}`` (a spec: per dimension None, a mesh axis name or a tuple
        of them, like a ``PartitionSpec``); None: read off ``state``
        (:func:`shardplan.planner.annotations.read_annotations` with
        ``PlanConfig.axis_rules``), which needs ``state`` to hold the annotated variables.

    Returns:
      The :class:`~shardplan.plan.Plan`.

    Raises:
      InfeasibleError: no plan fits the devices' memory (the message gives the per-device
        lower bound and, per device type, the fewest devices that would hold the model; on
        one mesh, the batch sizes data parallelism can split where the batch is the cause).
      PipelineError: ``pipeline=False`` on a cluster with several device types.
      TraceError: a leaf of ``state`` or ``batch`` is not an array (named by key path,
        ``state/...``), or (``PlanConfig.strict``) the step uses a primitive without a rule.

    Warns:
      ShardplanWarning: a solver stopped at its time or work limit (the plan is the best
        found; the message gives the gap), or primitives without a rule planned replicated
        (``strict=False``).

    Errors raised here hide shardplan's frames from the traceback
    (``JAX_TRACEBACK_FILTERING=off`` shows them; :mod:`shardplan._traceback`).
      ConfigError: an annotation does not fit its leaf or the devices (it names the key
        path), or annotations on a multi-stage plan.
    """
    return plan_step(train_step, state, batch, cluster=cluster, config=config,
                     annotations=annotations, compiled_peak=compiled_peak)


def check_plan(train_step: Callable[..., Any], plan: Plan, state: Any, batch: Any, /, *,
               cluster: Cluster | None = None) -> None:
    """Checks that ``plan`` was made for ``train_step`` on these arguments (and ``cluster``).

    Traces the step (abstractly; ``state`` and ``batch`` may be ``ShapeDtypeStruct``s) as the
    planner did (a multi-stage plan's at the batch size its layer tables were traced at,
    ``plan.solver["fingerprint_samples"]``) and compares the argument types, the op graph's
    fingerprint (:func:`~shardplan.planner.single.graph_fingerprint`) and layers, and the
    cluster's hash with what the plan records.

    The arguments come in :func:`apply_plan`'s order: the step, then its plan.

    Raises:
      PlanMismatchError: naming every difference found: a state or batch leaf of another shape
        or dtype, added or missing; a stage layer the step does not have, or a step layer no
        stage runs; another program; a cluster with other devices.
      ConfigError: ``plan`` is not a :class:`~shardplan.plan.Plan` (or the two are swapped).

    Example:
      >>> import jax, jax.numpy as jnp, shardplan as sp
      >>> step = lambda w, x: (w - 0.1 * jnp.mean(x @ w) * w, jnp.mean(x @ w))
      >>> cluster = sp.Cluster.local(devices=jax.devices()[:1])
      >>> w, x = jnp.zeros((4, 4)), jnp.ones((2, 4))
      >>> plan = sp.make_plan(step, w, x, cluster=cluster)
      >>> sp.check_plan(step, plan, w, x, cluster=cluster)  # the same: nothing raised
    """
    _check_step_and_plan("check_plan", train_step, plan)
    check_api_arguments("check_plan", cluster=cluster, cluster_required=False)
    samples: Any = plan.solver.get(FINGERPRINT_SAMPLES)
    fingerprint, graph = step_fingerprint(train_step, state, batch,
                                          samples=samples if isinstance(samples, int) else None)
    check_plan_matches(
        plan, state_types=arg_types(state), batch_types=arg_types(batch),
        graph_fingerprint=fingerprint, layer_names=[layer.name for layer in graph.layers],
        cluster_hash=cluster.content_hash() if cluster is not None else None,
        cluster_info=cluster_info(cluster) if cluster is not None else None)


@api_boundary
def apply_plan(train_step: Callable[..., Any], plan: Plan, /, *, verify: bool = True,
               measure_steps: int = MEASURE_STEPS) -> Step:
    """Binds ``train_step`` to ``plan``; the result has ``train_step``'s signature (a
    :class:`Step`: :class:`PlannedStep` for a one-mesh plan, ``PipelinedStep`` otherwise).

    The state argument is donated, as in any training loop (``state = step(state, batch)``):
    the new state reuses its buffers, so a state already placed as the plan says cannot be
    read after the call (one that is placed by the call, e.g. a fresh one, is copied first).

    Args:
      train_step: ``(state, batch) -> (state, metrics)``.
      plan: the plan (from :func:`~shardplan.make_plan` or a plan file).
      verify: before the first step, compile the plan's programs, record XLA's memory, FLOPs
        and collectives in ``step.plan.compiled`` and refuse a plan whose compiled memory
        exceeds its devices (:func:`~shardplan.runtime.verify.check_fits`).
      measure_steps: time this many steps after the first and record the median in
        ``step.plan.measured`` (0: none). Timed steps wait for their results, so they do not
        overlap the next step's dispatch.

    Raises:
      PlanMismatchError: at the first call, arguments of other shapes or dtypes than the plan
        was made for (naming the leaves).
      InfeasibleError: at the first call, a compiled program that does not fit its device.
      ConfigError: ``plan`` is not a :class:`~shardplan.plan.Plan` (or the two are swapped).
    """
    _check_step_and_plan("apply_plan", train_step, plan)
    # (a stage planner's plan keeps its shardings in its stages' layouts: the pipeline
    # runtime reads them, also for one stage and one microbatch)
    if len(plan.stages) > 1 or plan.microbatches > 1 or plan.layouts:
        return PipelinedStep(train_step, plan, verify=verify, measure_steps=measure_steps)
    return PlannedStep(train_step, plan, verify=verify, measure_steps=measure_steps)


def _check_step_and_plan(caller: str, train_step: object, plan: object) -> None:
    """Raises a ConfigError unless ``caller`` was given a callable step, then a Plan.

    Example:
        >>> try:
        ...     _check_step_and_plan("apply_plan", print, "plan.json")
        ... except ConfigError as err:
        ...     print(str(err).splitlines()[0])
        apply_plan(plan=) must be an sp.Plan.
    """
    if isinstance(train_step, Plan) and callable(plan):
        raise ConfigError(format_error(
            f"{caller}(train_step, plan, ...) takes the step first, then its plan.",
            where=f"{caller}(train_step, plan)", value=f"a Plan, then {type(plan).__name__}",
            remedy=f"call {caller}(train_step, plan, ...)"))
    if not isinstance(plan, Plan):
        raise ConfigError(format_error(
            f"{caller}(plan=) must be an sp.Plan.", where=f"{caller}(train_step, plan)",
            value=type(plan).__name__,
            remedy="pass the Plan sp.make_plan returned, or sp.load_plan(path) of a plan file"))
    if not callable(train_step):
        raise ConfigError(format_error(
            f"{caller}(train_step=) must be a function (state, batch) -> (state, metrics).",
            where=f"{caller}(train_step, plan)", value=type(train_step).__name__,
            remedy="pass the train step the plan was made for"))
