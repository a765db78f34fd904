"""The report's charts as inline SVG: time per layer, memory over the program with its
phases, the mesh, the candidate plans, and a pipeline's schedule."""

from __future__ import annotations

import html
import math

from autopar._sizes import format_bytes, format_seconds
from autopar.passes.stages.schedules import Schedule, slots

COMPUTE, COMM, MEMORY = "#4c78a8", "#f58518", "#54a24b"
PHASE_COLORS = {"forward": "#dbe8f6", "backward": "#fde6cf", "optimizer": "#dcefd6"}
_AXIS = "#555"


def _svg(width: float, height: float, parts: list[str], label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'role="img" aria-label="{html.escape(label)}">' + "".join(parts) + "</svg>")


def _text(x, y, s, size=11, anchor="start", color="#222", weight="normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{color}" font-weight="{weight}">{html.escape(str(s))}</text>')


def nice_ticks(top: float, n: int = 4) -> list[float]:
    """0 and steps of 1, 2 or 5 times a power of ten up to at least ``top``."""
    if top <= 0:
        return [0.0]
    raw = top / n
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(math.ceil(top / step - 1e-9)) + 1)]


def byte_ticks(top: float, n: int = 4) -> list[float]:
    """Ticks at round numbers of the binary unit ``top`` is printed in."""
    unit = 1024 ** max(0, min(4, int(math.log(max(top, 1), 1024))))
    return [t * unit for t in nice_ticks(top / unit, n)]


def tick_label(value: float, unit: float, names: dict) -> str:
    """A tick's label in ``unit`` (whole numbers without decimals)."""
    if not value:
        return "0"
    v = value / unit
    return f"{v:.0f} {names[unit]}" if abs(v - round(v)) < 1e-9 else f"{v:g} {names[unit]}"


_BYTE_UNITS = {1: "B", 1024: "KiB", 1024**2: "MiB", 1024**3: "GiB", 1024**4: "TiB"}
_TIME_UNITS = {1.0: "s", 1e-3: "ms", 1e-6: "us"}


def _unit(ticks: list[float], units: dict) -> float:
    top = ticks[-1] if ticks else 0
    return max([u for u in units if u <= top] or [min(units)])


def time_ticks(top: float, n: int = 4) -> list[float]:
    unit = 1.0 if top >= 1 else 1e-3 if top >= 1e-4 else 1e-6
    return [t * unit for t in nice_ticks(top / unit, n)]


def layer_bars(rows) -> str:
    """Horizontal stacked bars, compute then communication time per layer, on a time axis."""
    width, bar_h, label_w, right = 760, 18, 150, 80
    longest = max((r.compute_s + r.comm_s for r in rows), default=0.0) or 1e-9
    ticks = time_ticks(longest)
    scale = (width - label_w - right) / ticks[-1]
    parts, top = [], 8
    for i, r in enumerate(rows):
        y = top + i * (bar_h + 6)
        c, m = r.compute_s * scale, r.comm_s * scale
        parts.append(_text(label_w - 6, y + 13, r.name, 12, "end"))
        parts.append(f'<rect x="{label_w}" y="{y}" width="{c:.1f}" height="{bar_h}" '
                     f'fill="{COMPUTE}"><title>compute {format_seconds(r.compute_s)}</title></rect>')
        parts.append(f'<rect x="{label_w + c:.1f}" y="{y}" width="{m:.1f}" height="{bar_h}" '
                     f'fill="{COMM}"><title>communication {format_seconds(r.comm_s)}</title></rect>')
        parts.append(_text(label_w + c + m + 6, y + 13, format_seconds(r.compute_s + r.comm_s)))
    axis_y = top + len(rows) * (bar_h + 6) + 2
    parts.append(f'<line x1="{label_w}" x2="{label_w + ticks[-1] * scale:.1f}" y1="{axis_y}" '
                 f'y2="{axis_y}" stroke="{_AXIS}"/>')
    for t in ticks:
        x = label_w + t * scale
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{axis_y}" y2="{axis_y + 4}" '
                     f'stroke="{_AXIS}"/>')
        unit = 1.0 if ticks[-1] >= 1 else 1e-3 if ticks[-1] >= 1e-4 else 1e-6  # as format_seconds
        parts.append(_text(x, axis_y + 16, tick_label(t, unit, _TIME_UNITS),
                           10, "middle", _AXIS))
    return _svg(width, axis_y + 24, parts, "predicted time per layer")


def _phase_spans(phases) -> list[tuple[str, int, int]]:
    """(phase, first node, last node) of each run of one phase."""
    spans: list[list] = []
    for i, p in enumerate(phases):
        if spans and spans[-1][0] == p.value:
            spans[-1][2] = i
        else:
            spans.append([p.value, i, i])
    return [tuple(s) for s in spans]


