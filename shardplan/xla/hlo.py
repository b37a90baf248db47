"""A parser for the text of compiled XLA (HLO) modules.

``jax.stages.Compiled.as_text()`` prints the optimized, SPMD-partitioned HLO module that runs on
each device. This module turns that text into plain values:

* :class:`ArrayShape` / :class:`TupleShape`: result shapes (``f32[2,3]{1,0}``,
  ``(f32[2]{0}, s32[])``), with element counts and byte sizes;
* :class:`Instruction`: ``%name = SHAPE opcode(operands), attr=value, ...`` with its raw
  attributes, ``metadata={op_name=...}`` and source location;
* :class:`Computation`: the ``%name (...) -> ... {`` blocks, one of them ``ENTRY``;
* :class:`HloModule`: the computations plus the call graph (``calls=``, ``to_apply=``,
  ``body=``/``condition=``, ``branch_computations=``, ...), the ``while`` loops with their
  ``known_trip_count`` and each computation's *execution multiplier*: how many times it runs
  per execution of the entry computation.

Shapes are parsed by :mod:`shardplan.xla.shapes`, replica groups and source-target pairs by
:mod:`shardplan.xla.replica_groups` (all three syntaxes XLA prints); their public names are
re-exported here.

The parser never raises on text it does not understand: unknown opcodes and attributes are
kept verbatim, lines that are not instructions are skipped.

Example:
    >>> module = parse_hlo_module('''
    ... HloModule m
    ... ENTRY %main (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0)
    ...   ROOT %n = f32[4]{0} negate(%p), metadata={op_name="jit(f)/neg"}
    ... }''')
    >>> module.entry_computation.root.op_name
    'jit(f)/neg'
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from shardplan.xla.metadata import parse_frame_tables, parse_metadata, source_of
from shardplan.xla.replica_groups import parse_replica_groups as parse_replica_groups
from shardplan.xla.replica_groups import parse_source_target_pairs as parse_source_target_pairs
from shardplan.xla.shapes import ArrayShape as ArrayShape
from shardplan.xla.shapes import Shape as Shape
from shardplan.xla.shapes import TupleShape as TupleShape
from shardplan.xla.shapes import parse_shape as parse_shape
from shardplan.xla.text import parse_int_list as parse_int_list
from shardplan.xla.text import split_top_level, strip_comments, take_balanced, take_shape_text

__all__ = [
    "ArrayShape",
    "CallSite",
    "Computation",
    "HloModule",
    "Instruction",
    "Loop",
    "Shape",
    "TupleShape",
    "parse_hlo",
    "parse_hlo_module",
    "parse_int_list",
    "parse_replica_groups",
    "parse_shape",
    "parse_source_target_pairs",
]

# --------------------------------------------------------------------------------------------
# Instructions and computations
# --------------------------------------------------------------------------------------------

_INSTRUCTION_RE = re.compile(r"\s*(ROOT\s+)?%?([^\s=(),]+)\s*=\s*")
_OPCODE_RE = re.compile(r"\s*([a-z][a-z0-9\-_]*)\(")
_COMPUTATION_RE = re.compile(r"\s*(ENTRY\s+)?%?([^\s(=]+)\s*(\(.*)?\{\s*$")
_MODULE_RE = re.compile(r"^\s*HloModule\s+([^\s,]+)(.*)$")
_NAME_RE = re.compile(r"^[\w.\-]+$")
_TRIP_COUNT_RE = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)')
_NO_OPERAND_OPCODES = frozenset({"constant", "parameter", "iota"})


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction: ``%name = SHAPE opcode(operands), attr=value, ...``.

    Attributes:
      name: the instruction name, without ``%``.
      opcode: the opcode as printed (``all-reduce-start``, ``fusion``, ...).
      shape: the result shape.
      operands: operand instruction names, without ``%``.
      attributes: the raw text of each ``key=value`` attribute after the operands.
      computation: the name of the computation the instruction sits in.
      is_root: whether it is the computation's ``ROOT``.
      op_name: ``metadata={op_name="..."}``: the JAX name stack, e.g. ``jit(f)/dot_general``.
      source: ``file:line`` from the metadata (or its stack frame), when present.
    """

    name: str
    opcode: str
    shape: Shape
    operands: tuple[str, ...]
    attributes: Mapping[str, str] = field(compare=False, hash=False, repr=False)
    computation: str
    is_root: bool = False
    op_name: str | None = None
    source: str | None = None

    def attr(self, key: str) -> str | None:
        """Returns the raw text of attribute ``key``, or None when absent."""
        return self.attributes.get(key)

    @property
    def trip_count(self) -> int | None:
        """For a ``while``: ``backend_config``'s ``known_trip_count``, else None."""
        config = self.attributes.get("backend_config")
        match = _TRIP_COUNT_RE.search(config) if config else None
        return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Computation:
    """A computation: a named, ordered list of instructions.

    Attributes:
      name: the computation name, without ``%``.
      is_entry: whether it is the module's ``ENTRY`` computation.
      instructions: the instructions in text order.
    """

    name: str
    is_entry: bool
    instructions: tuple[Instruction, ...]
    _by_name: Mapping[str, Instruction] = field(init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        by_name = MappingProxyType({instr.name: instr for instr in self.instructions})
        object.__setattr__(self, "_by_name", by_name)

    @property
    def root(self) -> Instruction | None:
        """The ``ROOT`` instruction (the last one when none is marked)."""
        for instr in self.instructions:
            if instr.is_root:
                return instr
        return self.instructions[-1] if self.instructions else None

    def get(self, name: str) -> Instruction | None:
        """Returns the instruction called ``name`` (without ``%``), or None."""
        return self._by_name.get(name)

    def operand_shapes(self, instr: Instruction) -> tuple[Shape | None, ...]:
        """The shapes of ``instr``'s operands (None where an operand is not found)."""
        found = (self._by_name.get(name) for name in instr.operands)
        return tuple(op.shape if op is not None else None for op in found)


@dataclass(frozen=True)
class CallSite:
    """One edge of the call graph: ``instruction`` in ``caller`` calls ``callee``.

    Attributes:
      caller: the calling computation.
      instruction: the calling instruction's name.
      opcode: the calling instruction's opcode.
      role: the attribute naming the callee: ``body``, ``condition``, ``calls``, ``to_apply``,
        ``branch_computations``, ``true_computation``, ...
      callee: the called computation.
      factor: executions of ``callee`` per execution of ``instruction``: a ``while`` loop's
        trip count for its body and condition, else 1.
      trip_count_known: False for the body / condition of a loop without a known trip count.
    """

    caller: str
    instruction: str
    opcode: str
    role: str
    callee: str
    factor: int
    trip_count_known: bool


@dataclass(frozen=True)
class Loop:
    """A ``while`` instruction.

    Attributes:
      name: the ``while`` instruction's name.
      computation: the computation it sits in.
      body: the body computation.
      condition: the condition computation.
      trip_count: ``known_trip_count`` from its ``backend_config``, None when XLA does not
        know it.
      multiplier: executions of the loop itself (its computation's multiplier).
      op_name: the metadata op name (``jit(f)/while`` for a ``lax.scan``).
    """

    name: str
    computation: str
    body: str
    condition: str
    trip_count: int | None
    multiplier: int
    op_name: str | None


@dataclass(frozen=True)
class HloModule:
    """A parsed HLO module with its call graph.

    Attributes:
      name: the module name from the ``HloModule`` line.
      computations: computations by name, in text order.
      entry: the ``ENTRY`` computation's name, or None for a text without one.
      num_partitions: ``num_partitions=`` from the module header (1 when absent).
      replica_count: ``replica_count=`` from the module header (1 when absent).
      call_sites: every call-graph edge.
      multipliers: executions of each computation per execution of the entry computation
        (0 for computations the entry never reaches). A while body and condition take the
        loop's trip count (the condition really runs once more; it is counted like the body).
        Loops without a known trip count count 1. Fusion, call, async and applied
        computations (``to_apply=`` of reduce, all-reduce, ...) take the multiplier of the
        instruction that calls them (applied computations run per element; that is not
        counted). A computation called from several places sums them.
      trip_count_known: per computation, False when any loop enclosing it has no known trip
        count.
      loops: the ``while`` instructions reachable from the entry.
    """

    name: str
    computations: Mapping[str, Computation] = field(compare=False, hash=False, repr=False)
    entry: str | None
    num_partitions: int = 1
    replica_count: int = 1
    call_sites: tuple[CallSite, ...] = field(default=(), repr=False)
    multipliers: Mapping[str, int] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )
    trip_count_known: Mapping[str, bool] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )
    loops: tuple[Loop, ...] = ()

    @property
    def entry_computation(self) -> Computation | None:
        """The ``ENTRY`` computation, or None."""
        return self.computations.get(self.entry) if self.entry else None

    def instructions(self) -> Iterator[Instruction]:
        """All instructions of all computations, in text order."""
        for computation in self.computations.values():
            yield from computation.instructions

    def multiplier(self, computation: str) -> int:
        """Executions of ``computation`` per execution of the entry (0 if unreachable)."""
        return self.multipliers.get(computation, 0)

    def callees(self, computation: str) -> tuple[CallSite, ...]:
        """The call sites inside ``computation``."""
        return tuple(site for site in self.call_sites if site.caller == computation)


