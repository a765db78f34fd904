"""The plan's report as text: the plan in words, the estimate, each layer's parameters with
their shapes, the collectives by mesh axis and kind, and what the planner did."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from collections import defaultdict
from dataclasses import dataclass

import jax
from jax.sharding import AbstractMesh

from autopar._layers import (
    OTHER,
    Phase,
    has_layers,
    input_layers,
    is_region,
    layer_rows,
    memory_over_program,
    node_layers,
    node_phases,
    peak_buffers,
    same_layer_groups,
)
from autopar._mesh import axis_sizes, mesh_text
from autopar._sizes import format_bytes, format_flops, format_seconds
from autopar._summary import summary_lines
from autopar._validate import validation_table
from autopar.cost_model.spec import pspec_text
from autopar.passes.estimate import Estimate

#: The report's line width where it wraps a long list.
_WIDTH = 100

_fmt_bytes, _fmt_s, fmt_flops = format_bytes, format_seconds, format_flops


def _shape_str(shape) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def mesh_words(plan) -> str:
    """``data=2 x model=4 (8 devices)``, and how many are not in this process (a loaded plan's
    mesh without devices)."""
    n = plan.mesh.size
    absent = ""
    if isinstance(plan.mesh, AbstractMesh):
        here = {d.id for d in jax.devices()}
        missing = sum(i not in here for i in plan._device_ids) if plan._device_ids else n
        absent = (", not in this process" if missing == n
                  else f", {missing} of them not in this process")
    return f"{mesh_text(plan.mesh)} ({n} device{'s' if n != 1 else ''}{absent})"


def hardware_words(plan) -> str:
    """The profile the costs came from, and whether it was the default."""
    if plan.stats.get("hardware_default") and plan._flat_fn is None:   # loaded
        return (f"hardware profile `{plan.hardware}` (the default of the backend it was "
                "planned on)")
    if plan.stats.get("hardware_default"):
        return (f"hardware profile `{plan.hardware}` (the default, this backend's; pass "
                "hardware=... or --hardware to plan for another)")
    return f"hardware profile `{plan.hardware}`"


def render_text(plan, baselines: dict | None = None) -> str:
    """The report. ``baselines``: {name: Plan} of baseline shardings to show beside it."""
    e = plan.estimate
    lines = [f"autopar plan on mesh {mesh_words(plan)}, {hardware_words(plan)}", ""]
    lines += ["The plan in words:"] + [f"  {s}" for s in summary_lines(plan)]
    lines += ["",
              "Estimate per device (a prediction; `validate` checks it against compiled HLO):",
              (f"  step time    {_fmt_s(e.step_time_s)}  (compute {_fmt_s(e.compute_time_s)}, "
               f"communication {_fmt_s(e.comm_time_s)})"),
              f"  flops        {fmt_flops(e.flops)}",
              f"  wire bytes   {_fmt_bytes(e.comm_bytes)}",
              f"  peak memory  {_fmt_bytes(e.peak_memory_bytes)}"]
    if plan.donate_argnums:
        lines.append(f"  donated      argument(s) {', '.join(map(str, plan.donate_argnums))}: "
                     "their buffers are reused for the results")
    lines += _remat_lines(plan.stats.get("remat"))
    lines += _pipeline_lines(plan.pipeline)
    checks = plan.stats.get("memory_checks")
    if checks:
        lines.append(f"  compiled     peak memory {_fmt_bytes(checks[-1]['compiled_bytes'])} "
                     "per device as XLA compiled it (`memory_analysis()`)"
                     + (f", after {len(checks) - 1} plan(s) that compiled over the budget"
                        if len(checks) > 1 else ""))
    lines += _exportable_compiled_lines(plan.stats.get("exportable"))
    lines += _baseline_lines(plan, baselines)
    lines += _pipeline_search_lines(plan)
    lines += _exportable_lines(plan.stats.get("exportable"))
    if not plan.pipeline:   # the candidates are priced without the pipeline's stages
        lines += _candidate_lines(plan.stats)
    layered = set()
    if has_layers(plan):
        rows = layer_rows(plan)
        layered = {p.path for r in rows for p in r.params}
        lines += ["", "Per layer (per device; optimizer state follows its parameter):",
                  f"  {'layer':<20}{'state':>12}{'compute':>12}{'comm':>12}{'collectives':>24}"]
        for r in rows:
            lines.append(f"  {r.name:<20}{_fmt_bytes(r.state_bytes):>12}{_fmt_s(r.compute_s):>12}"
                         f"{_fmt_s(r.comm_s):>12}{f'{r.collectives} ({_fmt_bytes(r.comm_bytes)})':>24}")
            lines += _param_lines(r.params)
            if r.rewrites:
                lines.append("      overlapped: " + ", ".join(
                    f"{n} {kind}" for kind, n in sorted(r.rewrites.items())))
            lines += [f"      attention {label}" for label in r.attention]
    rest, outs = outside_layers(plan, layered)
    width = max([len(p) for p, _ in rest + outs] + [4])
    if not has_layers(plan):   # loaded from a file that kept no explanation
        heads = ("Input shardings (every leaf: a plan loaded from JSON does not know which are "
                 "parameters):", "Output shardings (every leaf):")
    else:
        heads = ("Input shardings (other than parameters and their optimizer state):",
                 "Output shardings (new parameters and optimizer state keep their inputs'):")
    lines += ["", heads[0]]
    lines += [f"  {path:<{width}}  {pspec_text(s)}" for path, s in rest] or ["  none"]
    lines += ["", heads[1]]
    lines += [f"  {path:<{width}}  {pspec_text(s)}" for path, s in outs] or ["  none"]
    if has_layers(plan):
        lines += ["", "Collectives chosen, by mesh axis and kind (per device and step):"]
        lines += _collective_lines(plan)
        lines += [f"  {line}" for line in pipeline_collective_words(plan)]
    lines += _option_lines(plan.stats.get("compiler_options"))
    lines += ["", "Fallbacks (primitives with no sharding rule, planned replicated):"]
    lines += [f"  {p}: {n} use(s)" for p, n in sorted(plan.fallbacks.items())] or ["  none"]
    lines += _planner_lines(plan.stats)
    if plan.stats.get("validation"):
        lines += ["", validation_table(plan, plan.stats["validation"])]
    return "\n".join(lines)


def _param_lines(params) -> list[str]:
    if not params:
        return []
    width = max(len(p.path) for p in params)
    shapes = [f"{_shape_str(p.shape)} -> {_shape_str(p.local_shape)}"
              if p.shape != p.local_shape else _shape_str(p.shape) for p in params]
    swidth = max(len(s) for s in shapes)
    return [f"      {p.path:<{width}}  {s:<{swidth}}  {pspec_text(p.spec)}"
            for p, s in zip(params, shapes)]


def baseline_estimates(plan, baselines: dict | None) -> dict[str, Estimate]:
    """{name: Estimate} of the baselines shown beside ``plan``: those given ({name: Plan}),
    else those saved with it (``stats["baselines"]``, which ``autopar report --json``
    writes: :func:`with_baselines`)."""
    if baselines:
        return {name: p.estimate for name, p in baselines.items()}
    return {name: Estimate(**d) for name, d in (plan.stats.get("baselines") or {}).items()}


def with_baselines(plan, baselines: dict | None):
    """``plan`` with the estimates of ``baselines`` ({name: Plan}) in its statistics, so that
    the plan it saves shows them beside it when loaded (:func:`baseline_estimates`)."""
    if not baselines:
        return plan
    kept = {name: p.estimate.to_dict() for name, p in baselines.items()}
    return dataclasses.replace(plan, stats={**plan.stats, "baselines": kept})


def _baseline_lines(plan, baselines) -> list[str]:
    shown = baseline_estimates(plan, baselines)
    if not shown:
        return []
    lines = ["", "Beside hand-written baselines (autopar's prediction of each jax.jit program):",
             f"  {'plan':<16}{'step time':>12}{'compute':>12}{'comm':>12}{'peak memory':>14}"]
    for name, b in [("autopar", plan.estimate)] + list(shown.items()):
        lines.append(f"  {name:<16}{_fmt_s(b.step_time_s):>12}{_fmt_s(b.compute_time_s):>12}"
                     f"{_fmt_s(b.comm_time_s):>12}{_fmt_bytes(b.peak_memory_bytes):>14}")
    return lines


def candidates(stats: dict) -> list[tuple[str, float, bool]]:
    """(name, predicted step time, chosen) of each plan the planner compared, fastest first."""
    times = stats.get("candidates_step_s") or {}
    chosen = stats.get("solver_status")
    return sorted(((n, t, n == chosen) for n, t in times.items()), key=lambda c: c[1])


def _candidate_lines(stats: dict) -> list[str]:
    found = candidates(stats)
    if len(found) < 2:
        return []
    lines = ["", "Plans the planner compared (predicted step time; the fastest that fits is kept):"]
    lines += [f"  {'*' if chosen else ' '} {name:<28}{_fmt_s(t):>12}" for name, t, chosen in found]
    return lines


def _planner_lines(st: dict) -> list[str]:
    if not st:
        return []
    said = f"Planner: {st.get('nodes')} nodes, {st.get('ilp_groups')} ILP groups"
    if st.get("source") == "cached":
        said += "; the plan cache's plan (no ILP solved)"
    else:
        said += (f", {st.get('ilp_variables')} variables, {st.get('ilp_constraints')} "
                 f"constraints; solver {st.get('solver_status')} (plan from "
                 f"{st.get('source', '?')})")
    times = ", ".join(f"{k} {v:.2f} s" for k, v in st.get("timings_s", {}).items())
    return ["", said + (f"; times {times}" if times else "")]


def _pipeline_lines(pipeline: dict | None) -> list[str]:
    if not pipeline:
        return []
    stages = ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}"
                       for a, b in pipeline["layer_ranges"])
    lines = ["", f"Pipeline over `{pipeline['axis']}`: {pipeline['stages']} stages (layers "
                 f"{stages}), {pipeline['schedule']}, {pipeline['microbatches']} microbatches, "
                 f"{pipeline['ticks']} ticks, predicted bubble {pipeline['bubble_fraction']:.1%}"]
    if pipeline.get("predicted_time_s") is not None:
        peaks = pipeline["stage_peak_bytes"]
        said = (f"peak {_fmt_bytes(peaks[0])} on every stage (one SPMD program: each device "
                "holds the same buffers)" if len(set(peaks)) == 1 else
                "per-stage peak " + ", ".join(_fmt_bytes(b) for b in peaks))
        lines.append(f"  the pipelined layers take {_fmt_s(pipeline['predicted_time_s'])} of "
                     f"the step; {said}")
    inner = pipeline.get("inner")
    if inner is not None:
        lines.append(f"  each stage splits {_split(inner['layer'])} of its "
                     f"{len(inner['layer'])} layer parameters over the other axes; a "
                     f"microbatch's activation is "
                     f"{inner['carry'] if inner['carry'] not in (None, '()') else 'replicated'}")
    post = pipeline.get("post")
    if post is not None:
        lines.append(f"  the head and loss run in the region, {_fmt_s(post['time_s'])} a "
                     f"microbatch; they split {_split(post['inputs'])} of their inputs over "
                     f"the other axes")
    return lines


def _split(specs: list) -> int:
    """How many of a pipeline record's specs (as text) split their value."""
    return sum(s not in (None, "()") for s in specs)


