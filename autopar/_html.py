"""The plan's report as one self-contained HTML page: inline CSS and SVG, no external assets.

It holds the estimate (beside baselines when given), a bar chart of predicted time per layer
(compute and communication), a chart of predicted memory over the program, the per-layer
parameter shardings, the collectives chosen and the fallbacks; a pipelined plan's schedule as a
Gantt chart, one row per stage.
"""

from __future__ import annotations

import html

from autopar._layers import layer_rows, memory_over_program
from autopar.passes.stages.schedules import Schedule, slots
from autopar._report import (
    _collective_lines,
    _fmt_bytes,
    _fmt_s,
    _pipeline_lines,
    _remat_lines,
    _spec_str,
    outside_layers,
)

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1100px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; font-size: 0.9em; }
th { background: #f1f1f1; } td.l, th.l { text-align: left; font-family: monospace; }
.legend span { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px; }
pre { background: #f7f7f7; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
"""
_COMPUTE, _COMM, _MEM = "#4c78a8", "#f58518", "#54a24b"


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    def cell(tag, i, v):
        cls = ' class="l"' if i < left else ""
        return f"<{tag}{cls}>{html.escape(str(v))}</{tag}>"
    out = ["<table><tr>" + "".join(cell("th", i, h) for i, h in enumerate(header)) + "</tr>"]
    out += ["<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows]
    return "\n".join(out) + "</table>"


def _bars_svg(rows) -> str:
    """Horizontal stacked bars: compute and communication time per layer."""
    width, bar_h, label_w = 760, 18, 130
    longest = max((r.compute_s + r.comm_s for r in rows), default=0.0) or 1.0
    scale = (width - label_w - 90) / longest
    parts = []
    for i, r in enumerate(rows):
        y = 10 + i * (bar_h + 6)
        c, m = r.compute_s * scale, r.comm_s * scale
        parts.append(f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end" font-size="12">'
                     f"{html.escape(r.name)}</text>")
        parts.append(f'<rect x="{label_w}" y="{y}" width="{c:.1f}" height="{bar_h}" '
                     f'fill="{_COMPUTE}"><title>compute {_fmt_s(r.compute_s)}</title></rect>')
        parts.append(f'<rect x="{label_w + c:.1f}" y="{y}" width="{m:.1f}" height="{bar_h}" '
                     f'fill="{_COMM}"><title>communication {_fmt_s(r.comm_s)}</title></rect>')
        parts.append(f'<text x="{label_w + c + m + 6:.1f}" y="{y + 13}" font-size="11">'
                     f"{_fmt_s(r.compute_s + r.comm_s)}</text>")
    height = 20 + len(rows) * (bar_h + 6)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
            + "".join(parts) + "</svg>")


def _memory_svg(held: int, live: list[int]) -> str:
    """Predicted bytes per device at each node of the program (held + live buffers)."""
    width, height, pad = 760, 220, 50
    total = [held + x for x in live] or [held]
    top = max(total) or 1
    n = max(len(total) - 1, 1)

    def xy(i, v):
        return pad + i * (width - pad - 10) / n, height - 25 - v * (height - 45) / top

    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in enumerate(total)))
    x0, base = xy(0, 0)
    x1, _ = xy(n, 0)
    _, held_y = xy(0, held)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
            f'<polygon fill="{_MEM}" fill-opacity="0.35" points="{x0:.1f},{base:.1f} {pts} '
            f'{x1:.1f},{base:.1f}"/>'
            f'<rect x="{x0:.1f}" y="{held_y:.1f}" width="{x1 - x0:.1f}" '
            f'height="{base - held_y:.1f}" fill="#bbb" fill-opacity="0.5"/>'
            f'<polyline fill="none" stroke="{_MEM}" stroke-width="1.5" points="{pts}"/>'
            f'<line x1="{pad}" x2="{width - 10}" y1="{held_y:.1f}" y2="{held_y:.1f}" '
            f'stroke="#999" stroke-dasharray="4 3"/>'
            f'<text x="{pad}" y="14" font-size="11">peak {_fmt_bytes(top)}</text>'
            f'<text x="{width - 10}" y="{held_y - 4:.1f}" font-size="11" text-anchor="end">'
            f"held for the whole call: {_fmt_bytes(held)}</text>"
            f'<text x="{pad}" y="{height - 6}" font-size="11">program order '
            f"({len(total)} operations) &#8594;</text></svg>")


def _gantt_svg(pipeline: dict) -> str:
    """The pipeline's schedule, one row per stage and one column per tick or slot: forward
    slots in blue, backward (input gradient) in orange, weight gradient in green, idle blank."""
    rows = slots(Schedule(pipeline["schedule"]), pipeline["stages"], pipeline["microbatches"],
                 pipeline.get("virtual_stages", 1))
    n = len(rows[0])
    label_w, cell_h = 70, 22
    cell_w = max(min((760 - label_w) / n, 48), 6)
    parts = []
    for s, row in enumerate(rows):
        y = 8 + s * (cell_h + 4)
        parts.append(f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end" font-size="12">'
                     f"stage {s}</text>")
        for t, slot in enumerate(row):
            kinds = slot.split()
            for j, kind in enumerate(kinds):
                h = cell_h / len(kinds)
                color = {"F": _COMPUTE, "W": _MEM}.get(kind[0], _COMM)
                parts.append(
                    f'<rect x="{label_w + t * cell_w:.1f}" y="{y + j * h:.1f}" '
                    f'width="{cell_w - 1:.1f}" height="{h:.1f}" fill="{color}">'
                    f"<title>tick {t}: {html.escape(kind)}</title></rect>")
            if slot and cell_w >= 30:
                parts.append(f'<text x="{label_w + t * cell_w + 3:.1f}" y="{y + 14}" '
                             f'font-size="10" fill="#fff">{html.escape(slot)}</text>')
    height = 16 + len(rows) * (cell_h + 4)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + n * cell_w + 10:.0f}" '
            f'height="{height}">' + "".join(parts) + "</svg>")


def _pipeline_section(plan) -> list[str]:
    p = plan.pipeline
    if p is None:
        return []
    return ["<h2>Pipeline schedule</h2>",
            "<pre>" + html.escape("\n".join(_pipeline_lines(p)[1:])) + "</pre>",
            (f'<div class="legend"><span style="background:{_COMPUTE}"></span>forward'
             f'<span style="background:{_COMM}"></span>backward (ticks left to right)</div>'),
            _gantt_svg(p)]


def render_html(plan, baselines: dict | None = None) -> str:
    """The report as a self-contained HTML page."""
    mesh = dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape))
    rows = layer_rows(plan)
    held, live = memory_over_program(plan)
    candidates = [("autopar", plan)] + list((baselines or {}).items())
    est = _table(["plan", "step time", "compute", "communication", "wire bytes", "peak memory"],
                 [[name, _fmt_s(p.estimate.step_time_s), _fmt_s(p.estimate.compute_time_s),
                   _fmt_s(p.estimate.comm_time_s), _fmt_bytes(p.estimate.comm_bytes),
                   _fmt_bytes(p.estimate.peak_memory_bytes)] for name, p in candidates])
    layers = _table(["layer", "state", "compute", "communication", "collectives"],
                    [[r.name, _fmt_bytes(r.state_bytes), _fmt_s(r.compute_s), _fmt_s(r.comm_s),
                      f"{r.collectives} ({_fmt_bytes(r.comm_bytes)})"] for r in rows])
    params = _table(["parameter", "PartitionSpec"],
                    [[p, _spec_str(s)] for r in rows for p, s in r.params], left=2)
    ins, outs = outside_layers(plan, {p for r in rows for p, _ in r.params})
    others = _table(["value", "PartitionSpec"],
                    [[f"input {p}", _spec_str(s)] for p, s in ins]
                    + [[f"output {p}", _spec_str(s)] for p, s in outs], left=2)
    fallbacks = ", ".join(f"{p} ({n})" for p, n in sorted(plan.fallbacks.items())) or "none"
    body = [
        (f"<h1>autopar plan on mesh {html.escape(str(mesh))}, hardware "
         f"<code>{html.escape(plan.hardware)}</code></h1>"),
        ("<p>Predictions per device. <code>plan.validate()</code> or <code>autopar report "
         "--validate</code> checks them against the compiled program.</p>"),
        "<h2>Estimate" + (" beside baselines" if baselines else "") + "</h2>", est,
        "<h2>Time per layer</h2>",
        (f'<div class="legend"><span style="background:{_COMPUTE}"></span>compute'
         f'<span style="background:{_COMM}"></span>communication</div>'), _bars_svg(rows),
        *_pipeline_section(plan),
        "<h2>Memory over the program</h2>", _memory_svg(held, live),
        ("<pre>" + html.escape("\n".join(_remat_lines(plan.stats.get("remat"))[1:])) + "</pre>"
         if plan.stats.get("remat") else ""),
        "<h2>Per layer</h2>", layers,
        "<h2>Parameter shardings</h2>", params,
        "<h2>Other inputs and outputs</h2>", others,
        "<h2>Collectives chosen</h2>",
        "<pre>" + html.escape("\n".join(_collective_lines(plan))) + "</pre>",
        (f"<h2>Fallbacks</h2><p>Primitives with no sharding rule (planned replicated): "
         f"{html.escape(fallbacks)}</p>"),
    ]
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>autopar plan</title>"
            f"<style>{_CSS}</style></head><body>" + "\n".join(body) + "</body></html>\n")