def _parse_operands(opcode: str, text: str) -> tuple[str, ...]:
    """Operand names from the text inside ``opcode(...)``.

    Each operand is ``%name`` or, in some print modes, ``SHAPE %name``: the last token is the
    name. Literals (``constant``), parameter numbers and anything not name-like are dropped.
    """
    if opcode in _NO_OPERAND_OPCODES:
        return ()
    names: list[str] = []
    for part in split_top_level(text):
        tokens = part.split()
        if not tokens:
            continue
        name = tokens[-1].removeprefix("%")
        if _NAME_RE.match(name):
            names.append(name)
    return tuple(names)


def _parse_attributes(text: str) -> dict[str, str]:
    """``, key=value, key=value`` after the operand list → ``{key: raw value}``."""
    attributes: dict[str, str] = {}
    last_key = ""
    for part in split_top_level(text):
        key, sep, value = part.strip().partition("=")
        key = key.strip()
        if key == "device_ids" and attributes.get(last_key, "").startswith("mesh["):
            # ``mesh[...], device_ids=(...) {axes}`` holds a top-level comma: rejoin it.
            attributes[last_key] += "," + part
        elif sep and _NAME_RE.match(key):
            attributes[key] = value.strip()
            last_key = key
    return attributes


def _parse_instruction(
    line: str, computation: str, frames: Mapping[int, str]
) -> Instruction | None:
    """Parses one instruction line; returns None if it is not one."""
    head = _INSTRUCTION_RE.match(line)
    if head is None:
        return None
    shape_text, rest = take_shape_text(line[head.end() :])
    opcode_match = _OPCODE_RE.match(rest)
    if opcode_match is None:
        return None
    try:
        shape = parse_shape(shape_text)
    except ValueError:
        return None
    opcode = opcode_match.group(1)
    operand_text, end = take_balanced(rest, opcode_match.end() - 1)
    attributes = _parse_attributes(rest[end:])
    metadata = parse_metadata(attributes.get("metadata"))
    return Instruction(
        name=head.group(2),
        opcode=opcode,
        shape=shape,
        operands=_parse_operands(opcode, operand_text),
        attributes=MappingProxyType(attributes),
        computation=computation,
        is_root=head.group(1) is not None,
        op_name=metadata.get("op_name"),
        source=source_of(metadata, frames),
    )