def pipeline_search(plan) -> list[tuple[str, str, str, str, bool]]:
    """``pipeline="auto"``'s candidates, when it compared two or more: (candidate, its
    estimate or why it cannot pipeline, its compiled program's simulated step and peak per
    device or "", chosen)."""
    tried = plan.stats.get("pipeline_search") or {}
    if len(tried) < 2:
        return []
    compiled = plan.stats.get("pipeline_search_compiled") or {}
    peaks = plan.stats.get("pipeline_search_compiled_peak_bytes") or {}
    kept = "none" if not plan.pipeline else plan.pipeline["axis"]
    return [("no pipeline" if name == "none" else f"stages over {name}",
             f"cannot pipeline: {t}" if isinstance(t, str) else _fmt_s(t),
             _fmt_s(compiled[name]) if name in compiled else "",
             format_bytes(peaks[name]) if name in peaks else "", name == kept)
            for name, t in tried.items()]


def _pipeline_search_lines(plan) -> list[str]:
    found = pipeline_search(plan)
    if list(plan.stats.get("pipeline_search") or {}) == ["none"]:
        return ["", "Pipeline search (pipeline=\"auto\"): no axis was tried, as none is on a "
                    "slower link than the mesh's fastest and the plan without a pipeline fits; "
                    "pass pipeline=autopar.Pipeline(axis=...) (CLI: --pipeline AXIS) to "
                    "pipeline over one anyway."]
    if not found:
        return []
    lines = ["", "Pipeline search (pipeline=\"auto\"; predicted, and the compiled program "
                 "simulated and its peak; the fastest compiled program that fits is kept):"]
    lines += [f"  {'*' if chosen else ' '} {label:<22}{predicted:>12}{compiled:>14}{peak:>12}"
              for label, predicted, compiled, peak, chosen in found]
    return lines


