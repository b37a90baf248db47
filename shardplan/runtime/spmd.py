"""Single-stage plans (what :func:`~shardplan.api.wiring.apply_plan` runs for one mesh): one
jitted SPMD program on the plan's mesh.

The state and batch shardings come from the plan (``NamedSharding``s on *Auto* mesh axes, so
XLA's Shardy propagates the rest); the new state keeps the old state's shardings, so nothing is
resharded between steps. Plan device ids index ``jax.devices()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan._traceback import api_boundary
from shardplan.errors import PipelineError, PlanMismatchError, format_error
from shardplan.plan import Plan
from shardplan.plan.plan import ReplicaSpec
from shardplan.runtime.constrain import constrained, parse_path, partition_spec
from shardplan.runtime.rows import stacked_mesh
from shardplan.runtime.verify import (
    MEASURE_STEPS,
    StepTimer,
    check_arguments,
    check_fits,
    compiled_figures,
    device_bytes,
)
from shardplan.solver.stages.pipeline import equal_classes

__all__ = ["REPLICA", "PlannedStep", "Step", "identical_replicas", "leaf_shardings",
           "runtime_meshes", "stage_mesh", "state_shardings"]


def stage_mesh(plan: Plan, index: int) -> jax.sharding.Mesh:
    """The mesh of ``plan.stages[index]`` over ``jax.devices()``, with *Auto* axes.

    Raises:
      PlanMismatchError: the plan names more devices than jax sees.
    """
    stage = plan.stages[index]
    devices = jax.devices()
    if max(stage.mesh.device_ids) >= len(devices):
        raise PlanMismatchError(format_error(
            "The plan uses more devices than jax sees.", where=f"plan.stages[{index}].mesh",
            value=(stage.mesh.device_ids, len(devices)),
            remedy="run on the machine the plan was made for"))
    grid = np.array([devices[i] for i in stage.mesh.device_ids]).reshape(stage.mesh.axis_sizes)
    return jax.sharding.Mesh(grid, stage.mesh.axis_names,
                             axis_types=(AxisType.Auto,) * len(stage.mesh.axis_names))


REPLICA = "replica"
"""The leading mesh axis of a merged replica's stage meshes: one entry per member replica."""


def identical_replicas(plan: Plan, replicas: Sequence[ReplicaSpec],
                       meshes: Mapping[int, jax.sharding.Mesh]) -> list[list[int]]:
    """The replicas in groups that run as one: the same microbatch count and, stage by stage,
    the same layers, remat, layout, device type and sub-mesh shape, all in one process (a
    stage runs in one process), cut to groups of one size
    (:func:`~shardplan.solver.stages.pipeline.equal_classes`: so the members' all-reduce and
    the exchange between groups take no longer than the ring the stage planner prices).
    Groups in the order of their first member."""
    def signature(r: int) -> tuple:
        spec = replicas[r]
        stages = tuple(plan.stages[s] for s in spec.stages)
        processes = {d.process_index for s in spec.stages for d in meshes[s].devices.flat}
        return (spec.microbatches, tuple(processes) if len(processes) == 1 else r,
                tuple((st.layers, st.remat, st.layout, st.device_type, st.mesh.axis_names,
                       st.mesh.axis_sizes) for st in stages))

    if REPLICA in {name for m in meshes.values() for name in m.axis_names}:
        return [[r] for r in range(len(replicas))]  # (the plan's meshes use the name: none)
    groups: dict[tuple, list[int]] = {}
    for r in range(len(replicas)):
        groups.setdefault(signature(r), []).append(r)
    return equal_classes(list(groups.values()))


def runtime_meshes(plan: Plan, /) -> tuple[dict[int, jax.sharding.Mesh], list[list[int]]]:
    """Per stage of ``plan``, the mesh its programs run on, and the replicas in groups that
    run as one (:func:`identical_replicas`): a group's stages at one position share one mesh,
    the members' sub-meshes stacked along :data:`REPLICA`
    (:func:`~shardplan.runtime.rows.stacked_mesh`)."""
    meshes = {s.index: stage_mesh(plan, s.index) for s in plan.stages}
    replicas = plan.replicas or (
        ReplicaSpec(tuple(s.index for s in plan.stages), plan.microbatches),)
    groups = identical_replicas(plan, replicas, meshes)
    for group in groups:
        if len(group) > 1:
            for i in range(len(replicas[group[0]].stages)):
                stacked = stacked_mesh([meshes[replicas[r].stages[i]] for r in group], REPLICA)
                for r in group:
                    meshes[replicas[r].stages[i]] = stacked
    return meshes, groups