# --------------------------------------------------------------------------------------------
# Modules: splitting, computations, call graph, multipliers
# --------------------------------------------------------------------------------------------

# Attributes whose values are never computation names (skipped when looking for callees).
_NON_CALL_ATTRIBUTES = frozenset(
    {
        "metadata",
        "backend_config",
        "frontend_attributes",
        "sharding",
        "replica_groups",
        "source_target_pairs",
        "custom_call_target",
        "dimensions",
        "slice",
        "window",
    }
)
# The computation of an async op is called by its ``*-start``; ``*-update`` / ``*-done`` name
# it too, but must not count it again.
_NON_CALLING_OPCODES = frozenset({"async-update", "async-done"})
_WHILE_ROLES = frozenset({"body", "condition"})


def parse_hlo(text: str | Sequence[str]) -> tuple[HloModule, ...]:
    """Parses one or more HLO modules.

    Args:
      text: module text (``compiled.as_text()``), possibly several modules one after another
        (each starting with an ``HloModule`` line), or a sequence of such texts.

    Returns:
      The modules in order. A text without an ``HloModule`` line is one module named ``""``.
    """
    texts = [text] if isinstance(text, str) else list(text)
    modules: list[HloModule] = []
    for one_text in texts:
        modules.extend(parse_hlo_module(chunk) for chunk in _split_modules(one_text))
    return tuple(modules)