def _exportable_compiled_lines(exportable: dict | None) -> list[str]:
    """The kept program's compiled peak and simulated step, beside the estimate's: an
    exportable plan's estimate prices the plan as autopar would emit it, with the shardings it
    propagates itself, and XLA may propagate others under plain ``jax.jit``."""
    if not exportable:
        return []
    chosen = exportable["chosen"]
    return [f"  compiled     peak memory {_fmt_bytes(exportable['peak_bytes'][chosen])} per device "
            f"as XLA compiled it under plain jax.jit ({chosen}'s shardings, kept)",
            f"  compiled     step time {_fmt_s(exportable['step_s'][chosen])}, that program "
            f"simulated (the step time above prices the plan as autopar emits it)"]


def _exportable_lines(exportable: dict | None) -> list[str]:
    """``plan(..., exportable=True)``'s candidates: each one's program under plain
    ``jax.jit``, simulated, and its compiled peak; and the searched plan's own program."""
    if not exportable:
        return []
    lines = ["", "Exportable (plain jax.jit with each candidate's argument and result "
                 "shardings, compiled and simulated; the fastest that fits is kept):"]
    lines += [f"  {'*' if name == exportable['chosen'] else ' '} {name:<22}"
              f"{_fmt_s(t):>12}{format_bytes(exportable['peak_bytes'][name]):>12}"
              for name, t in sorted(exportable["step_s"].items(), key=lambda item: item[1])]
    pinned = exportable.get("pinned_step_s")
    if pinned is not None:
        lines.append(f"  the searched plan with its intermediate shardings pinned (plan.jit() "
                     f"of exportable=False): {_fmt_s(pinned)}")
    return lines


