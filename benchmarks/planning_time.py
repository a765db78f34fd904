"""Planning time against depth: a GPT-style train step (flax linen, adamw) on a (2, 4) mesh.

For each depth the model is built abstractly (``jax.ShapeDtypeStruct`` leaves, REALISTIC
shapes of ``autopar/models/gpt.py``, nothing executed) and planned with
``autopar.plan(..., hardware="h100")``. The table shows where the time goes (tracing,
strategies, clustering with layer deduplication, the ILP solve), the whole ``plan()`` call
(tracing included), and the ILP's size before and after coarsening: graph nodes -> groups
after follower merging -> groups after layer deduplication, graph edges -> edge classes; and
how many layers the planner rematerialized to fit the H100's memory (``remat``).

Targets (issue 4): 96 layers planned in under 10 s, tracing included; 32 layers in under 3x
the 2-layer time.

Each row is measured in a process of its own, as a program planning one model is (and as the
sharding benchmark's rows are): in one process, a row planned after the others traces slower.

Run: ``python -m benchmarks.planning_time [--layers 2 8 32 96] [--variant unrolled scan]``.
It runs on simulated CPU devices when no accelerator is present.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time


def _setup_devices() -> None:
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()


COLUMNS = ("variant", "layers", "setup_s", "trace_s", "strategies_s", "cluster_s", "solve_s",
           "plan_s", "nodes", "groups_followed", "groups", "edges", "edge_classes",
           "ilp_vars", "remat", "status")


def measure(layers: int, scan: bool, time_limit_s: float) -> dict:
    """Plan the train step at ``layers`` deep; one row of the table."""
    import autopar
    from autopar.models import gpt

    config = dataclasses.replace(gpt.REALISTIC, layers=layers, scan_layers=scan)
    t = time.perf_counter()
    fn, args = gpt.make_train_step(config, abstract=True)
    setup_s = time.perf_counter() - t
    t = time.perf_counter()
    plan = autopar.plan(fn, *args, mesh={"data": 2, "model": 4}, hardware="h100",
                        time_limit_s=time_limit_s)
    plan_s = time.perf_counter() - t
    st, ts = plan.stats, plan.stats["timings_s"]
    return {"variant": "scan" if scan else "unrolled", "layers": layers, "setup_s": setup_s,
            "trace_s": ts["trace"], "strategies_s": ts["strategies"],
            "cluster_s": ts["cluster"], "solve_s": ts["solve"], "plan_s": plan_s,
            "nodes": st["nodes"], "groups_followed": st.get("ilp_groups_followed"),
            "groups": st["ilp_groups"], "edges": st.get("ilp_edges_before"),
            "edge_classes": st.get("ilp_edges"), "ilp_vars": st["ilp_variables"],
            "remat": len(st["remat"]["layers"]) if st["remat"] else 0,
            "status": st["solver_status"]}


def _fmt(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def print_table(rows: list[dict]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in COLUMNS}
    print("  ".join(c.rjust(widths[c]) for c in COLUMNS))
    for r in rows:
        print("  ".join(_fmt(r[c]).rjust(widths[c]) for c in COLUMNS), flush=True)


def targets(rows: list[dict]) -> list[str]:
    """The issue's two targets, per variant, as lines saying met or missed."""
    lines = []
    for variant in sorted({r["variant"] for r in rows}):
        by_depth = {r["layers"]: r["plan_s"] for r in rows if r["variant"] == variant}
        if 96 in by_depth:
            ok = by_depth[96] < 10.0
            lines.append(f"{variant}: 96 layers in {by_depth[96]:.1f}s (target < 10s): "
                         f"{'met' if ok else 'MISSED'}")
        if 2 in by_depth and 32 in by_depth:
            ratio = by_depth[32] / by_depth[2]
            lines.append(f"{variant}: 32 layers / 2 layers = {ratio:.2f}x (target < 3x): "
                         f"{'met' if ratio < 3 else 'MISSED'}")
    return lines


def _measured_apart(layers: int, variant: str, time_limit_s: float) -> dict:
    """:func:`measure` in a process of its own."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.planning_time", "--row", "--layers", str(layers),
         "--variant", variant, "--time-limit-s", str(time_limit_s)],
        capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the {variant} {layers}-layer row failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> list[dict]:
    """Run the benchmark and print its table; returns the rows."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planning_time",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32, 96])
    parser.add_argument("--variant", nargs="+", choices=("unrolled", "scan"),
                        default=["unrolled", "scan"])
    parser.add_argument("--time-limit-s", type=float, default=60.0,
                        help="the ILP's time limit (default 60)")
    parser.add_argument("--row", action="store_true",
                        help="measure one row here (one --layers and --variant) and print it "
                             "as JSON: what each row's process runs")
    opts = parser.parse_args(argv)
    _setup_devices()
    if opts.row:
        print(json.dumps(measure(opts.layers[0], opts.variant[0] == "scan",
                                 opts.time_limit_s)))
        return []
    rows = []
    for variant in opts.variant:
        for layers in opts.layers:
            rows.append(_measured_apart(layers, variant, opts.time_limit_s))
            print(f"[planning_time] {variant} {layers} layers: plan {rows[-1]['plan_s']:.2f}s",
                  flush=True)
    print_table(rows)
    for line in targets(rows):
        print(line)
    return rows


if __name__ == "__main__":
    main()
