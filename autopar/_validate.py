"""Prediction beside ground truth: the plan's estimate against its compiled HLO.

:func:`validate` compiles the plan and reads the program XLA made (``cost_model.hlo``):
per collective kind, how many run and the wire bytes they move; per-device flops (loop bodies at
their trip counts); peak memory.
Each sits beside the plan's own prediction.

A collective kind is flagged when XLA runs something the plan did not price:

* a kind the plan does not predict at all;
* more than ``_EXCESS`` times the predicted wire bytes of a kind.

Counts alone are not flagged: XLA's combiner merges collectives of one kind into fewer, and a
region's loop runs one as several steps (a ring's rotations), moving the same bytes; a note
says which.

Each of those is resharding the plan missed: a bug in a rule or in the redistribution planner.
A pipelined stack's collectives are predicted from its layer's plans (the forward alone, and
the forward and backward) at the passes its loops run. XLA partitions a stage's layers from
the stage's input specs alone, not pinned to the layer plan's intermediates, so there it can
sum or gather where that plan did not; a flag on a pipelined plan says so.

A pipelined plan also gets its schedule beside the compiled program: the predicted ticks beside
the trip counts of the loops that run collective-permutes, and the per-stage peak beside the
compiled peak.
"""

from __future__ import annotations

from autopar._sizes import format_bytes, format_flops
from autopar._stack import with_roomy_stack
from autopar.cost_model.hlo import CollectiveKind, analyze, permute_loops
from autopar.passes.estimate import by_kind
from autopar.passes.stages.schedules import TABLED, Schedule, tick_loops

#: Compiled wire bytes of a kind over this multiple of the prediction are flagged.
_EXCESS = 1.10


def _with_stages(predicted: dict, pipeline: dict | None) -> dict[str, tuple[int, float]]:
    """``predicted`` with a pipelined stack's collectives: its layers' own, as its loops run
    them, and its stage-to-stage sends as collective-permutes."""
    if not pipeline:
        return predicted
    out = dict(predicted)
    extra = dict(pipeline.get("layer_collectives") or {})
    if pipeline.get("sends"):
        count, nbytes = extra.get(CollectiveKind.COLLECTIVE_PERMUTE.value, (0, 0.0))
        extra[CollectiveKind.COLLECTIVE_PERMUTE.value] = (count + pipeline["sends"],
                                                          nbytes + pipeline["send_bytes"])
    for kind, (count, nbytes) in extra.items():
        have = out.get(kind, (0, 0.0))
        out[kind] = (have[0] + count, have[1] + nbytes)
    return out


def flag_kinds(predicted: dict, compiled: dict) -> dict[str, str]:
    """Kind -> why it is flagged, for each compiled kind the prediction does not cover."""
    flags = {}
    for kind, (count, nbytes) in compiled.items():
        p_count, p_bytes = predicted.get(kind, (0, 0.0))
        if kind not in predicted:
            flags[kind] = "not predicted"
        elif nbytes > _EXCESS * p_bytes:
            flags[kind] = f"{nbytes / p_bytes:.2f}x the predicted bytes"
    return flags


def count_note(kind: str, predicted: tuple, compiled: tuple) -> str:
    """Why XLA runs another number of collectives of ``kind`` than the plan counts, when the
    bytes still agree: its combiner merges collectives that are ready together into one."""
    (p_count, p_bytes), (count, nbytes) = predicted, compiled
    if count == p_count:
        return ""
    if count > p_count:
        return (f"{count} compiled, {p_count} predicted, the same bytes: run in more steps "
                "(a region's loop)" if p_bytes and abs(nbytes - p_bytes) <= (_EXCESS - 1)
                * p_bytes else f"{count} compiled, {p_count} predicted")
    if count == 0:
        return f"XLA compiled none of the {p_count} predicted"
    if p_bytes and abs(nbytes - p_bytes) <= (_EXCESS - 1) * p_bytes:
        return f"XLA's {kind} combiner merged {p_count} into {count}"
    if nbytes > p_bytes:
        return (f"{count} compiled, {p_count} predicted, "
                f"{format_bytes(nbytes - p_bytes)} more bytes")
    return (f"XLA merged or removed some: {p_count} predicted, {count} compiled, "
            f"{format_bytes(p_bytes - nbytes)} fewer bytes")


