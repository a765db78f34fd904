"""The plan's report as HTML: one self-contained page (inline CSS and SVG, no external
assets), or a fragment for notebooks. Every CSS rule is scoped under ``.autopar-report``, so
the report does not restyle the page around it.

It holds the plan in words, the mesh, the estimate beside baselines and the candidate plans,
the validation (when ``plan.validate()`` ran), time per layer, memory over the program with
its phases and the buffers live at the peak, a pipeline's schedule, each layer's parameters
with their shapes, the collectives by mesh axis and kind, and the planner's facts.
"""

from __future__ import annotations

import html
import math

from autopar._charts import (
    COMM,
    COMPUTE,
    PHASE_COLORS,
    candidate_bars,
    gantt,
    layer_bars,
    memory_chart,
)
from autopar._charts import mesh_diagram as _mesh_svg
from autopar._layers import has_layers, layer_rows
from autopar._mesh import axis_sizes
from autopar._report import (
    MemoryView,
    _option_lines,
    _pipeline_lines,
    _remat_lines,
    _shape_str,
    baseline_estimates,
    candidates,
    collective_groups,
    pipeline_collective_words,
    pipeline_search,
    hardware_words,
    memory_view,
    mesh_words,
    outside_layers,
)
from autopar._sizes import format_bytes, format_flops, format_seconds
from autopar.cost_model.spec import pspec_text
from autopar._summary import axis_words, summary_lines
from autopar._validate import validation_rows

ROOT_CLASS = "autopar-report"
#: Tables of more rows than this start folded.
_OPEN_ROWS = 40

_CSS = """
.autopar-report { font-family: system-ui, -apple-system, sans-serif; color: #222;
  max-width: 1100px; line-height: 1.4; }
.autopar-report h1 { font-size: 1.35em; margin: 0.2em 0 0.4em; }
.autopar-report h2 { font-size: 1.1em; margin: 1.5em 0 0.4em; border-bottom: 1px solid #ddd;
  padding-bottom: 2px; }
.autopar-report table { border-collapse: collapse; margin: 0.4em 0; }
.autopar-report td, .autopar-report th { border: 1px solid #d4d4d4; padding: 2px 8px;
  text-align: right; font-size: 0.88em; vertical-align: top; }
.autopar-report th { background: #f1f1f1; }
.autopar-report td.l, .autopar-report th.l { text-align: left; }
.autopar-report td.m { font-family: ui-monospace, monospace; text-align: left; }
.autopar-report tr.chosen td { font-weight: bold; background: #eef3f9; }
.autopar-report tr.flag td { background: #fde2e2; }
.autopar-report .legend span { display: inline-block; width: 12px; height: 12px;
  margin: 0 4px 0 14px; vertical-align: -1px; }
.autopar-report .words { background: #f5f8fc; border-left: 4px solid #4c78a8;
  padding: 0.5em 1em; margin: 0.5em 0; }
.autopar-report .words li { font-family: ui-monospace, monospace; font-size: 0.9em; }
.autopar-report .note { color: #555; font-size: 0.88em; }
.autopar-report pre { background: #f7f7f7; padding: 0.6em; white-space: pre-wrap;
  font-size: 0.85em; }
.autopar-report .words ul { margin: 0.3em 0; }
.autopar-report details { margin: 0.3em 0; }
.autopar-report summary { cursor: pointer; }
.autopar-report svg { display: block; max-width: 100%; height: auto; }
"""


def _table(header: list[str], rows: list[list], left: int = 1, mono: tuple[int, ...] = (),
           row_classes: list[str] | None = None, text: tuple[int, ...] = ()) -> str:
    """A table; columns before ``left`` and those in ``text`` or ``mono`` (monospace) are
    left-aligned, the others (numbers) right-aligned."""
    def cls(i, tag):
        if i in mono and tag == "td":
            return ' class="m"'
        return ' class="l"' if i < left or i in text or i in mono else ""

    def cell(tag, i, v):
        return f"<{tag}{cls(i, tag)}>{html.escape(str(v))}</{tag}>"
    out = ["<table><tr>" + "".join(cell("th", i, h) for i, h in enumerate(header)) + "</tr>"]
    for k, r in enumerate(rows):
        row_cls = f' class="{row_classes[k]}"' if row_classes and row_classes[k] else ""
        out.append(f"<tr{row_cls}>" + "".join(cell("td", i, v) for i, v in enumerate(r))
                   + "</tr>")
    return "\n".join(out) + "</table>"


def _legend(items: list[tuple[str, str]]) -> str:
    return ('<div class="legend">' + "".join(f'<span style="background:{c}"></span>'
                                             f"{html.escape(t)}" for c, t in items) + "</div>")


