"""Run autopar's benchmarks.

    python -m benchmarks.run                                  # the sharding suite, every row
    python -m benchmarks.run --models gpt,moe --meshes 2x4 --hardware tpu-v5e
    python -m benchmarks.run --suite planning [its options]  # planning-time scaling
    python -m benchmarks.run --suite pipeline [--cases two-node,one-node]
    python -m benchmarks.run --suite dispatch                # parallelize's per-call cost
    python -m benchmarks.run --suite fuzz [--count 300]        # random programs vs one device

The sharding suite compiles, for each example model at realistic widths and each mesh, autopar's
plan and the hand-written baselines (data parallel, FSDP, Megatron TP+DP with and without a
vocab-parallel embedding, expert parallel for MoE), all from ShapeDtypeStruct arguments on
simulated CPU devices, and prices each compiled program on a hardware profile. It prints a
markdown table and writes it with the JSON of every measure to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import os
import platform
import sys
import time

#: Default rows: every workload of benchmarks/workloads.py on these mesh shapes.
MODELS = ("mlp", "gpt", "bert", "moe", "llama", "resnet")
MESHES = ("8", "2x4", "4x2", "2x2x2")
DEFAULT_OUT = os.path.join("benchmarks", "results")
_SIMULATE_FLAG = "--xla_force_host_platform_device_count"
_PLANNING_MODULE = "benchmarks.planning_time"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=("sharding", "planning", "pipeline", "dispatch",
                                       "long-context", "fuzz"),
                   default="sharding",
                   help="sharding: autopar vs baselines from compiled HLO (default); planning: "
                        "planning-time scaling (benchmarks/planning_time.py); pipeline: a 26B "
                        "GPT over two nodes and one (benchmarks/pipeline.py); dispatch: "
                        "parallelize's per-call cost against jax.jit (benchmarks/dispatch.py); "
                        "long-context: sequence parallelism (benchmarks/long_context.py); fuzz: "
                        "random programs against one device (benchmarks/fuzz.py)")
    p.add_argument("--cases", default="two-node,one-node",
                   help="the pipeline suite's cases (default: two-node,one-node)")
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--meshes", default=",".join(MESHES),
                   help="comma-separated mesh shapes, e.g. 8,2x4,4x2,2x2x2 (axes: data, "
                        "data x model, data x model x expert)")
    p.add_argument("--hardware", default="h100", help="profile the programs are priced on")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="rows compiled at once, each in its own process (default: up to 2)")
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="the ILP's safety-net time limit per plan (default: autopar.plan's; "
                        "every row's solve ends on its work limits well before it)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for results.md and results.json (default: {DEFAULT_OUT})")
    return p


def parse_shape(text: str) -> tuple[int, ...]:
    parts = text.strip().lower().split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts) or not 1 <= len(parts) <= 3:
        raise ValueError(f"mesh `{text}`: write 1 to 3 positive sizes joined by x, e.g. 2x4")
    return tuple(int(p) for p in parts)


def _simulate(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if _SIMULATE_FLAG not in flags and "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = f"{flags} {_SIMULATE_FLAG}={n}".strip()


def run_pipeline_suite(cases: list[str], hardware: str, out: str) -> int:
    """The pipeline suite (``benchmarks/pipeline.py``): its table, written to
    ``out/pipeline.md`` with every measure in ``out/pipeline.json``."""
    import json
    _simulate(16)
    from benchmarks import pipeline
    rows = []
    for case in cases:
        start = time.perf_counter()
        rows.append(pipeline.run_case(case, hardware))
        print(f"{case}: {time.perf_counter() - start:.0f} s", flush=True)
    text = pipeline.table(rows)
    print("\n" + text)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "pipeline.md"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "pipeline.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1, default=str)
    return 0


def run_dispatch_suite() -> int:
    """The dispatch suite (``benchmarks/dispatch.py``): parallelize's per-call cost against
    jax.jit's, printed."""
    _simulate(8)
    from benchmarks import dispatch
    print(dispatch.report(dispatch.run()))
    return 0


def run_planning_suite(rest: list[str]) -> int:
    importlib.import_module(_PLANNING_MODULE).main(rest)  # prints its table, returns the rows
    return 0


def _rows_in_order(models, shapes):
    """Longest first (3-D meshes, then 2-D), so that parallel workers finish together."""
    return sorted(((m, s) for m in models for s in shapes), key=lambda ms: -len(ms[1]))