@with_roomy_stack
def validate(plan) -> dict:
    """Compile the plan and return predicted and compiled measures side by side; the result
    is also kept as ``plan.stats["validation"]``, for the report and the plan's JSON.

    Keys: ``wire_bytes``, ``flops``, ``peak_memory_bytes`` as (predicted, compiled) per
    device; ``by_kind``: kind -> ((predicted count, bytes), (compiled count, bytes));
    ``flags``: kind -> why XLA's collectives of that kind exceed the plan's;
    ``unexpected_kinds``: the flagged kinds, sorted.
    """
    compiled_program = plan.compile()
    summary = analyze(compiled_program)
    predicted = _with_stages(by_kind(plan._details[3]), plan.pipeline)
    compiled = {k.value: v for k, v in summary.by_kind().items()}
    flags = flag_kinds(predicted, compiled)
    result = {
        "wire_bytes": (plan.estimate.comm_bytes, summary.wire_bytes),
        "flops": (plan.estimate.flops, summary.flops_all_trips),
        "peak_memory_bytes": (plan.estimate.peak_memory_bytes, summary.peak_memory_bytes),
        "by_kind": {k: (tuple(predicted.get(k, (0, 0.0))), tuple(compiled.get(k, (0, 0.0))))
                    for k in sorted(set(predicted) | set(compiled))},
        "flags": flags,
        "notes": {k: count_note(k, predicted.get(k, (0, 0.0)), compiled.get(k, (0, 0.0)))
                  for k in sorted(set(predicted) | set(compiled))},
        "unexpected_kinds": sorted(flags),
        "pipeline": _pipeline(plan.pipeline, compiled_program.as_text(),
                              summary.peak_memory_bytes),
        "measure_notes": _measure_notes(plan.pipeline),
    }
    plan.stats = {**plan.stats, "validation": result}   # this plan's own: copies share stats
    return result


def _pipeline(pipeline: dict | None, hlo_text: str, peak_bytes: int) -> dict | None:
    """A pipelined plan's schedule beside its compiled loops: the tick loops' trip counts
    (``passes.stages.schedules.tick_loops``), the predicted bubble,
    and the per-stage peak beside the compiled peak (every device runs the same program)."""
    if pipeline is None:
        return None
    loops = tick_loops(Schedule(pipeline["schedule"]), pipeline["stages"],
                       pipeline["microbatches"], pipeline["virtual_stages"] or 1)
    return {"ticks": (loops, permute_loops(hlo_text)),
            "bubble_fraction": pipeline["bubble_fraction"],
            "stage_peak_bytes": (max(pipeline["stage_peak_bytes"]), peak_bytes)}


def _measure_notes(pipeline: dict | None) -> dict[str, str]:
    """Why a measure of a tabled pipeline (ZB-H1) reads apart from its prediction."""
    if pipeline is None or Schedule(pipeline["schedule"]) not in TABLED:
        return {}
    return {"flops": "compiled: each slot at its costliest branch (W, or the last stage's F "
                     "with the loss); a device runs one",
            "peak_memory_bytes": "compiled: the slot's switch copies what it passes through "
                                 "(docs/pipeline.md)"}


def _ratio(predicted: float, compiled: float) -> str:
    return f"{predicted / compiled:.3f}" if compiled else "-"


_NAMES = {"wire_bytes": "wire bytes", "flops": "flops", "peak_memory_bytes": "peak memory"}
_UNITS = {"wire_bytes": format_bytes, "flops": format_flops,
          "peak_memory_bytes": format_bytes}


def validation_rows(v: dict) -> list[tuple[str, str, str, str, str]]:
    """(measure, predicted, compiled, ratio, note) per line of the validation."""
    rows = []
    for name, fmt in _UNITS.items():
        p, c = v[name]
        rows.append((_NAMES[name], fmt(p), fmt(c), _ratio(p, c),
                     (v.get("measure_notes") or {}).get(name, "")))
    for kind, ((pn, pb), (cn, cb)) in v["by_kind"].items():
        note = v["flags"].get(kind) or (v.get("notes") or {}).get(kind, "")
        if kind in v["flags"]:
            note = "<- " + note
        rows.append((f"{kind}s", f"{pn} moving {format_bytes(pb)}",
                     f"{cn} moving {format_bytes(cb)}", _ratio(pb, cb), note))
    if v.get("pipeline"):
        p = v["pipeline"]
        rows.append(("pipeline tick loops", str(p["ticks"][0]), str(p["ticks"][1]), "",
                     f"predicted bubble {p['bubble_fraction']:.1%} of the tick loops"))
        pp, cp = p["stage_peak_bytes"]
        rows.append(("per-stage peak", format_bytes(pp), format_bytes(cp), _ratio(pp, cp), ""))
    return rows


def validation_table(plan, result: dict | None = None) -> str:
    """:func:`validate` as text (``result``: an earlier ``validate(plan)``, to skip compiling)."""
    v = result if result is not None else validate(plan)
    lines = ["Validation: predicted vs compiled (per device; ratio = predicted / compiled)",
             f"  {'measure':<22}{'predicted':>22}{'compiled':>22}{'ratio':>8}"]
    for name, p, c, ratio, note in validation_rows(v):
        lines.append(f"  {name:<22}{p:>22}{c:>22}{ratio:>8}" + (f"  {note}" if note else ""))
    if v["flags"]:
        why = ("resharding the plan missed: please report it" if not v.get("pipeline") else
               "a pipelined stage's layers are partitioned by XLA from the stage's input "
               "specs, not pinned to the layer's plan; elsewhere, resharding the plan "
               "missed: please report it")
        lines.append("  XLA runs collectives the plan did not predict: "
                     + ", ".join(v["unexpected_kinds"]) + f" ({why})")
    return "\n".join(lines)
