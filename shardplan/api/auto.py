"""``sp.auto``: plan a train step on its first call per input signature, cache, and run it.

The signature of a call is the pytree structure of ``(state, batch)`` and, per leaf, its shape,
dtype and weak type (what ``jax.jit`` keys its own cache on, minus shardings: the planned step
places its inputs itself). The first call with a new signature plans with
:func:`~shardplan.api.wiring.make_plan` on ``jax.ShapeDtypeStruct`` stand-ins of the
arguments (planning never sees the real arrays), binds the plan with
:func:`~shardplan.api.wiring.apply_plan` and keeps the bound step; later calls with that
signature go straight to it, so nothing is planned or traced again.

Plans are also kept on disk, one JSON file per (graph fingerprint, cluster hash, config hash,
shardplan version): a new process, or a new ``sp.auto`` of the same step, traces the step to
fingerprint it and loads the plan instead of planning (solving is what takes the time). The
directory is ``cache_dir=``, else ``$SHARDPLAN_CACHE_DIR``, else
``$XDG_CACHE_HOME/shardplan/plans`` (``~/.cache/shardplan/plans``). A cached file that is
unreadable or belongs to something else is planned again and overwritten, with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, overload

import jax

from shardplan._version import __version__
from shardplan.api.wiring import apply_plan, make_plan
from shardplan.cluster import Cluster
from shardplan.errors import (
    ConfigError,
    PlanMismatchError,
    ShardplanError,
    ShardplanWarning,
    format_error,
)
from shardplan.plan import Plan, load_plan
from shardplan.planner.annotations import read_annotations
from shardplan.planner.single import (
    FINGERPRINT_SAMPLES,
    PlanConfig,
    check_api_arguments,
    graph_fingerprint,
    step_fingerprint,
)
from shardplan.runtime.spmd import Step
from shardplan.trace import trace

__all__ = ["AutoStep", "Signature", "auto", "default_cache_dir", "signature"]

LeafType = tuple[tuple[int, ...], Any, bool]
"""``(shape, dtype, weak_type)`` of one argument leaf."""

Signature = tuple[Any, tuple[LeafType, ...]]
"""``(treedef of (state, batch), leaf types in flattening order)``: the cache key."""

_CALL_FORM = "step(state, batch)"


def signature(state: Any, batch: Any, /) -> Signature:
    """The cache key of a call: tree structure plus shape, dtype and weak type of every leaf.

    Args:
      state: the state pytree (arrays, scalars or ``jax.ShapeDtypeStruct``s).
      batch: the batch pytree.

    Returns:
      A hashable :data:`Signature`.

    Raises:
      ConfigError: a leaf is not an array (a string, an arbitrary object) or is a tracer.

    Example:
      >>> import jax.numpy as jnp
      >>> signature({"w": jnp.zeros((2, 3))}, 1.0)[1]
      (((2, 3), dtype('float32'), False), ((), dtype('float32'), True))
    """
    # Runs on every call: flatten without key paths, and build paths only to report an error.
    leaves, treedef = jax.tree_util.tree_flatten((state, batch))
    types = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            # 10x faster than typeof; a PRNG key array has no weak_type (keys are never weak)
            types.append((leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False)))
        else:
            types.append(_leaf_type(i, leaf, (state, batch)))
    return treedef, tuple(types)


def _leaf_type(index: int, leaf: Any, args: tuple[Any, Any]) -> LeafType:
    """The type of a leaf that is not a concrete ``jax.Array``, or a ConfigError naming it."""
    if isinstance(leaf, jax.core.Tracer):
        path = jax.tree_util.tree_flatten_with_path(args)[0][index][0]
        raise ConfigError(format_error(
            "sp.auto got a traced value: it plans and runs the step itself, so it cannot be "
            "called inside jax.jit / vmap / grad.",
            where=_where(path), value=leaf,
            remedy="call the sp.auto step from plain Python, outside any jax transformation"))
    try:
        aval = jax.typeof(leaf)  # canonical dtype (float64 -> float32 without x64), weak type
    except TypeError:
        path = jax.tree_util.tree_flatten_with_path(args)[0][index][0]
        raise ConfigError(format_error(
            "Every leaf of (state, batch) must be an array or a scalar.",
            where=_where(path), value=type(leaf).__name__,
            remedy="make it static (close over it in the step) or convert it with jnp.asarray"),
        ) from None
    return tuple(aval.shape), aval.dtype, bool(aval.weak_type)


def _where(path: Any) -> str:
    """``state/0/kernel`` or ``batch/inputs`` for a path into the ``(state, batch)`` tuple."""
    key = jax.tree_util.keystr(path, simple=True, separator="/")
    head, _, rest = key.partition("/")
    name = {"0": "state", "1": "batch"}.get(head, head)
    return f"{name}/{rest}" if rest else name


def _abstract(sig: Signature) -> tuple[Any, Any]:
    treedef, types = sig
    leaves = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in types]
    state, batch = jax.tree_util.tree_unflatten(treedef, leaves)
    return state, batch


def default_cache_dir() -> Path:
    """Where :func:`auto` keeps plans: ``$SHARDPLAN_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/shardplan/plans``, else ``~/.cache/shardplan/plans``."""
    if os.environ.get("SHARDPLAN_CACHE_DIR"):
        return Path(os.environ["SHARDPLAN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shardplan" / "plans"


class AutoStep:
    """A train step that plans itself on its first call per input signature (see :func:`auto`).

    Attributes:
      cluster: the cluster plans are made for (None until the first plan when
        :func:`auto` got ``cluster=None``; then the devices jax sees).
      config: the planning options (None: :class:`~shardplan.planner.single.PlanConfig`
        defaults).
      cache_dir: the directory plan files are kept in (None: not kept on disk).
      sources: per signature planned, where its plan came from: ``"planned"`` or ``"disk"``.
    """

    __wrapped__: Callable[..., Any]

    def __init__(self, fn: Callable[..., Any], /, *, cluster: Cluster | None,
                 config: PlanConfig | None, cache_dir: Path | None) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.cluster = cluster
        self.config = config
        self.cache_dir = cache_dir
        self.sources: dict[Signature, str] = {}
        self._steps: dict[Signature, Step] = {}
        self._lock = threading.Lock()  # two threads must not plan the same signature twice

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state, batch = self._split_args(args, kwargs)
        sig = signature(state, batch)
        step = self._steps.get(sig)
        if step is None:
            step = self._planned(sig, state)
        return step(state, batch)

    def plan_for(self, state: Any, batch: Any, /) -> Plan:
        """The plan calls with these arguments run (planned and cached now if needed).

        Args:
          state: the state pytree (arrays or ``jax.ShapeDtypeStruct``s).
          batch: the batch pytree.

        Returns:
          The cached :class:`~shardplan.plan.Plan` for the arguments' signature.
        """
        return self._planned(signature(state, batch), state).plan

    @property
    def plans(self) -> tuple[Plan, ...]:
        """The cached plans, one per input signature seen, in the order they were made."""
        return tuple(step.plan for step in self._steps.values())

    def cache_clear(self) -> None:
        """Forgets every plan and compiled step held in memory (plan files stay on disk); the
        next call with a signature loads its plan from disk or plans again."""
        with self._lock:
            self._steps.clear()
            self.sources.clear()

    def _planned(self, sig: Signature, state: Any) -> Step:
        with self._lock:
            step = self._steps.get(sig)
            if step is None:
                if self.cluster is None:
                    self.cluster = Cluster.local()
                config = self.config or PlanConfig()
                # Planning sees ShapeDtypeStruct stand-ins: read the user's sharding
                # annotations off the real state first.
                annotations = (read_annotations(state, rules=config.axis_rules or None)
                               if config.respect_annotations else None)
                plan, self.sources[sig] = self._plan(sig, annotations)
                step = apply_plan(self._fn, plan)
                _check_devices(step, self.cluster)
                self._steps[sig] = step
            return step

    def _plan(self, sig: Signature, annotations: dict[str, Any] | None) -> tuple[Plan, str]:
        """The plan of a signature, from disk when a matching file is there; else planned (and
        written to disk)."""
        assert self.cluster is not None
        state, batch = _abstract(sig)
        extra = {} if annotations is None else {"annotations": annotations}
        if self.cache_dir is None:
            return make_plan(self._fn, state, batch, cluster=self.cluster,
                             config=self.config, **extra), "planned"
        config = self.config or PlanConfig()
        fingerprint = graph_fingerprint(trace(self._fn, state, batch))
        key = hashlib.sha256("\n".join([
            fingerprint, self.cluster.content_hash(), config.content_hash(),
            __version__, repr(sorted((annotations or {}).items()))]).encode()
        ).hexdigest()[:24]
        path = self.cache_dir / f"{getattr(self._fn, '__name__', 'step')}-{key}.json"
        if path.exists():
            try:
                plan = load_plan(path)
                samples: Any = plan.solver.get(FINGERPRINT_SAMPLES)
                planned = (fingerprint if not isinstance(samples, int) else
                           step_fingerprint(self._fn, state, batch, samples=samples)[0])
                if (plan.graph_fingerprint, plan.cluster_hash, plan.config_hash,
                        plan.shardplan_version) == (planned, self.cluster.content_hash(),
                                                    config.content_hash(),
                                                    __version__):
                    return plan, "disk"
                reason = "it was made for another step, cluster or configuration"
            except ShardplanError as exc:
                reason = str(exc).splitlines()[0]
            warnings.warn(f"sp.auto: the cached plan {path} is not usable ({reason}); "
                          "planning again and overwriting it", ShardplanWarning, stacklevel=4)
        plan = make_plan(self._fn, state, batch, cluster=self.cluster, config=self.config,
                         **extra)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            plan.save(path)
        except (OSError, ConfigError) as exc:
            warnings.warn(f"sp.auto: cannot keep the plan on disk at {path} ({exc}); it is "
                          "kept in memory only", ShardplanWarning, stacklevel=4)
        return plan, "planned"

    def _split_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if len(args) != 2 or kwargs:
            got = [f"<{type(a).__name__}>" for a in args] + [f"{k}=..." for k in kwargs]
            raise ConfigError(format_error(
                f"An sp.auto step takes exactly two positional arguments, (state, batch); "
                f"{getattr(self, '__qualname__', 'it')} got ({', '.join(got)}).",
                where=_CALL_FORM, value=len(args) + len(kwargs), has_value=True,
                remedy="pack extra inputs into the batch pytree, close over constants, and "
                       "pass state and batch positionally"))
        return args[0], args[1]

    def __repr__(self) -> str:
        name = getattr(self._fn, "__qualname__", repr(self._fn))
        return f"<sp.auto {name}: {len(self._steps)} plan(s) cached>"


def _check_devices(step: Step, cluster: Cluster) -> None:
    """Refuses a step whose meshes are not on the cluster's devices (never run elsewhere
    silently).

    Plan device ids are the cluster's ids (``cluster.devices[i]``); a runtime that read them as
    indices into ``jax.devices()`` would put a cluster bound to ``jax.devices()[4:]`` on devices
    0-3.
    """
    if cluster.devices is None:
        return
    for index, mesh in step.meshes.items():
        stage = step.plan.stages[index]
        want = [cluster.devices[i] for i in stage.mesh.device_ids]
        got = list(mesh.devices.flat)
        if got != want:
            axes = dict(zip(stage.mesh.axis_names, stage.mesh.axis_sizes, strict=True))
            raise PlanMismatchError(format_error(
                "The planned step's mesh is not on the cluster's devices.",
                where=f"stage {index} mesh {axes}",
                value={"cluster": [str(d) for d in want], "mesh": [str(d) for d in got]},
                remedy="bind the cluster to jax.devices()[:n] (e.g. sp.Cluster.local(devices="
                       "jax.devices()[:4])) until apply_plan maps plan ids through "
                       "cluster.devices"))


PathLike = str | os.PathLike[str]


@overload
def auto(fn: Callable[..., Any], /, *, cluster: Cluster | None = None,
         config: PlanConfig | None = None, cache_dir: PathLike | None = None,
         disk_cache: bool = True) -> AutoStep: ...


@overload
def auto(fn: None = None, /, *, cluster: Cluster | None = None,
         config: PlanConfig | None = None, cache_dir: PathLike | None = None,
         disk_cache: bool = True) -> Callable[[Callable[..., Any]], AutoStep]: ...


def auto(fn: Callable[..., Any] | None = None, /, *, cluster: Cluster | None = None,
         config: PlanConfig | None = None, cache_dir: PathLike | None = None,
         disk_cache: bool = True) -> AutoStep | Callable[[Callable[..., Any]], AutoStep]:
    """Plans ``fn`` on its first call per input signature, caches the planned step, runs it.

    Each new signature (tree structure, shapes, dtypes and weak types of ``(state, batch)``)
    costs one :func:`~shardplan.api.wiring.make_plan` on ``jax.ShapeDtypeStruct`` stand-ins
    and one compile; calls with a signature seen before reuse the planned step as is. The state
    is placed per the plan on each call (a no-op once the step's own output is fed back).

    Args:
      fn: the train step ``(state, batch) -> (state, metrics)``; omit it to get a decorator.
      cluster: the cluster to plan for; None: ``sp.Cluster.local()`` (the devices jax sees),
        resolved at the first call so that decorating never starts a jax backend.
      config: planning options; None: ``sp.PlanConfig()`` defaults.
      cache_dir: where plan files are kept; None: :func:`default_cache_dir`.
      disk_cache: keep plans on disk and reuse them across processes (False: in memory only).

    Returns:
      An :class:`AutoStep` wrapping ``fn`` (``functools.wraps``): call it as
      ``step(state, batch)``; ``step.plan_for(state, batch)`` returns the plan,
      ``step.plans`` the cached plans (with the compiled and measured figures once run:
      ``step.plans[0].report()``), ``step.cache_clear()`` forgets them. Without ``fn``, a
      decorator that makes one.

    Raises:
      ConfigError: ``fn`` is not callable, ``cluster`` is not a ``Cluster`` or ``config`` not a
        ``PlanConfig``; at call time, arguments that are not exactly ``(state, batch)`` or
        leaves that are not arrays.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import shardplan as sp
      >>> @sp.auto(cluster=sp.Cluster.local(devices=jax.devices()[:2]),
      ...          config=sp.PlanConfig(time_limit_s=5))
      ... def train_step(w, x):
      ...     loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - 1.0) ** 2))(w)
      ...     return w - 0.1 * g, loss
      >>> w, loss = train_step(jnp.zeros((8, 8)), jnp.ones((4, 8)))   # plans, compiles, runs
      >>> w, loss = train_step(w, jnp.ones((4, 8)))                   # cached: runs only
      >>> len(train_step.plans)
      1
    """
    check_api_arguments("auto", cluster=cluster, config=config, cluster_required=False)

    def wrap(fn: Callable[..., Any], /) -> AutoStep:
        if not callable(fn):
            raise ConfigError(format_error(
                "sp.auto needs the train step function to wrap.", where="auto(fn)", value=fn,
                has_value=True,
                remedy="use @sp.auto(cluster=...) above `def train_step(state, batch)`, or "
                       "sp.auto(train_step, cluster=...)"))
        directory = (Path(cache_dir) if cache_dir is not None else default_cache_dir()
                     ) if disk_cache else None
        return AutoStep(fn, cluster=cluster, config=config, cache_dir=directory)

    return wrap if fn is None else wrap(fn)