def run_sharding_suite(models, shapes, hardware: str, jobs: int, plan_kwargs=None,
                       say=print) -> list[dict]:
    """Every (model, mesh) row, in up to ``jobs`` worker processes; rows in input order."""
    from benchmarks.sharding import run_row
    order = _rows_in_order(models, shapes)
    done = {}
    if jobs <= 1:
        for m, s in order:
            done[(m, s)] = run_row(m, s, hardware, plan_kwargs=plan_kwargs)
            say(_progress(done[(m, s)]))
    else:
        import concurrent.futures as cf
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")  # a fresh jax per worker, flags inherited
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(run_row, m, s, hardware, plan_kwargs=plan_kwargs): (m, s)
                       for m, s in order}
            for f in cf.as_completed(futures):
                done[futures[f]] = f.result()
                say(_progress(done[futures[f]]))
    return [done[(m, s)] for m in models for s in shapes]


def _progress(row: dict) -> str:
    if "error" in row:
        return f"{row['model']:>7} {row['mesh']:>6}  ERROR {row['error']}"
    ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
    ours = row["programs"]["autopar"]
    return (f"{row['model']:>7} {row['mesh']:>6}  autopar "
            f"{ours['step_time_s'] * 1e3:8.3f} ms, best baseline "
            f"{row['best_baseline']}, ratio {ratio}, simulated {ours['makespan_s'] * 1e3:.3f} ms "
            f"({ours['limit_ratio']:.2f}x the limit), planned in {row['planning_s']:.1f} s "
            f"({row['solver_status']}), row took {row['wall_s']:.0f} s")


def main(argv=None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.suite == "planning":
        return run_planning_suite(rest)
    if args.suite == "dispatch":
        return run_dispatch_suite()
    if args.suite == "long-context":  # benchmarks/long_context.py; --cases from its CASES
        _simulate(8)
        from benchmarks import long_context
        cases = [] if args.cases == "two-node,one-node" else args.cases.split(",")
        return long_context.main(cases, args.hardware, args.out)
    if args.suite == "fuzz":
        _simulate(8)  # before jax is imported
        return importlib.import_module("benchmarks.fuzz").main(rest + ["--out", args.out])
    if args.suite == "pipeline":
        cases = [c.strip() for c in args.cases.split(",") if c.strip()]
        _simulate(16)   # before jax is imported
        from benchmarks.pipeline import CASES
        if rest or not set(cases) <= set(CASES):
            parser.error(f"--suite pipeline takes --cases from {','.join(CASES)} and --hardware")
        return run_pipeline_suite(cases, args.hardware, args.out)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {','.join(MODELS)}")
    try:
        shapes = [parse_shape(m) for m in args.meshes.split(",") if m.strip()]
    except ValueError as e:
        parser.error(str(e))
    devices = {math.prod(s) for s in shapes}
    if len(devices) != 1:
        parser.error(f"every mesh must cover the same number of devices, got {sorted(devices)}")
    _simulate(devices.pop())

    import jax

    from autopar.errors import AutoparError
    from autopar.cost_model.hardware import get_profile
    try:
        get_profile(args.hardware)
    except AutoparError as e:
        parser.error(str(e))
    start = time.perf_counter()
    plan_kwargs = {} if args.time_limit_s is None else {"time_limit_s": args.time_limit_s}
    rows = run_sharding_suite(models, shapes, args.hardware, args.jobs, plan_kwargs)
    meta = {"hardware": args.hardware, "devices": jax.device_count(), "jobs": args.jobs,
            "plan_kwargs": plan_kwargs,
            "cpus": os.cpu_count(), "jax": jax.__version__, "python": platform.python_version(),
            "duration_s": time.perf_counter() - start,
            "rows_cpu_s": sum(r.get("cpu_s", 0.0) for r in rows),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    _write(rows, meta, args.out)
    failed = [r for r in rows if "error" in r]
    print(f"\nfinished in {meta['duration_s']:.0f} s; wrote {args.out}/results.md and "
          f"results.json" + (f"; {len(failed)} row(s) failed" if failed else ""))
    return 1 if failed else 0


def _write(rows, meta, out: str) -> None:
    from benchmarks.tables import markdown, summary_table, to_json
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write(markdown(rows, meta))
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        f.write(to_json(rows, meta))
    print("\n" + summary_table(rows))


if __name__ == "__main__":
    sys.exit(main())