def leaf_shardings(tree: Any, specs: Any, mesh: jax.sharding.Mesh, what: str) -> Any:
    """Per leaf of ``tree``, the ``NamedSharding`` of its spec in ``specs`` (by key path).

    Raises:
      PlanMismatchError: a leaf the plan has no spec for.
    """
    def one(path: Any, leaf: Any) -> NamedSharding:
        key = jax.tree_util.keystr(path, simple=True, separator="/")
        if key not in specs:
            raise PlanMismatchError(format_error(
                f"The {what} has a leaf the plan does not know.", where=key,
                value=getattr(leaf, "shape", None),
                remedy="make the plan for this state and batch"))
        return NamedSharding(mesh, partition_spec(specs[key]))
    return jax.tree_util.tree_map_with_path(one, tree)


def _placed(tree: Any, shardings: Any, *, donated: bool = False) -> Any:
    """``tree`` on ``shardings``; as it is when every leaf already is (the common case from the
    second step on: ``device_put`` of a placed pytree still costs ~70 µs per leaf).

    With ``donated``, a leaf that has to move is copied first: ``device_put`` may hand the
    caller's own buffer on as one shard of the result (one device to a replicated sharding, in
    jax 0.10), and the donating call would then consume the caller's array.
    """
    leaves = jax.tree.leaves(tree)
    targets = jax.tree.leaves(shardings)
    if len(leaves) == len(targets) and all(
            isinstance(x, jax.Array) and x.sharding == s for x, s in zip(leaves, targets,
                                                                        strict=True)):
        return tree
    if donated:
        tree = jax.tree.map(
            lambda x, s: jnp.array(x, copy=True)
            if isinstance(x, jax.Array) and x.sharding != s else x, tree, shardings)
    return jax.device_put(tree, shardings)


class Step(Protocol):
    """What :func:`~shardplan.api.wiring.apply_plan` returns for every plan kind (:class:`PlannedStep` for one mesh,
    :class:`~shardplan.runtime.pipeline.PipelinedStep` for stages or microbatches)."""

    plan: Plan
    """The plan, with XLA's figures (``compiled``) once run and the measured step time
    (``measured``) after the timed steps."""

    meshes: Any
    """``{stage index: jax.sharding.Mesh}``: where each stage runs."""

    def __call__(self, state: Any, batch: Any, /) -> Any:
        """One step: ``(state, batch) -> (state, metrics)``, as the original step."""

    def evaluator(self, fn: Callable[[Any, Any], Any], /) -> Callable[[Any, Any], Any]:
        """``fn(state, batch) -> metrics`` (a forward pass) run on the plan's devices."""


