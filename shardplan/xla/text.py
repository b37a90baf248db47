"""Low-level scanning of HLO text: brackets, commas, quoted strings and comments.

The helpers here know nothing of HLO semantics: they split ``f32[2]{0}, (s32[], u32[])`` at
top-level commas, take the text inside a balanced bracket, strip ``/*index=N*/`` comments and
read integer lists. :mod:`shardplan.xla.shapes`, :mod:`shardplan.xla.hlo` and
:mod:`shardplan.xla.replica_groups` build on them.

Example:
    >>> split_top_level("f32[2,3]{1,0}, (s32[], u32[])")
    ['f32[2,3]{1,0}', ' (s32[], u32[])']
    >>> parse_int_list("{0,1}")
    (0, 1)
"""

from __future__ import annotations

import re
from collections.abc import Iterator

__all__ = [
    "parse_int_list",
    "split_top_level",
    "strip_comments",
    "take_balanced",
    "take_shape_text",
]

_OPEN_TO_CLOSE = {"(": ")", "[": "]", "{": "}"}
_CLOSERS = frozenset(_OPEN_TO_CLOSE.values())


_STRING_OR_COMMENT_RE = re.compile(r'"(?:[^"\\]|\\.)*"|/\*.*?\*/')


def strip_comments(text: str) -> str:
    """Removes ``/* ... */`` comments (``/*index=5*/``) that lie outside double-quoted strings."""
    if "/*" not in text:
        return text
    return _STRING_OR_COMMENT_RE.sub(lambda m: m.group() if m.group().startswith('"') else "", text)


_SCAN_RE = re.compile(r'"(?:[^"\\]|\\.)*"?|[()\[\]{},]')
"""A double-quoted string (skipped whole), a bracket or a comma."""
_SCAN_WITH_SPACES_RE = re.compile(r'"(?:[^"\\]|\\.)*"?|[()\[\]{},\s]')


def _scan(text: str, start: int = 0, *, spaces: bool = False) -> Iterator[tuple[int, str, int]]:
    """Yields ``(index, char, depth)`` for brackets and commas (and whitespace, if ``spaces``)
    outside double-quoted strings.

    ``depth`` counts the brackets ``( [ {`` open *before* the character (a closing bracket
    reports the depth inside it).
    """
    depth = 0
    pattern = _SCAN_WITH_SPACES_RE if spaces else _SCAN_RE
    for match in pattern.finditer(text, start):
        ch = match.group()
        if ch[0] == '"':
            continue
        if ch in _OPEN_TO_CLOSE:
            yield match.start(), ch, depth
            depth += 1
        elif ch in _CLOSERS:
            yield match.start(), ch, depth
            depth = max(depth - 1, 0)
        else:
            yield match.start(), ch, depth


def take_balanced(text: str, start: int) -> tuple[str, int]:
    """Returns the text inside the bracket at ``start`` and the index after its closer.

    An unclosed bracket takes the rest of the text.
    """
    for i, ch, depth in _scan(text, start + 1):
        if ch in _CLOSERS and depth == 0:
            return text[start + 1 : i], i + 1
    return text[start + 1 :], len(text)


def split_top_level(text: str) -> list[str]:
    """Splits ``text`` at commas outside brackets and strings."""
    parts: list[str] = []
    last = 0
    for i, ch, depth in _scan(text):
        if ch == "," and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    parts.append(text[last:])
    return parts


def take_shape_text(text: str) -> tuple[str, str]:
    """Splits ``text`` into the leading shape and the rest (a tuple or an array + layout)."""
    text = text.lstrip()
    if text.startswith("("):
        _, end = take_balanced(text, 0)
        return text[:end], text[end:]
    for i, ch, depth in _scan(text, spaces=True):
        if ch.isspace() and depth == 0:
            return text[:i], text[i:]
    return text, ""


def parse_int_list(text: str | None) -> tuple[int, ...]:
    """Parses ``{0,1}`` / ``[2,4]`` / ``1,0`` into a tuple of ints; ``None`` gives ``()``."""
    if not text:
        return ()
    return tuple(int(x) for x in re.findall(r"-?\d+", text))
