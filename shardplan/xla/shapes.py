"""HLO shapes: arrays (``f32[2,3]{1,0}``) and tuples (``(f32[2]{0}, s32[])``).

:func:`parse_shape` turns a printed result shape into an :class:`ArrayShape` or a
:class:`TupleShape`, with element counts and byte sizes as XLA's ``ShapeUtil`` computes them.

Example:
    >>> shape = parse_shape("(f32[2,3]{1,0}, s32[])")
    >>> shape.byte_size, [str(leaf) for leaf in shape.leaves()]
    (28, ['f32[2,3]', 's32[]'])
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from shardplan.xla.text import split_top_level, strip_comments, take_balanced

__all__ = [
    "ArrayShape",
    "Shape",
    "TupleShape",
    "parse_shape",
]

_ARRAY_SHAPE_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_PACKED_BITS_RE = re.compile(r"E\((\d+)\)")
_ZERO_SIZE_TYPES = frozenset({"token", "opaque"})


def _element_bits(dtype: str) -> int:
    """Bits of one element of an HLO element type: the first number in its name.

    ``f32`` → 32, ``bf16`` → 16, ``c64`` → 64, ``f8e4m3fn`` → 8, ``s4`` → 4; ``pred`` is
    stored in one byte; ``token`` / ``opaque`` (and anything unknown) occupy no bytes.
    """
    if dtype == "pred":
        return 8
    match = re.search(r"\d+", dtype)
    if dtype in _ZERO_SIZE_TYPES or match is None:
        return 0
    return int(match.group())


@dataclass(frozen=True)
class ArrayShape:
    """One array: element type and dimensions, as printed in HLO (``f32[2,3]{1,0}``).

    Attributes:
      dtype: the HLO element type name (``f32``, ``bf16``, ``s32``, ``pred``, ...).
      dims: the dimension sizes (dynamic ``<=N`` dimensions take their bound N).
      packed_bits: bits per element when the layout packs sub-byte types (``E(4)``), else None.
    """

    dtype: str
    dims: tuple[int, ...]
    packed_bits: int | None = None

    @property
    def rank(self) -> int:
        """The number of dimensions."""
        return len(self.dims)

    @property
    def num_elements(self) -> int:
        """The number of elements (1 for a scalar)."""
        return math.prod(self.dims)

    @property
    def byte_size(self) -> int:
        """Bytes the array occupies, as ``ShapeUtil::ByteSizeOf``: whole bytes per element
        (sub-byte types take one byte each) unless the layout packs them."""
        if self.packed_bits is not None:
            return -(-self.num_elements * self.packed_bits // 8)
        return self.num_elements * -(-_element_bits(self.dtype) // 8)

    def leaves(self) -> tuple[ArrayShape, ...]:
        """The arrays in this shape: itself."""
        return (self,)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclass(frozen=True)
class TupleShape:
    """A tuple of shapes, ``(f32[2]{0}, (s32[], u32[]))``.

    Attributes:
      elements: the element shapes, possibly tuples themselves.
    """

    elements: tuple[Shape, ...]

    @property
    def num_elements(self) -> int:
        """The number of array elements over all leaves."""
        return sum(leaf.num_elements for leaf in self.leaves())

    @property
    def byte_size(self) -> int:
        """Bytes of all leaf arrays (the tuple's index table is not counted)."""
        return sum(leaf.byte_size for leaf in self.leaves())

    def leaves(self) -> tuple[ArrayShape, ...]:
        """The arrays in this shape, depth first, in order."""
        return tuple(leaf for element in self.elements for leaf in element.leaves())

    def __str__(self) -> str:
        return f"({', '.join(map(str, self.elements))})"


Shape = ArrayShape | TupleShape


def parse_shape(text: str) -> Shape:
    """Parses an HLO shape such as ``f32[2,3]{1,0}``, ``s32[]`` or ``(f32[2]{0}, u32[])``.

    Args:
      text: the shape text; layouts and ``/*index=N*/`` comments are allowed.

    Returns:
      An :class:`ArrayShape` or a :class:`TupleShape`.

    Raises:
      ValueError: if ``text`` is not a shape.
    """
    text = strip_comments(text).strip()
    if text.startswith("("):
        inner, _ = take_balanced(text, 0)
        parts = [p for p in split_top_level(inner) if p.strip()]
        return TupleShape(tuple(parse_shape(p) for p in parts))
    match = _ARRAY_SHAPE_RE.match(text)
    if match is None:
        raise ValueError(f"not an HLO shape: {text!r}")
    dims = tuple(_parse_dim(d) for d in match.group(2).split(",") if d.strip())
    packed = _PACKED_BITS_RE.search(text[match.end() :])
    return ArrayShape(match.group(1), dims, int(packed.group(1)) if packed else None)


def _parse_dim(text: str) -> int:
    """A dimension: ``8``, a dynamic bound ``<=8`` (→ 8), or unbounded ``?`` (→ 0)."""
    digits = text.strip().removeprefix("<=")
    return int(digits) if digits.isdigit() else 0
