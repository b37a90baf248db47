"""Dtype names and byte sizes of every leaf a step can carry, PRNG key arrays included.

Typed key arrays (``jax.random.key(0)``, e.g. the keys of an ``nnx.Rngs``) have an extended
dtype, ``key<fry>``, that numpy cannot interpret (``np.dtype`` raises ``TypeError``). Each key
is stored as its key data (``jax.random.key_data``: two ``uint32`` words for threefry, four for
rbg), so that is what one element of such an array weighs. Everything that names a leaf's
dtype or counts its bytes goes through this module.

Example:
    >>> import jax
    >>> dtype_name(jax.random.key(0).dtype), itemsize("key<fry>"), nbytes((3,), "bfloat16")
    ('key<fry>', 8, 6)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["KEY_IMPLS", "dtype_name", "is_prng_key", "itemsize", "nbytes"]

KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
"""The PRNG implementations jax ships (``jax.random.key(seed, impl=...)``): the key dtypes
whose names alone (``key<fry>``, ``key<rbg>``, ``key<urbg>``) :func:`itemsize` knows."""


def is_prng_key(dtype: Any, /) -> bool:
    """Whether ``dtype`` (a dtype or a dtype name) is a typed PRNG key's (``key<fry>``).

    Raw key data (``jax.random.PRNGKey``, ``uint32[2]``) is an ordinary ``uint32`` array.

    Example:
      >>> import jax
      >>> is_prng_key(jax.random.key(0).dtype), is_prng_key(jax.random.PRNGKey(0).dtype)
      (True, False)
    """
    if isinstance(dtype, str):
        return dtype.startswith("key<")  # jax names every key dtype key<impl tag>
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:  # not a dtype at all
        return False


@functools.lru_cache(maxsize=256)
def dtype_name(dtype: Any, /) -> str:
    """The name plans and graphs write for ``dtype``: numpy's (``"float32"``, ``"bfloat16"``)
    or, for a PRNG key, jax's (``"key<fry>"``).

    Example:
      >>> import jax.numpy as jnp
      >>> dtype_name(jnp.bfloat16), dtype_name("key<fry>")
      ('bfloat16', 'key<fry>')
    """
    if is_prng_key(dtype):
        return str(dtype)
    return np.dtype(dtype).name


@functools.lru_cache(maxsize=256)
def itemsize(dtype: Any, /) -> int:
    """Bytes per element of ``dtype`` (a dtype or a name from :func:`dtype_name`); for a PRNG
    key, the bytes of its key data.

    Raises:
      TypeError: a name that is neither numpy's nor that of a key dtype of :data:`KEY_IMPLS`.

    Example:
      >>> itemsize("key<rbg>"), itemsize("int8")
      (16, 1)
    """
    if isinstance(dtype, str) and is_prng_key(dtype):
        known = _key_dtypes()
        if dtype not in known:
            raise TypeError(f"{dtype!r} is not the key dtype of any of {KEY_IMPLS}: its size "
                            "is unknown from its name alone")
        dtype = known[dtype]
    if is_prng_key(dtype):
        return int(dtype.itemsize)
    return int(np.dtype(dtype).itemsize)


def nbytes(shape: Sequence[int], dtype: Any, /) -> int:
    """Bytes of an array of ``shape`` and ``dtype`` (see :func:`itemsize`).

    Example:
      >>> nbytes((4, 2), "key<fry>")
      64
    """
    return math.prod(shape) * itemsize(dtype)


@functools.cache
def _key_dtypes() -> dict[str, Any]:
    """``{name: key dtype}`` of :data:`KEY_IMPLS` (``{"key<fry>": ..., ...}``)."""
    return {str(dtype): dtype for dtype in map(jax.random.key_dtype, KEY_IMPLS)}