def _split_modules(text: str) -> list[str]:
    """Splits a text before each ``HloModule`` header line but the first."""
    chunks: list[list[str]] = [[]]
    seen_header = False
    for line in text.splitlines():
        if _MODULE_RE.match(line):
            if seen_header:
                chunks.append([])
            seen_header = True
        chunks[-1].append(line)
    return ["\n".join(chunk) for chunk in chunks if any(s.strip() for s in chunk)]


def parse_hlo_module(text: str) -> HloModule:
    """Parses the text of one HLO module (the first, if it holds several).

    Args:
      text: the module text; an ``HloModule`` header line is optional.

    Returns:
      The module with its call graph, multipliers and loops.
    """
    chunks = _split_modules(text)
    lines = chunks[0].splitlines() if chunks else []
    name, header = "", ""
    for line in lines:
        match = _MODULE_RE.match(line)
        if match:
            name, header = match.group(1), match.group(2)
            break
    computations, entry = _parse_computations(lines, parse_frame_tables(lines))
    call_sites = _find_call_sites(computations)
    multipliers, known = _propagate_multipliers(computations, entry, call_sites)
    return HloModule(
        name=name,
        computations=MappingProxyType(computations),
        entry=entry,
        num_partitions=_header_int(header, "num_partitions"),
        replica_count=_header_int(header, "replica_count"),
        call_sites=call_sites,
        multipliers=MappingProxyType(multipliers),
        trip_count_known=MappingProxyType(known),
        loops=_find_loops(computations, multipliers),
    )


def _header_int(header: str, key: str) -> int:
    match = re.search(rf"\b{key}=(\d+)", header)
    return int(match.group(1)) if match else 1


def _parse_computations(
    lines: Sequence[str], frames: Mapping[int, str]
) -> tuple[dict[str, Computation], str | None]:
    """Groups instruction lines into computations; returns them and the entry's name."""
    computations: dict[str, Computation] = {}
    entry: str | None = None
    current: tuple[str, bool] | None = None
    body: list[Instruction] = []
    for raw in lines:
        line = strip_comments(raw)
        if line.lstrip().startswith("//"):
            continue
        if current is None:
            header = _COMPUTATION_RE.match(line)
            if header and not line.lstrip().startswith("HloModule"):
                current, body = (header.group(2), header.group(1) is not None), []
            continue
        if line.strip() == "}":
            computations[current[0]] = Computation(current[0], current[1], tuple(body))
            entry = current[0] if current[1] else entry
            current = None
            continue
        instr = _parse_instruction(line, current[0], frames)
        if instr is not None:
            body.append(instr)
    if current is not None:  # a truncated text: keep what was read
        computations[current[0]] = Computation(current[0], current[1], tuple(body))
        entry = current[0] if current[1] else entry
    return computations, entry


