"""The plan's report: parameter shardings, the collectives chosen and why, and fallbacks."""

from __future__ import annotations

from collections import defaultdict

import jax


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _fmt_s(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t >= 1e-4 else f"{t * 1e6:.1f} us"


def _spec_str(pspec) -> str:
    return "P(" + ", ".join(repr(e) for e in pspec) + ")"


def render_text(plan, baselines: dict | None = None) -> str:
    """The report. ``baselines``: {name: Plan} of baseline shardings to show beside it."""
    mesh = dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape))
    e = plan.estimate
    lines = [f"autopar plan on mesh {mesh}, hardware profile `{plan.hardware}`",
             "",
             "Estimate per device (a prediction; `validate` checks it against compiled HLO):",
             (f"  step time    {_fmt_s(e.step_time_s)}  (compute {_fmt_s(e.compute_time_s)}, "
              f"communication {_fmt_s(e.comm_time_s)})"),
             f"  flops        {e.flops:.4g}",
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
    if baselines:
        lines += ["",
                  "Beside hand-written baselines (autopar's prediction of each jax.jit program):",
                  f"  {'plan':<16}{'step time':>12}{'compute':>12}{'comm':>12}{'peak memory':>14}"]
        for name, p in [("autopar", plan)] + list(baselines.items()):
            b = p.estimate
            lines.append(f"  {name:<16}{_fmt_s(b.step_time_s):>12}{_fmt_s(b.compute_time_s):>12}"
                         f"{_fmt_s(b.comm_time_s):>12}{_fmt_bytes(b.peak_memory_bytes):>14}")
    layered = set()
    if plan._details is not None:
        from autopar._layers import layer_rows
        rows = layer_rows(plan)
        layered = {path for r in rows for path, _ in r.params}
        lines += ["", "Per layer (per device; optimizer state follows its parameter):",
                  f"  {'layer':<20}{'state':>12}{'compute':>12}{'comm':>12}{'collectives':>24}"]
        for r in rows:
            lines.append(f"  {r.name:<20}{_fmt_bytes(r.state_bytes):>12}{_fmt_s(r.compute_s):>12}"
                         f"{_fmt_s(r.comm_s):>12}{f'{r.collectives} ({_fmt_bytes(r.comm_bytes)})':>24}")
            width = max([len(p) for p, _ in r.params] + [4])
            lines += [f"      {p:<{width}}  {_spec_str(spec)}" for p, spec in r.params]
            lines += [f"      attention {label}" for label in r.attention]
    rest, outs = outside_layers(plan, layered)
    width = max([len(p) for p, _ in rest + outs] + [4])
    lines += ["", "Input shardings (other than parameters and their optimizer state):"]
    lines += [f"  {path:<{width}}  {_spec_str(s)}" for path, s in rest] or ["  none"]
    lines += ["", "Output shardings (new parameters and optimizer state keep their inputs'):"]
    lines += [f"  {path:<{width}}  {_spec_str(s)}" for path, s in outs] or ["  none"]
    if plan._details is not None:
        lines += ["", "Collectives chosen (grouped by where they come from):"]
        lines += _collective_lines(plan)
    lines += _option_lines(plan.stats.get("compiler_options"))
    lines += ["", "Fallbacks (primitives with no sharding rule, planned replicated):"]
    lines += [f"  {p}: {n} use(s)" for p, n in sorted(plan.fallbacks.items())] or ["  none"]
    st = plan.stats
    if st:
        lines += ["", f"Planner: {st.get('nodes')} nodes, {st.get('ilp_groups')} ILP groups, "
                      f"{st.get('ilp_variables')} variables, {st.get('ilp_constraints')} "
                      f"constraints; solver {st.get('solver_status')}; times "
                      + ", ".join(f"{k} {v:.2f}s" for k, v in st.get("timings_s", {}).items())]
    return "\n".join(lines)


def _pipeline_lines(pipeline: dict | None) -> list[str]:
    if not pipeline:
        return []
    stages = ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}"
                       for a, b in pipeline["layer_ranges"])
    lines = ["", f"Pipeline over `{pipeline['axis']}`: {pipeline['stages']} stages (layers "
                 f"{stages}), {pipeline['schedule']}, {pipeline['microbatches']} microbatches, "
                 f"{pipeline['ticks']} ticks, predicted bubble {pipeline['bubble_fraction']:.1%}"]
    if pipeline.get("predicted_time_s") is not None:
        peaks = ", ".join(f"{b / 2**30:.2f}" for b in pipeline["stage_peak_bytes"])
        lines.append(f"  the pipelined layers take {pipeline['predicted_time_s'] * 1e3:.3f} ms of "
                     f"the step; per-stage peak {peaks} GiB")
    inner = pipeline.get("inner")
    if inner is not None:
        split = [s for s in inner["layer"] if s not in (None, "()")]
        lines.append(f"  each stage splits {len(split)} of its {len(inner['layer'])} layer "
                     f"parameters over the other axes; a microbatch's activation is "
                     f"{inner['carry'] if inner['carry'] not in (None, '()') else 'replicated'}")
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
        lines.append(f"  skip {', '.join(names)}: {why}")
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
    names = _layer_names(param_paths)

    def rest(paths, tree):
        return [(p or "(the whole result)", s.spec)
                for p, s in zip(paths, jax.tree_util.tree_leaves(tree))
                if not _in_layer(p, names)]
    return rest(plan.in_paths, plan.in_shardings), rest(plan.out_paths, plan.out_shardings)


def _layer_names(param_paths: set[str]) -> set[str]:
    from autopar._layers import _past_arg_index, layer_of_path
    return {layer_of_path(_past_arg_index(p)) for p in param_paths} - {None}


def _in_layer(path: str, names: set[str]) -> bool:
    """A path inside a layer: a parameter, its optimizer state, or its new value."""
    from autopar._layers import _past_arg_index, layer_of_path
    return layer_of_path(_past_arg_index(path)) in names


def _collective_lines(plan) -> list[str]:
    graph, _, _, comms = plan._details
    rows = defaultdict(lambda: [0, 0.0])
    for c in comms:
        if c.step.wire_bytes == 0:
            continue
        node = graph.nodes[c.node]
        why = ("partial result of " if c.reason == "reduce" else "operand reshard for ") + node.prim
        key = (c.step.kind.value, ",".join(c.step.axes), why, node.where or "-")
        rows[key][0] += c.trips
        rows[key][1] += c.step.wire_bytes * c.trips
    if not rows:
        return ["  none"]
    out = []
    for (kind, axes, why, where), (count, nbytes) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        out.append(f"  {kind:<15} over {axes:<12} x{count:<3} {_fmt_bytes(nbytes):>10}  "
                   f"{why} at {where}")
    return out