def _option_lines(notes: list[dict] | None) -> list[str]:
    """The XLA options considered (``stats["compiler_options"]``): set and why, or skipped."""
    if notes is None:
        return []
    chosen = [n for n in notes if n["set"]]
    lines = ["", "XLA compiler options (plan.compiler_options; never XLA_FLAGS):"]
    lines += [f"  set  {n['name']}={n['value']}: {n['why']}" for n in chosen] or ["  none set"]
    skipped: dict[str, list[str]] = {}   # why -> the options skipped for that reason
    for n in notes:
        if not n["set"]:
            skipped.setdefault(n["why"], []).append(f"{n['name']}={n['value']}")
    for why, names in skipped.items():
        lines += textwrap.wrap(f"skip {', '.join(names)}: {why}", width=_WIDTH,
                               initial_indent="  ", subsequent_indent="       ",
                               break_on_hyphens=False)
    return lines


def _remat_lines(remat: dict | None) -> list[str]:
    if not remat:
        return []
    from autopar.passes.remat import RematPolicy
    policy = RematPolicy(remat["policy"])
    return ["", "Rematerialized layers (recomputed in the backward pass):",
            f"  {', '.join(remat['layers'])}",
            f"  policy {policy.value}: {policy.described}"]


def outside_layers(plan, param_paths: set[str]) -> tuple[list, list]:
    """(path, PartitionSpec) of the inputs and of the outputs that are not in a layer (not a
    parameter, its optimizer state or its new value): the batch, step counters, the loss."""
    if plan._in_tree is not None:
        names, _ = input_layers(plan._in_tree, [a.shape for a in plan._arg_avals])
        in_layer = {p for p, n in zip(plan.in_paths, names) if n is not None}
    elif plan._explained is not None:
        in_layer = set(plan._explained.layer_inputs)
    else:
        in_layer = set(param_paths)
    ins = [(p or "(the whole argument)", s.spec)
           for p, s in zip(plan.in_paths, jax.tree_util.tree_leaves(plan.in_shardings))
           if p not in in_layer]
    outs = [(p or "(the whole result)", s.spec)
            for p, s in zip(plan.out_paths, jax.tree_util.tree_leaves(plan.out_shardings))
            if p not in in_layer]
    return ins, outs