def _callee_names(value: str, known: Mapping[str, Computation]) -> list[str]:
    """Computation names in an attribute value (``%c``, ``{%a, %b}``); [] if any is unknown."""
    inner = value.strip()
    if inner.startswith("{") and inner.endswith("}"):
        inner = inner[1:-1]
    names = [part.strip().removeprefix("%") for part in inner.split(",") if part.strip()]
    if names and all(n in known for n in names):
        return names
    return []


def _find_call_sites(computations: Mapping[str, Computation]) -> tuple[CallSite, ...]:
    """Every (caller, instruction, callee) edge, found from attributes naming computations."""
    sites: list[CallSite] = []
    for computation in computations.values():
        for instr in computation.instructions:
            if instr.opcode in _NON_CALLING_OPCODES:
                continue
            trip = instr.trip_count if instr.opcode == "while" else None
            for role, value in instr.attributes.items():
                if role in _NON_CALL_ATTRIBUTES:
                    continue
                for callee in _callee_names(value, computations):
                    in_loop = instr.opcode == "while" and role in _WHILE_ROLES
                    sites.append(
                        CallSite(
                            caller=computation.name,
                            instruction=instr.name,
                            opcode=instr.opcode,
                            role=role,
                            callee=callee,
                            factor=(trip if trip is not None else 1) if in_loop else 1,
                            trip_count_known=not in_loop or trip is not None,
                        )
                    )
    return tuple(sites)


def _topological_order(roots: Sequence[str], edges: Mapping[str, list[CallSite]]) -> list[str]:
    """Computations reachable from ``roots``, every caller before its callees."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    for root in roots:
        if root in state:
            continue
        state[root] = 1
        stack: list[tuple[str, Iterator[CallSite]]] = [(root, iter(edges.get(root, [])))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                state[node] = 2
                order.append(node)
            elif child.callee not in state:  # a back edge (a cycle) is ignored
                state[child.callee] = 1
                stack.append((child.callee, iter(edges.get(child.callee, []))))
    order.reverse()
    return order


def _propagate_multipliers(
    computations: Mapping[str, Computation], entry: str | None, sites: Sequence[CallSite]
) -> tuple[dict[str, int], dict[str, bool]]:
    """Execution multiplier and trip-count knowledge of every computation (see HloModule)."""
    edges: dict[str, list[CallSite]] = {}
    called: set[str] = set()
    for site in sites:
        edges.setdefault(site.caller, []).append(site)
        called.add(site.callee)
    roots = [entry] if entry else [c for c in computations if c not in called]
    multipliers = dict.fromkeys(computations, 0)
    known = dict.fromkeys(computations, True)
    for root in roots:
        multipliers[root] = 1
    for caller in _topological_order(roots, edges):
        for site in edges.get(caller, []):
            multipliers[site.callee] += multipliers[caller] * site.factor
            known[site.callee] = known[site.callee] and known[caller] and site.trip_count_known
    return multipliers, known


def _find_loops(
    computations: Mapping[str, Computation], multipliers: Mapping[str, int]
) -> tuple[Loop, ...]:
    """The ``while`` instructions in computations the entry reaches."""
    loops: list[Loop] = []
    for computation in computations.values():
        if multipliers.get(computation.name, 0) == 0:
            continue
        for instr in computation.instructions:
            if instr.opcode != "while":
                continue
            body = (instr.attr("body") or "").removeprefix("%")
            condition = (instr.attr("condition") or "").removeprefix("%")
            loops.append(
                Loop(
                    name=instr.name,
                    computation=computation.name,
                    body=body,
                    condition=condition,
                    trip_count=instr.trip_count,
                    multiplier=multipliers[computation.name],
                    op_name=instr.op_name,
                )
            )
    return tuple(loops)