def memory_chart(held: int, live, phases, peak_at: int) -> str:
    """Predicted bytes per device over the program (held for the whole call, plus the live
    buffers), on byte and operation axes, the forward, backward and optimizer phases shaded."""
    width, height = 760, 250
    left, right, top, bottom = 70, 12, 22, 40
    total = [held + x for x in live] or [held]
    n = max(len(total) - 1, 1)
    yticks = byte_ticks(max(total))
    ytop = yticks[-1] or 1
    plot_w, plot_h = width - left - right, height - top - bottom

    def x(i):
        return left + i * plot_w / n

    def y(v):
        return top + plot_h - v * plot_h / ytop

    parts = []
    named_to = float("-inf")   # where the last phase name ends: names never overlap
    for phase, a, b in _phase_spans(phases):
        if b - a < n / 200:
            continue   # a sliver: no room for a band
        parts.append(f'<rect x="{x(a):.1f}" y="{top}" width="{x(b) - x(a):.1f}" '
                     f'height="{plot_h}" fill="{PHASE_COLORS[phase]}"/>')
        middle, half = (x(a) + x(b)) / 2, 3.3 * len(phase)   # about 6.6 px a letter at 11 px
        if middle - half > named_to + 4:
            parts.append(_text(middle, top - 6, phase, 11, "middle", "#444"))
            named_to = middle + half
    pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(total))
    parts.append(f'<polygon fill="{MEMORY}" fill-opacity="0.35" '
                 f'points="{x(0):.1f},{y(0):.1f} {pts} {x(n):.1f},{y(0):.1f}"/>')
    parts.append(f'<rect x="{x(0):.1f}" y="{y(held):.1f}" width="{plot_w:.1f}" '
                 f'height="{y(0) - y(held):.1f}" fill="#999" fill-opacity="0.35">'
                 f"<title>held for the whole call: {format_bytes(held)}</title></rect>")
    parts.append(f'<polyline fill="none" stroke="{MEMORY}" stroke-width="1.5" points="{pts}"/>')
    peak = total[min(peak_at, len(total) - 1)]
    parts.append(f'<circle cx="{x(peak_at):.1f}" cy="{y(peak):.1f}" r="3.5" fill="#c00"/>')
    anchor = "end" if x(peak_at) > left + plot_w * 0.7 else "start"
    below = 16 if y(peak) < top + 16 else 4   # under the point near the top: the phase names
    parts.append(_text(x(peak_at) + (-6 if anchor == "end" else 6), y(peak) + below,
                       f"peak {format_bytes(peak)}", 11, anchor, "#c00", "bold"))
    parts += _axes(left, top, plot_w, plot_h, yticks, y, x, n)
    parts.append(_text(left + plot_w, y(held) - 4, f"held for the whole call: "
                       f"{format_bytes(held)}", 10, "end", "#444"))
    return _svg(width, height, parts, "predicted memory over the program")


def _axes(left, top, plot_w, plot_h, yticks, y, x, n) -> list[str]:
    parts = [f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + plot_h}" stroke="{_AXIS}"/>',
             f'<line x1="{left}" x2="{left + plot_w}" y1="{top + plot_h}" y2="{top + plot_h}" '
             f'stroke="{_AXIS}"/>']
    for t in yticks:
        parts.append(f'<line x1="{left - 4}" x2="{left + plot_w}" y1="{y(t):.1f}" '
                     f'y2="{y(t):.1f}" stroke="#000" stroke-opacity="{0.6 if not t else 0.08}"/>')
        parts.append(_text(left - 7, y(t) + 4, tick_label(t, _unit(yticks, _BYTE_UNITS),
                                                          _BYTE_UNITS), 10, "end", _AXIS))
    for t in nice_ticks(n, 6):
        if t <= n:
            parts.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top + plot_h}" '
                         f'y2="{top + plot_h + 4}" stroke="{_AXIS}"/>')
            parts.append(_text(x(t), top + plot_h + 16, f"{t:.0f}", 10, "middle", _AXIS))
    parts.append(_text(left + plot_w / 2, top + plot_h + 32,
                       "operations in program order", 11, "middle", _AXIS))
    return parts