# ----- memory
@dataclass(frozen=True)
class MemoryView:
    """The memory over the program as the report draws it, per device: the bytes held for the
    whole call, the other live bytes at each point of the program and its phase, the point of
    the predicted peak (``peak_at``, and ``peak_op``, the operation it is), and the largest
    buffers live there as (bytes, global shape, what)."""
    held: int
    live: tuple[int, ...]
    phases: tuple[Phase, ...]
    peak_at: int
    peak_op: int
    buffers: tuple[tuple[int, str, str], ...]


def memory_view(plan) -> MemoryView | None:
    """``plan``'s :class:`MemoryView`: from its traced program, or as it was saved (None for a
    loaded plan from a file that kept no explanation)."""
    if plan._details is None:
        return None if plan._explained is None else plan._explained.memory
    held, live = memory_over_program(plan)
    graph = plan._details[0]
    phases, labels = node_phases(graph), node_layers(plan)
    at, buffers = peak_buffers(plan)
    rows = []
    for b in buffers:
        if b.node is None:
            rows.append((b.nbytes, _shape_str(b.shape), f"argument {b.path}"))
        else:
            node = graph.nodes[b.node]
            where = place_words(node.where, labels[node.id], phases[node.id])
            rows.append((b.nbytes, "-" if b.what else _shape_str(b.shape),
                         b.what or f"{node.prim} in {where}"))
    return MemoryView(held, tuple(live), tuple(phases), at, at, tuple(rows))


# ----- collectives
@dataclass
class CollectiveGroup:
    """Collectives of one kind over one set of axes, from one place, summed per step."""
    kind: str
    axes: str
    what: str        # "backward of block_*/mlp_out: partial sums of dot_general"
    count: int = 0
    wire_bytes: float = 0.0
    time_s: float = 0.0


def _star_names(plan) -> dict[str, str]:
    """Layer name -> how a collective's place names it: like layers share a ``stem*`` name."""
    names, _ = input_layers(plan._in_tree, [a.shape for a in plan._arg_avals])
    out = {}
    for group in same_layer_groups(list(dict.fromkeys(n for n in names if n))):
        if len(group) > 1:
            out.update({n: re.sub(r"\d+(\]?)$", r"*\1", n) for n in group})
    return out


def _starred(stars: dict[str, str]):
    """A function putting each layer name in a path as ``stars`` names it."""
    if not stars:
        return lambda path: path
    pattern = re.compile(r"(?<![\w\[])(" + "|".join(
        re.escape(n) for n in sorted(stars, key=len, reverse=True)) + r")(?![\w\[])")
    return lambda path: pattern.sub(lambda m: stars[m.group(1)], path)