def _estimate_section(plan, baselines) -> list[str]:
    shown = baseline_estimates(plan, baselines)
    rows = [("autopar", plan.estimate)] + list(shown.items())
    out = ["<h2>Estimate per device" + (" beside hand-written baselines" if shown else "")
           + "</h2>",
           _table(["plan", "step time", "compute", "communication", "flops", "wire bytes",
                   "peak memory"],
                  [[name, format_seconds(e.step_time_s), format_seconds(e.compute_time_s),
                    format_seconds(e.comm_time_s), format_flops(e.flops),
                    format_bytes(e.comm_bytes), format_bytes(e.peak_memory_bytes)]
                   for name, e in rows],
                  row_classes=["chosen"] + [""] * (len(rows) - 1))]
    searched = pipeline_search(plan)
    if searched:
        out += ["<h2>Pipeline search</h2>",
                '<p class="note">Each candidate of <code>pipeline="auto"</code>: its predicted '
                "step time, and its compiled program's step on the simulated timeline and "
                "peak per device; the fastest compiled program that fits the memory budget is "
                "kept.</p>",
                _table(["candidate", "predicted", "compiled", "compiled peak"],
                       [list(row[:4]) for row in searched],
                       row_classes=["chosen" if chosen else "" for *_, chosen in searched])]
    found = candidates(plan.stats)
    if len(found) > 1 and not plan.pipeline:   # priced without the pipeline's stages
        out += ["<h2>Plans the planner compared</h2>",
                '<p class="note">Predicted step time of each plan the planner built (the ILP\'s '
                "and those propagated from each baseline's shardings); the fastest that fits "
                "the memory budget is kept.</p>", candidate_bars(found)]
    return out


def _validation_section(plan) -> list[str]:
    v = plan.stats.get("validation")
    if not v and plan._flat_fn is None:   # loaded: nothing here can compile it
        return ["<h2>Validation</h2>", '<p class="note">Not run before the plan was saved: '
                "<code>autopar report --validate --json</code> keeps its results.</p>"]
    if not v:
        return ["<h2>Validation</h2>", '<p class="note">Not run: <code>plan.validate()</code> '
                "or <code>autopar report --validate</code> compiles the plan and puts this "
                "prediction beside what XLA compiled.</p>"]
    rows = validation_rows(v)
    flags = ["flag" if note.startswith("<-") else "" for *_, note in rows]
    return ["<h2>Validation: predicted beside compiled</h2>",
            '<p class="note">Per device; ratio = predicted / compiled. Counts of one kind '
            "differ where XLA's combiner merged collectives that were ready together.</p>",
            _table(["measure", "predicted", "compiled", "ratio", "note"],
                   [list(r[:4]) + [r[4].removeprefix("<- ")] for r in rows],
                   row_classes=flags, text=(4,))]


def _memory_section(view: MemoryView) -> list[str]:
    return ["<h2>Memory over the program</h2>",
            _legend([(PHASE_COLORS[p], p) for p in ("forward", "backward", "optimizer")]
                     + [("#999", "held for the whole call (arguments, results)")]),
            memory_chart(view.held, list(view.live), view.phases, view.peak_at),
            "<p>The largest buffers live at the predicted peak (operation "
            f"{view.peak_op}):</p>",
            _table(["per device", "global shape", "what"],
                   [[format_bytes(n), shape, what] for n, shape, what in view.buffers],
                   left=0, mono=(2,))]



def _layer_section(plan, rows) -> list[str]:
    table = _table(["layer", "state", "compute", "communication", "collectives"],
                   [[r.name, format_bytes(r.state_bytes), format_seconds(r.compute_s),
                     format_seconds(r.comm_s), f"{r.collectives} ({format_bytes(r.comm_bytes)})"]
                    for r in rows])
    n_params = sum(len(r.params) for r in rows)
    params = (f"<details{' open' if n_params <= _OPEN_ROWS else ''}><summary>{n_params} "
              "parameters: global and per-device shapes</summary>"
              + _table(["layer", "parameter", "global shape", "per device", "PartitionSpec"],
                       [[r.name, p.path, _shape_str(p.shape), _shape_str(p.local_shape),
                         pspec_text(p.spec)] for r in rows for p in r.params],
                       left=2, mono=(1, 2, 3, 4)) + "</details>")
    ins, outs = outside_layers(plan, {p.path for r in rows for p in r.params})
    others = _table(["value", "PartitionSpec"],
                    [[f"input {p}", pspec_text(s)] for p, s in ins]
                    + [[f"output {p}", pspec_text(s)] for p, s in outs], left=2, mono=(1,))
    return ["<h2>Time per layer</h2>",
            _legend([(COMPUTE, "compute"), (COMM, "communication")]), layer_bars(rows),
            "<h2>Per layer</h2>", '<p class="note">Per device; optimizer state follows its '
            "parameter.</p>", table,
            "<h2>Parameter shardings</h2>", params,
            "<h2>Other inputs and outputs</h2>", others]


