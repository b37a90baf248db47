"""A readable text summary of an :class:`~shardplan.trace.graph.OpGraph`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardplan.trace.graph import OpGraph

__all__ = ["format_count", "graph_summary"]

_PHASE_ORDER = ("forward", "backward", "recompute", "update", "other")


def format_count(x: float, unit: str = "") -> str:
    """``1.23e12`` -> ``1.23 T``: engineering prefixes for FLOPs, bytes and counts."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def graph_summary(g: OpGraph) -> str:
    """Layers grouped by fingerprint, parameters by role, FLOPs and bytes per phase."""
    lines = [f"OpGraph '{g.name}': {len(g.ops)} ops, {len(g.tensors)} tensors"]
    lines += _role_lines(g)
    lines += _phase_lines(g)
    lines += _layer_lines(g)
    blocks = g.blocks
    if blocks:
        distinct = len({b.fingerprint for b in blocks})
        lines.append(f"{len(blocks)} blocks, {distinct} distinct fingerprint(s)")
    if g.unknown_primitives:
        names = ", ".join(f"{p} ({src})" for p, src in g.unknown_primitives)
        lines.append(f"primitives without a cost rule (costed as elementwise): {names}")
    for note in g.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _role_lines(g: OpGraph) -> list[str]:
    """The summary's table of the inputs by role: leaves, elements and bytes."""
    # Parameters by role.
    by_role: dict[str, list[int]] = {}
    for p in g.parameters:
        n = 1
        for d in p.shape:
            n *= d
        acc = by_role.setdefault(p.role, [0, 0, 0])
        acc[0] += 1
        acc[1] += n
        acc[2] += g.tensors[p.tensor].nbytes
    lines = [""]
    lines.append(f"{'inputs by role':<18}{'leaves':>8}{'elements':>14}{'bytes':>12}")
    for role in ("parameter", "optimizer_state", "other", "unused"):
        if role in by_role:
            c, n, b = by_role[role]
            lines.append(f"{role:<18}{c:>8}{format_count(n):>14}{format_count(b, 'B'):>12}")
    return lines


def _phase_lines(g: OpGraph) -> list[str]:
    """The summary's table of the ops, FLOPs and bytes moved per phase, and the total FLOPs."""
    # FLOPs and bytes per phase.
    lines = [""]
    lines.append(f"{'phase':<12}{'ops':>8}{'FLOPs':>14}{'matmul FLOPs':>15}{'bytes moved':>14}")
    for phase in _PHASE_ORDER:
        ops = [op for op in g.ops if op.phase == phase and not op.structural]
        if not ops:
            continue
        flops = sum(op.total_flops for op in ops)
        mm = sum(op.total_flops for op in ops if op.primitive in ("dot_general",
                                                                    "conv_general_dilated"))
        moved = sum((op.bytes_read + op.bytes_written) * op.count for op in ops)
        lines.append(f"{phase:<12}{len(ops):>8}{format_count(flops):>14}"
                     f"{format_count(mm):>15}{format_count(moved, 'B'):>14}")
    total = g.total_flops()
    lines.append(f"{'total':<12}{'':>8}{format_count(total):>14}")
    return lines


def _layer_lines(g: OpGraph) -> list[str]:
    """The summary's table of the layers, runs of equal fingerprints collapsed into one row."""
    # Layers, consecutive equal fingerprints collapsed.
    lines = [""]
    lines.append(f"{'layers':<28}{'kind':<8}{'fingerprint':<18}{'params':>10}"
                 f"{'fwd FLOPs':>11}{'bwd FLOPs':>11}{'upd FLOPs':>11}")
    i = 0
    layers = list(g.layers)
    while i < len(layers):
        j = i
        while (j + 1 < len(layers) and layers[j + 1].fingerprint == layers[i].fingerprint
               and layers[j + 1].kind == layers[i].kind):
            j += 1
        lay = layers[i]
        label = lay.name if i == j else f"{lay.name} .. {layers[j].name} (x{j - i + 1})"
        bwd = lay.flops.get("backward", 0.0) + lay.flops.get("recompute", 0.0)
        lines.append(f"{label:<28}{lay.kind:<8}{lay.fingerprint:<18}"
                     f"{format_count(lay.param_bytes, 'B'):>10}"
                     f"{format_count(lay.flops.get('forward', 0.0)):>11}"
                     f"{format_count(bwd):>11}"
                     f"{format_count(lay.flops.get('update', 0.0)):>11}")
        i = j + 1
    return lines