def place_words(where: str, layer: str, phase: Phase, star=None) -> str:
    """Where an operation comes from, in words: ``transpose(jvp(GPT))/block_1/mlp_out`` ->
    ``backward of block_*/mlp_out``; an operation with no source path is named by its layer.
    ``star``: :func:`_starred`'s function, naming like layers alike."""
    parts = [p for p in where.split("/") if p]
    if parts and "(" in parts[0]:
        parts = parts[1:]
    path = "/".join(parts) if parts and "/" in where else (layer if layer != OTHER else "")
    path = star(path) if star is not None else path
    path = path or ("the loss" if "jvp(" in where else "outside the layers")
    return {Phase.BACKWARD: f"backward of {path}", Phase.OPTIMIZER: f"optimizer update of {path}",
            Phase.FORWARD: path}[phase]


def collective_groups(plan) -> dict[tuple[str, str], list[CollectiveGroup]]:
    """(axes, kind) -> the groups of collectives over those axes of that kind, largest first;
    a loaded plan's are those it was saved with."""
    if plan._details is None:
        return plan._explained.collectives
    graph, _, _, comms = plan._details
    labels, phases, star = node_layers(plan), node_phases(graph), _starred(_star_names(plan))
    groups: dict[tuple, CollectiveGroup] = {}
    for c in comms:
        if c.step.wire_bytes == 0:
            continue
        node = graph.nodes[c.node]
        why = {"reduce": f"partial sums of {node.prim}",
               "overlap": f"overlapped in {node.prim}"}.get(
                   c.reason, f"an operand of {node.prim} resharded")
        what = f"{place_words(node.where, labels[node.id], phases[node.id], star)}: {why}"
        if is_region(node) and c.reason == "reduce":
            what = "the pipelined stack's results and gradients summed over its stages"
        key = (",".join(c.step.axes), c.step.kind.value, what)
        g = groups.setdefault(key, CollectiveGroup(key[1], key[0], what))
        g.count += c.trips
        g.wire_bytes += c.step.wire_bytes * c.trips
        g.time_s += c.time_s * c.trips
    out: dict[tuple[str, str], list[CollectiveGroup]] = defaultdict(list)
    for g in sorted(groups.values(), key=lambda g: -g.wire_bytes):
        out[(g.axes, g.kind)].append(g)
    return dict(sorted(out.items(), key=lambda kv: -sum(g.wire_bytes for g in kv[1])))


#: Groups listed per (axes, kind) in the text report; the rest are summed in one line.
_SHOWN = 6


def _collective_lines(plan) -> list[str]:
    found = collective_groups(plan)
    if not found:
        return ["  none" + (" outside the pipelined stack" if plan.pipeline else "")]
    sizes = axis_sizes(plan.mesh)
    out = []
    for (axes, kind), groups in found.items():
        n = sum(g.count for g in groups)
        total = sum(g.wire_bytes for g in groups)
        group_size = 1
        for a in axes.split(","):
            group_size *= sizes.get(a, 1)
        out.append(f"  {kind} over {axes} (groups of {group_size}): {n} per step, "
                   f"{_fmt_bytes(total)}, {_fmt_s(sum(g.time_s for g in groups))}")
        for g in groups[:_SHOWN]:
            out.append(f"    x{g.count:<3} {_fmt_bytes(g.wire_bytes):>10}  {g.what}")
        if len(groups) > _SHOWN:
            rest = groups[_SHOWN:]
            out.append(f"    x{sum(g.count for g in rest):<3} "
                       f"{_fmt_bytes(sum(g.wire_bytes for g in rest)):>10}  "
                       f"from {len(rest)} other places")
    return out


def pipeline_collective_words(plan) -> list[str]:
    """What the pipelined stack sends (the collectives above are the rest of the program's),
    or nothing for a plan that does not pipeline."""
    p = plan.pipeline
    if p is None:
        return []
    return [f"inside the pipelined stack: each microbatch's activation sent on and its "
            f"gradient sent back over `{p['axis']}` (collective-permute), and the collectives "
            f"of the stage's layers, {format_bytes(p.get('comm_bytes') or 0)} in all"]