def _collective_section(plan) -> list[str]:
    found = collective_groups(plan)
    out = ["<h2>Collectives, by mesh axis and kind</h2>"]
    said = pipeline_collective_words(plan)
    if said:
        out.append(f"<p>{html.escape(said[0][0].upper() + said[0][1:])}.</p>")
    if not found:
        return out + ["<p>None outside the pipelined stack.</p>" if said else
                      "<p>None: the plan runs no collective.</p>"]
    for (axes, kind), groups in found.items():
        n = sum(g.count for g in groups)
        head = (f"{kind} over {axes}: {n} per step, "
                f"{format_bytes(sum(g.wire_bytes for g in groups))}, "
                f"{format_seconds(sum(g.time_s for g in groups))}")
        out.append(f"<details open><summary>{html.escape(head)}</summary>"
                   + _table(["count", "wire bytes", "time", "from"],
                            [[g.count, format_bytes(g.wire_bytes), format_seconds(g.time_s),
                              g.what] for g in groups], left=0, mono=(3,))
                   + "</details>")
    return out


def _planner_section(plan) -> list[str]:
    st = plan.stats
    solved = st.get("source") != "cached"   # a plan cache's plan solved no ILP here
    facts = [("graph nodes", st.get("nodes")), ("ILP groups", st.get("ilp_groups")),
             ("ILP variables", st.get("ilp_variables") if solved else None),
             ("ILP constraints", st.get("ilp_constraints") if solved else None),
             ("solver status", st.get("solver_status")), ("plan taken from", st.get("source")),
             ("ILP objective (its plan's makespan, as the ILP prices it)",
              format_seconds(st["ilp_objective_s"])
              if st.get("ilp_objective_s") is not None else None),
             ("ILP solves around its plan", st.get("ilp_overlap_solves")),
             ("collective matmuls the serial ILP took, dropped for a shorter plan",
              "yes" if st.get("rings_dropped") else None),
             ("state kept between steps in its update's sharding (arrays)",
              st.get("state_at_rest") or None),
             ("memory budget", format_bytes(st["memory_budget_bytes"])
              if st.get("memory_budget_bytes") else None)]
    facts += [(f"time: {k}", format_seconds(v)) for k, v in (st.get("timings_s") or {}).items()]
    fallbacks = ", ".join(f"{p} ({n})" for p, n in sorted(plan.fallbacks.items())) or "none"
    facts.append(("fallbacks (no sharding rule, replicated)", fallbacks))
    out = ["<h2>Planner</h2>",
           _table(["fact", "value"], [[k, v] for k, v in facts if v is not None], left=2)]
    options = _option_lines(st.get("compiler_options"))
    if options:
        out.append("<pre>" + html.escape("\n".join(options[1:])) + "</pre>")
    return out


def _header(plan) -> list[str]:
    sizes = axis_sizes(plan.mesh)
    words = summary_lines(plan)
    out = [f"<h1>autopar plan on mesh {html.escape(mesh_words(plan))}</h1>",
           f"<p>{_code_quotes(hardware_words(plan))}. Predictions are per device.</p>",
           '<div class="words"><b>The plan in words</b><ul>'
           + "".join(f"<li>{html.escape(w)}</li>" for w in words) + "</ul></div>"]
    if has_layers(plan):
        ids = plan._saved_device_ids() or range(math.prod(sizes.values()))
        out += ["<h2>Mesh</h2>", _mesh_svg(sizes, axis_words(plan), ids)]
    return out


def _code_quotes(text: str) -> str:
    """``text`` escaped, its `backquoted` parts as <code>."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def render_html(plan, baselines: dict | None = None, fragment: bool = False) -> str:
    """The report as a self-contained HTML page; ``fragment``: the ``<div>`` alone (with its
    scoped ``<style>``), for a notebook cell."""
    body = _header(plan) + _estimate_section(plan, baselines) + _validation_section(plan)
    if has_layers(plan):
        rows = layer_rows(plan)
        body += _layer_section(plan, rows)
        if plan.pipeline is not None:
            body += ["<h2>Pipeline schedule</h2>",
                     "<pre>" + html.escape("\n".join(_pipeline_lines(plan.pipeline)[1:]))
                     + "</pre>", _legend([(COMPUTE, "forward"), (COMM, "backward")]),
                     gantt(plan.pipeline)]
        body += _memory_section(memory_view(plan))
        if plan.stats.get("remat"):
            body.append("<pre>" + html.escape("\n".join(_remat_lines(plan.stats["remat"])[1:]))
                        + "</pre>")
        body += _collective_section(plan)
    else:   # loaded from a file that kept no explanation: its shardings, every leaf
        ins, outs = outside_layers(plan, set())
        body += ["<h2>Shardings</h2>", '<p class="note">Every leaf: a plan loaded from JSON '
                 "does not know which are parameters.</p>",
                 _table(["value", "PartitionSpec"],
                        [[f"input {p}", pspec_text(s)] for p, s in ins]
                        + [[f"output {p}", pspec_text(s)] for p, s in outs],
                        left=2, mono=(1,))]
    body += _planner_section(plan)
    div = (f'<div class="{ROOT_CLASS}"><style>{_CSS}</style>' + "\n".join(body) + "</div>")
    if fragment:
        return div
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>autopar plan</title>"
            "</head><body>" + div + "</body></html>\n")