class PlannedStep:
    """A train step bound to a plan: call it like the original step."""

    def __init__(self, train_step: Callable[..., Any], plan: Plan, *, verify: bool = True,
                 measure_steps: int = MEASURE_STEPS) -> None:
        if len(plan.stages) != 1:
            raise PipelineError(format_error(
                "Only single-stage plans run here so far.", where="plan.stages",
                value=len(plan.stages), remedy="use a single-mesh plan"))
        self._step = train_step
        self.plan = plan
        """The plan; once run, with XLA's figures (``compiled``) and, after the timed steps,
        the measured step time (``measured``): ``step.plan.report()`` shows them."""
        self.mesh = stage_mesh(plan, 0)
        self.meshes = {0: self.mesh}
        self._verify = verify
        self._timer = StepTimer(measure_steps)
        self._jitted: Any = None
        self._shardings: Any = None

    def _shardings_for(self, state: Any, batch: Any) -> tuple[Any, Any, Any]:
        param_specs = {k: spec for k, (_, spec) in self.plan.param_specs.items()}
        state_sh = leaf_shardings(state, param_specs, self.mesh, "state")
        batch_sh = leaf_shardings(batch, self.plan.batch_specs, self.mesh, "batch")
        out = jax.eval_shape(self._step, state, batch)
        metrics_sh = jax.tree.map(lambda _: NamedSharding(self.mesh, P()), out[1])
        return state_sh, batch_sh, (state_sh, metrics_sh)

    def _ensure(self, state: Any, batch: Any) -> None:
        if self._jitted is None:
            check_arguments(self.plan, state, batch)
            state_sh, batch_sh, out_sh = self._shardings_for(state, batch)
            self._shardings = (state_sh, batch_sh)
            step = self._step
            if self.plan.constraints:
                table = {parse_path(k): (results, operands)
                         for k, (_, results, operands) in self.plan.constraints.items()}
                step = constrained(self._step, (state, batch), table, self.mesh)
            # The state is donated: the new state reuses its buffers (the planner's memory
            # prediction counts it so), as a training loop replaces its state every step.
            self._jitted = jax.jit(step, in_shardings=(state_sh, batch_sh),
                                   out_shardings=out_sh, donate_argnums=(0,))

    @api_boundary
    def __call__(self, state: Any, batch: Any) -> Any:
        first = self._jitted is None
        self._ensure(state, batch)
        state_sh, batch_sh = self._shardings
        state = _placed(state, state_sh, donated=True)
        batch = _placed(batch, batch_sh)
        if first and self._verify:
            # Compiling the placed arguments fills jit's cache: the call below runs this
            # executable (compile count tested).
            figures = compiled_figures([(0, "step", self._jitted.lower(state, batch).compile())])
            check_fits(self.plan, figures)
            self.plan = dataclasses.replace(self.plan, compiled=figures)
        out, done = self._timer.run(lambda: self._jitted(state, batch))
        if done:
            measured = self._timer.measured()
            measured["stage_time_s"] = {"0": measured["step_time_s"]}
            measured.update(device_bytes(self.plan.stages[0].mesh.device_ids))
            self.plan = dataclasses.replace(self.plan, measured=measured)
        return out

    def evaluator(self, fn: Callable[[Any, Any], Any], /) -> Callable[[Any, Any], Any]:
        """``fn(state, batch) -> metrics`` (a forward pass: an evaluation loss) run on this
        plan's mesh: one jitted program reading the state where this step keeps it, the
        batch placed in the plan's batch layout (XLA propagates the plan's shardings from the
        arguments; nothing is gathered onto one device)."""
        jitted = jax.jit(fn)

        def evaluate(state: Any, batch: Any) -> Any:
            return jitted(state, _placed(batch, leaf_shardings(batch, self.plan.batch_specs,
                                                               self.mesh, "batch")))

        return evaluate

    def compiled(self, state: Any, batch: Any) -> tuple[jax.stages.Compiled, ...]:
        """The XLA executables this step runs (one per program)."""
        self._ensure(state, batch)
        return (self._jitted.lower(state, batch).compile(),)


def state_shardings(plan: Plan, state: Any, /) -> Any:
    """Per state leaf, where ``plan`` holds it between steps: the ``NamedSharding`` of its spec
    on the mesh of its stage (``plan.param_specs``; in a pipelined plan, the first stage of
    replica 0 that holds it, so leaves sit on different sub-meshes; where replica 0 runs
    merged with identical replicas, the stage's mesh over all of them, :func:`runtime_meshes`,
    so that each holds its copy).

    A restored checkpoint placed so starts the planned step without moving anything (a
    pipelined step fetches each leaf from there to every other stage that reads it).

    Raises:
      PlanMismatchError: a leaf the plan has no spec for.
    """
    meshes, _ = runtime_meshes(plan)

    def one(path: Any, leaf: Any) -> NamedSharding:
        key = jax.tree_util.keystr(path, simple=True, separator="/")
        if key not in plan.param_specs:
            raise PlanMismatchError(format_error(
                "The state has a leaf the plan does not know.", where=key,
                value=getattr(leaf, "shape", None),
                remedy="make the plan for this state and batch"))
        stage, spec = plan.param_specs[key]
        return NamedSharding(meshes[stage], partition_spec(spec))

    return jax.tree_util.tree_map_with_path(one, state)
