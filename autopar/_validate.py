"""Prediction beside ground truth: the plan's estimate against its compiled HLO."""

from __future__ import annotations

from collections import defaultdict

from cost_model.hlo import analyze

#: Compiled wire bytes of a kind over this multiple of the prediction are flagged.
_EXCESS = 1.10


def validate(plan) -> dict:
    """Compile the plan and return predicted and compiled measures side by side."""
    summary = analyze(plan.compile())
    graph, _, _, comms = plan._details
    predicted = defaultdict(lambda: [0, 0.0])
    for c in comms:
        if c.step.kind is not None and c.step.wire_bytes:
            predicted[c.step.kind.value][0] += c.trips
            predicted[c.step.kind.value][1] += c.step.wire_bytes * c.trips
    compiled = {k.value: v for k, v in summary.by_kind().items()}
    # A kind XLA runs that the plan did not predict, or moves well over the predicted bytes
    # of: resharding the plan missed. (Counts may differ: XLA combines collectives.)
    unexpected = sorted(k for k, (_, nbytes) in compiled.items()
                        if k not in predicted or nbytes > _EXCESS * predicted[k][1])
    return {
        "wire_bytes": (plan.estimate.comm_bytes, summary.wire_bytes),
        "flops": (plan.estimate.flops, summary.flops),
        "peak_memory_bytes": (plan.estimate.peak_memory_bytes, summary.peak_memory_bytes),
        "by_kind": {k: (tuple(predicted.get(k, (0, 0.0))), compiled.get(k, (0, 0.0)))
                    for k in sorted(set(predicted) | set(compiled))},
        "unexpected_kinds": unexpected,
    }


def validation_table(plan) -> str:
    v = validate(plan)
    lines = ["Validation: predicted vs compiled (per device)",
             f"  {'measure':<24}{'predicted':>16}{'compiled':>16}{'ratio':>8}"]
    for name in ("wire_bytes", "flops", "peak_memory_bytes"):
        p, c = v[name]
        ratio = f"{p / c:.3f}" if c else "-"
        lines.append(f"  {name:<24}{p:>16.4g}{c:>16.4g}{ratio:>8}")
    for kind, ((pn, pb), (cn, cb)) in v["by_kind"].items():
        lines.append(f"  {kind + ' (count, bytes)':<24}{f'{pn}, {pb:.4g}':>16}"
                     f"{f'{cn}, {cb:.4g}':>16}")
    if v["unexpected_kinds"]:
        lines.append("  XLA runs collectives the plan did not predict (or >10% more bytes of "
                     "them): " + ", ".join(v["unexpected_kinds"])
                     + " (resharding the plan missed: please report it)")
    return "\n".join(lines)
