"""The types of a step's argument leaves as plans record them (``Plan.state_types``,
``batch_types``): ``{key path: "dtype[shape]"}``."""

from __future__ import annotations

from typing import Any

import jax

from shardplan.trace.dtypes import dtype_name

__all__ = ["arg_types", "type_text"]


def type_text(shape: tuple[int, ...], dtype: Any) -> str:
    """``"float32[8,16]"`` (``"int32[]"`` for a scalar, ``"key<fry>[]"`` for a PRNG key): how
    plans write an argument leaf's type.

    Example:
      >>> type_text((8, 16), "float32")
      'float32[8,16]'
    """
    return f"{dtype_name(dtype)}[{','.join(map(str, shape))}]"


def arg_types(tree: Any, /) -> dict[str, str]:
    """``{key path: "dtype[shape]"}`` of every leaf of ``tree`` (arrays, scalars or
    ``jax.ShapeDtypeStruct``s), key paths as in :attr:`Plan.param_specs`.

    Leaves that are not arrays are left out: the planner reports them itself.

    Example:
      >>> import jax.numpy as jnp
      >>> arg_types({"w": jnp.zeros((2, 3)), "b": jax.ShapeDtypeStruct((3,), jnp.int32)})
      {'b': 'int32[3]', 'w': 'float32[2,3]'}
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        try:
            aval = jax.typeof(leaf)
        except TypeError:
            continue
        out[jax.tree_util.keystr(path, simple=True, separator="/")] = type_text(
            tuple(aval.shape), aval.dtype)
    return out
