"""User sharding annotations as planning constraints (``PlanConfig(respect_annotations=True)``).

A user who already wrote shardings keeps them: every state leaf annotated with
``nnx.with_partitioning`` (NNX), ``nn.with_partitioning`` or ``nn.with_logical_partitioning``
(Linen) is placed exactly as annotated, and the planner chooses the rest (the leaves without
annotations, the batch, every intermediate value) and the mesh's axis sizes.

* :func:`read_annotations` reads the annotations off a state (real, or abstract from
  ``nnx.eval_shape`` / ``jax.eval_shape``) as ``{state key path: spec}``, a spec being one tuple
  of mesh axis names per dimension (``("model", None)`` reads ``(("model",), ())``).
* The mesh's axes are the user's axis names (:func:`annotation_axes`): the mesh axes
  ``PlanConfig.axis_rules`` names, in its order, then any other name in order of first
  appearance. The first axis is the outermost (it spans nodes), the last the innermost, as in
  ``jax.make_mesh``. Every axis gets at least two devices; an axis has size 1 only where the
  device count has too few prime factors for all of them (:func:`annotated_meshes`).
* Each annotation is checked against its leaf (:func:`check_annotations`: the key path exists,
  the rank, no axis twice) and against the meshes (:func:`annotated_meshes`: some mesh divides
  every annotated dimension) before anything is solved; each failure is a
  :class:`~shardplan.errors.ConfigError` naming the key path.
* The intra-op problem then forbids (infinite cost) every other strategy of an annotated leaf
  (``build_intraop_problem(fixed_specs=...)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardplan.cluster import Cluster
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.sharding import Spec
from shardplan.errors import ConfigError, format_error
from shardplan.planner.nodes import tie_layers
from shardplan.trace.graph import OpGraph

__all__ = [
    "AxisRules",
    "annotated_meshes",
    "annotation_axes",
    "check_annotations",
    "leaf_shapes",
    "read_annotations",
    "tie_periods",
]

AxisRules = Sequence[tuple[str, str | None]]
"""``(logical name, mesh axis or None)`` pairs, as ``flax.linen.logical_axis_rules`` takes."""


def read_annotations(tree: Any, /, *, rules: AxisRules | None = None,
                     prefix: str = "") -> dict[str, Spec]:
    """The sharding annotations of a state's leaves, by key path.

    Sources: NNX variables created with ``nnx.with_partitioning(init, names)`` (the
    ``out_sharding`` metadata; names with a rule are renamed by it, as
    ``nnx.get_partition_spec`` does, and names without one are mesh axes), Linen boxes
    ``nn.Partitioned`` (names are mesh axes) and ``nn.LogicallyPartitioned`` (logical names,
    turned into mesh axes by ``nn.logical_to_mesh_axes``; every logical name needs a rule, a
    ``(name, None)`` rule replicating). The boxes may be in an ``nnx.State``, in a Linen
    ``TrainState`` built from boxed params, or in the boxed variables ``init`` returned.

    Args:
      tree: the state, or a subtree of it (e.g. the boxed params when the ``TrainState``
        holds unboxed ones; give their place in the state as ``prefix``).
      rules: logical axis rules; None: those of flax's active ``logical_axis_rules`` context.
      prefix: the key path of ``tree`` inside the state (``"params"`` for a ``TrainState``'s
        params), prepended with a ``/``.

    Returns:
      ``{key path: spec}`` for the annotated leaves, with the key paths ``make_plan`` uses
      (``jax.tree_util.keystr(path, simple=True, separator="/")`` of the state; a box adds
      its own child, e.g. ``.../kernel/value``). Leaves without annotations are absent.

    Raises:
      ConfigError: a logical name has no rule, or an annotation is not a sequence of axis
        names.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> init = nn.with_partitioning(nn.initializers.ones, ("model", None))
      >>> params = {"w": init(jax.random.key(0), (4, 2))}
      >>> read_annotations(params, prefix="params")
      {'params/w/value': (('model',), ())}
    """
    import jax
    from flax import nnx
    from flax.core import meta
    from flax.core import spmd as core_spmd

    context = tuple(core_spmd.get_logical_axis_rules())
    active = tuple(rules) if rules is not None else context

    def is_box(x: object) -> bool:
        return isinstance(x, nnx.Variable | meta.Partitioned)

    out: dict[str, Spec] = {}
    for path, box in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
        if not is_box(box):
            continue
        where = _join(prefix, jax.tree_util.keystr(path, simple=True, separator="/"))
        keys = [_join(where, jax.tree_util.keystr(sub, simple=True, separator="/"))
                for sub, _ in jax.tree_util.tree_flatten_with_path(box)[0]]
        names = _box_axes(box, active, keys[0] if keys else where)
        if names is None:
            continue
        for key in keys:
            out[key] = tuple(_dim_axes(n, key, names) for n in names)
    return out


def _join(a: str, b: str) -> str:
    return "/".join(p for p in (a, b) if p)


def _box_axes(box: Any, rules: tuple, where: str) -> tuple[Any, ...] | None:
    """The mesh axes per dimension of one box (None: no annotation)."""
    import flax.linen as nn
    from flax import nnx
    from flax.core import spmd as core_spmd

    if isinstance(box, nnx.Variable):
        metadata = box.get_metadata()
        sharding = metadata.get("out_sharding")
        if not sharding:
            return None
        if isinstance(sharding, str):
            raise ConfigError(format_error(
                "An annotation must give one entry per dimension, not a single name.",
                where=where, value=sharding,
                remedy=f"write a tuple, e.g. ({sharding!r}, None) for a matrix"))
        composite = core_spmd.composite_rules(rules, metadata.get("sharding_rules", ()))
        return tuple(core_spmd.from_sharding_rules(tuple(sharding), composite))
    if isinstance(box, nn.LogicallyPartitioned):
        composite = tuple(rules) + tuple(box.rules or ())
        known = {logical for logical, _ in composite}
        for name in box.names:
            if isinstance(name, str) and name not in known:
                raise ConfigError(format_error(
                    f"The logical axis name {name!r} has no rule.", where=where,
                    value={"annotation": tuple(box.names), "rules": composite},
                    remedy=f"add ({name!r}, <mesh axis>) to PlanConfig.axis_rules (or "
                           f"({name!r}, None) to replicate that dimension)"))
        spec = nn.logical_to_mesh_axes(tuple(box.names), composite)
        return tuple(spec) if spec is not None else None
    return tuple(box.names)


def _dim_axes(entry: object, where: str, names: Sequence[object]) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple | list) and all(isinstance(a, str) for a in entry):
        return tuple(entry)
    raise ConfigError(format_error(
        "An annotation entry must be a mesh axis name, a tuple of them, or None "
        "(PartitionSpec.UNCONSTRAINED is not supported).",
        where=where, value=tuple(names), remedy="annotate each dimension with names or None"))


def check_annotations(annotations: Mapping[str, Sequence[Any]],
                      shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Spec]:
    """Checks each annotation against its leaf and returns it as a full-rank spec.

    Args:
      annotations: ``{state key path: spec}``; a spec gives per dimension None, an axis name
        or a tuple of names (a ``PartitionSpec`` works). A spec shorter than the leaf's rank
        leaves the trailing dimensions replicated, as ``PartitionSpec`` does.
      shapes: ``{state key path: shape}`` of every state leaf.

    Returns:
      ``{key path: spec}`` with one tuple of axis names per dimension.

    Raises:
      ConfigError: a key path is not a state leaf, a spec is longer than the leaf's rank, or
        names an axis twice.
    """
    out: dict[str, Spec] = {}
    for path, annotation in annotations.items():
        if path not in shapes:
            similar = [p for p in shapes if p.rsplit("/", 1)[-1] == path.rsplit("/", 1)[-1]]
            raise ConfigError(format_error(
                "An annotated key path is not a leaf of the state.", where=path,
                value={"state key paths like it": similar[:5] or list(shapes)[:5]},
                remedy="key the annotations by the state's key paths "
                       "(jax.tree_util.keystr(path, simple=True, separator='/'); "
                       "read_annotations(prefix=...) places a subtree)"))
        shape = shapes[path]
        spec = tuple(_dim_axes(entry, path, tuple(annotation)) for entry in annotation)
        if len(spec) > len(shape):
            raise ConfigError(format_error(
                f"The annotation has {len(spec)} entries but the leaf has rank {len(shape)}.",
                where=path, value={"annotation": tuple(annotation), "shape": shape},
                remedy=f"give at most {len(shape)} entries, one per dimension"))
        axes = [a for dim in spec for a in dim]
        twice = sorted({a for a in axes if axes.count(a) > 1})
        if twice:
            raise ConfigError(format_error(
                f"The annotation shards over mesh axis {twice[0]!r} twice.", where=path,
                value={"annotation": tuple(annotation), "shape": shape},
                remedy="use each mesh axis in at most one dimension"))
        out[path] = spec + ((),) * (len(shape) - len(spec))
    return out


def annotation_axes(specs: Mapping[str, Spec], rules: AxisRules = ()) -> tuple[str, ...]:
    """The mesh's axis names: those ``rules`` maps to, in its order, then the other names the
    specs use, in order of first appearance."""
    names: list[str] = []
    for _, axis in rules:
        if axis is not None and axis not in names:
            names.append(axis)
    for spec in specs.values():
        for dim in spec:
            names.extend(a for a in dim if a not in names)
    return tuple(names)


def _shapes_of(n: int, k: int) -> list[tuple[int, ...]]:
    """Ordered factorisations of ``n`` into ``k`` factors, with as few 1s as ``n`` allows."""
    out: list[tuple[int, ...]] = []

    def rec(rest: int, prefix: tuple[int, ...]) -> None:
        if len(prefix) == k:
            if rest == 1:
                out.append(prefix)
            return
        for f in range(1, rest + 1):
            if rest % f == 0:
                rec(rest // f, (*prefix, f))

    rec(n, ())
    ones = min(s.count(1) for s in out)
    return [s for s in out if s.count(1) == ones]


def _aligned(shape: tuple[int, ...], per_node: int) -> bool:
    """Whether every axis of a row-major mesh lies inside a node or spans nodes at one
    position per node (see :mod:`shardplan.planner.mesh`)."""
    stride = 1
    for size in reversed(shape):
        if size > 1 and not (per_node % (stride * size) == 0 or stride % per_node == 0):
            return False
        stride *= size
    return True


def annotated_meshes(device_ids: Sequence[int], cluster: Cluster, axes: tuple[str, ...],
                     specs: Mapping[str, Spec],
                     shapes: Mapping[str, tuple[int, ...]]) -> list[LogicalMesh]:
    """The candidate meshes with the user's axes over ``device_ids``: every assignment of
    sizes to ``axes`` (each at least 2 where the device count allows) that follows the node
    layout (where one does) and divides every annotated dimension.

    Raises:
      ConfigError: an annotated dimension is divided by no candidate's axis sizes (the
        message names it, its size and the sizes its axes can take), or no single candidate
        divides every annotation.
    """
    ids = sorted(device_ids, key=lambda d: (cluster.node_of(d), d))
    per: dict[int, int] = {}
    for d in ids:
        per[cluster.node_of(d)] = per.get(cluster.node_of(d), 0) + 1
    shapes_ = _shapes_of(len(ids), len(axes))
    if len(set(per.values())) == 1:
        aligned = [s for s in shapes_ if _aligned(s, next(iter(per.values())))]
        shapes_ = aligned or shapes_
    meshes = [LogicalMesh(axes, s, tuple(ids)) for s in shapes_]

    def divides(mesh: LogicalMesh, path: str) -> bool:
        return all(n % mesh.size(dim) == 0 for n, dim in zip(shapes[path], specs[path],
                                                             strict=True))

    for path in specs:
        if any(divides(m, path) for m in meshes):
            continue
        failing = [(d, n, dim) for d, (n, dim) in enumerate(zip(shapes[path], specs[path],
                                                                strict=True))
                   if dim and all(n % m.size(dim) for m in meshes)]
        if not failing:  # each dimension divides on some mesh, never all on one
            raise ConfigError(format_error(
                "No candidate mesh divides every dimension of the annotated leaf at once.",
                where=path,
                value={"annotation": _readable(specs[path]), "shape": shapes[path],
                       "candidate meshes": [m.shape for m in meshes]},
                remedy="pad the annotated dimensions, or annotate fewer of them"))
        d, n, dim = failing[0]
        sizes = sorted({m.size(dim) for m in meshes})
        raise ConfigError(format_error(
            f"Dimension {d} (size {n}) of the leaf is annotated with mesh axes {dim}, but no "
            f"candidate mesh over {len(ids)} devices gives them a size that divides {n}.",
            where=path,
            value={"annotation": _readable(specs[path]), "shape": shapes[path],
                   "sizes of the axes": sizes, "mesh axes": axes},
            remedy=f"pad dimension {d} to a multiple of one of {sizes}, annotate it None, or "
                   "plan on a device count with a fitting factor"))
    fitting = [m for m in meshes if all(divides(m, p) for p in specs)]
    if not fitting:
        raise ConfigError(format_error(
            "Each annotation divides on some mesh, but no single mesh divides them all.",
            where=", ".join(specs), value=[dict(m.shape) for m in meshes],
            remedy="make the annotated dimensions divisible by one assignment of axis sizes"))
    return fitting


def tie_periods(graph: OpGraph, periods: Sequence[int], specs: Mapping[str, Spec],
                ) -> tuple[int, ...]:
    """The layer-tying periods (``PlanConfig.tie_periods``) under which no two leaves with
    different annotations share a node (0, tying nothing, where every period would)."""
    path_of = {p.tensor: p.path for p in graph.parameters if p.arg_index == 0}
    kept = tuple(
        period for period in periods
        if not any(specs.get(path_of.get(a, "")) != specs.get(path_of.get(b, ""))
                   for a, b in (tie_layers(graph, period)[1].items() if period else ())))
    return kept or (0,)


def _readable(spec: Spec) -> tuple[object, ...]:
    """A spec as a ``PartitionSpec`` prints it: ``("model", None)``."""
    return tuple(None if not dim else dim[0] if len(dim) == 1 else dim for dim in spec)


def leaf_shapes(state: Any) -> dict[str, tuple[int, ...]]:
    """``{state key path: shape}`` of every leaf with a shape."""
    import jax

    return {jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
            if hasattr(leaf, "shape")}