def mesh_diagram(axis_sizes: dict[str, int], carries: dict[str, str], device_ids) -> str:
    """The devices as a grid: the last mesh axis across, the one before down, any earlier
    ones as separate panels; each axis labelled with what it carries."""
    names = list(axis_sizes)
    cols_axis = names[-1]
    rows_axis = names[-2] if len(names) > 1 else None
    outer = names[:-2]
    n_cols = axis_sizes[cols_axis]
    n_rows = axis_sizes[rows_axis] if rows_axis else 1
    n_panels = math.prod(axis_sizes[a] for a in outer) if outer else 1
    cell = max(8, min(52, 560 // max(n_cols * n_panels, 1), 420 // max(n_rows, 1)))
    left, top, gap = 120, 36, 18
    panel_w = n_cols * cell
    flat = list(device_ids)
    parts = []
    for p in range(n_panels):
        x0 = left + p * (panel_w + gap)
        if outer:
            idx = _unravel(p, [axis_sizes[a] for a in outer])
            parts.append(_text(x0 + panel_w / 2, top - 22, ", ".join(
                f"{a}={i}" for a, i in zip(outer, idx)), 10, "middle", "#444"))
        for r in range(n_rows):
            for c in range(n_cols):
                dev = flat[(p * n_rows + r) * n_cols + c]
                parts.append(f'<rect x="{x0 + c * cell + 1}" y="{top + r * cell + 1}" '
                             f'width="{cell - 2}" height="{cell - 2}" rx="{min(4, cell // 6)}" '
                             f'fill="#eef3f9" stroke="{COMPUTE}"><title>device {dev}</title></rect>')
                if cell >= 24:   # room for the device id
                    parts.append(_text(x0 + c * cell + cell / 2,
                                       top + r * cell + cell / 2 + 4, dev, 12, "middle"))
    right_edge = left + n_panels * (panel_w + gap) - gap
    parts.append(_text((left + right_edge) / 2, top - 8,
                       f"{cols_axis} ({n_cols}) \u2192", 12, "middle", weight="bold"))
    if rows_axis:
        parts.append(_text(left - 8, top + n_rows * cell / 2, f"{rows_axis} ({n_rows}) \u2193",
                           12, "end", weight="bold"))
    height = top + n_rows * cell + 12
    lines = [f"{a}: {carries.get(a) or 'nothing split over it'}" for a in names]
    for i, line in enumerate(lines):
        parts.append(_text(right_edge + 24, top + 14 + i * 18, line, 13))
    width = right_edge + 24 + 7.5 * max((len(s) for s in lines), default=0)
    return _svg(min(max(width, 400), 1060), max(height, top + 18 * len(lines) + 10), parts,
                "the device mesh")


def _unravel(i: int, sizes: list[int]) -> list[int]:
    out = []
    for s in reversed(sizes):
        out.append(i % s)
        i //= s
    return out[::-1]


def candidate_bars(found: list[tuple[str, float, bool]]) -> str:
    """The plans the planner compared, by predicted step time; the chosen one dark."""
    width, bar_h, label_w = 760, 16, 220
    longest = max((t for _, t, _ in found), default=0.0) or 1e-9
    scale = (width - label_w - 90) / longest
    parts = []
    for i, (name, t, chosen) in enumerate(found):
        y = 6 + i * (bar_h + 5)
        parts.append(_text(label_w - 6, y + 12, name + (" (chosen)" if chosen else ""), 12,
                           "end", weight="bold" if chosen else "normal"))
        parts.append(f'<rect x="{label_w}" y="{y}" width="{t * scale:.1f}" height="{bar_h}" '
                     f'fill="{COMPUTE if chosen else "#9db7d5"}"/>')
        parts.append(_text(label_w + t * scale + 6, y + 12, format_seconds(t)))
    return _svg(width, 12 + len(found) * (bar_h + 5), parts, "candidate plans")


def gantt(pipeline: dict) -> str:
    """The pipeline's schedule, one row per stage and one column per tick or slot: forward
    slots in blue, backward (input gradient) in orange, weight gradient (ZB-H1) in green,
    idle blank."""
    rows = slots(Schedule(pipeline["schedule"]), pipeline["stages"], pipeline["microbatches"],
                 pipeline.get("virtual_stages", 1))
    n = len(rows[0])
    label_w, cell_h = 70, 22
    cell_w = max(min((760 - label_w) / n, 48), 6)
    parts = []
    for s, row in enumerate(rows):
        y = 8 + s * (cell_h + 4)
        parts.append(_text(label_w - 6, y + 15, f"stage {s}", 12, "end"))
        for t, slot in enumerate(row):
            kinds = slot.split()
            for j, kind in enumerate(kinds):
                h = cell_h / len(kinds)
                color = {"F": COMPUTE, "W": MEMORY}.get(kind[0], COMM)
                parts.append(
                    f'<rect x="{label_w + t * cell_w:.1f}" y="{y + j * h:.1f}" '
                    f'width="{cell_w - 1:.1f}" height="{h:.1f}" fill="{color}">'
                    f"<title>tick {t}: {html.escape(kind)}</title></rect>")
            if slot and cell_w >= 30:
                parts.append(_text(label_w + t * cell_w + 3, y + 14, slot, 10, color="#fff"))
    return _svg(label_w + n * cell_w + 10, 16 + len(rows) * (cell_h + 4), parts,
                "pipeline schedule")
