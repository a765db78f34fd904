"""The sharding benchmark's rows as markdown tables and JSON."""

from __future__ import annotations

import json

MIB = 2**20
GIB = 2**30


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def summary_table(rows: list[dict]) -> str:
    """One line per (model, mesh): autopar beside the best baseline that fits in memory, by
    the reference step time; then the simulated timeline: the compute-only limit, autopar's
    makespan, exposed communication and ratio to the limit, and the fitting baseline with
    the least makespan with its ratio to the limit."""
    lines = [("| model | mesh | autopar ms | best baseline | its ms | ratio | autopar wire MiB "
              "| autopar TFLOP/dev | autopar peak GiB | planning s | solver | plan from "
              "| ILP objective / estimate | limit ms | autopar sim ms | autopar exposed ms "
              "| autopar / limit | best sim baseline / limit "
              "| collectives as a GPU compiles them: autopar / best sim baseline |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mesh']} | error: {r['error'][:80]} "
                         "| | | | | | | | | | | | | | | | |")
            continue
        ours = r["programs"]["autopar"]
        best = r["best_baseline"]
        best_ms = _ms(r["programs"][best]["step_time_s"]) if best else "-"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        lines.append(
            f"| {r['model']} | {r['mesh']} | {_ms(ours['step_time_s'])} | {best or 'none fits'} "
            f"| {best_ms} | {ratio} | {ours['wire_bytes'] / MIB:.0f} "
            f"| {ours['flops'] / 1e12:.3f} | {ours['peak_memory_bytes'] / GIB:.2f} "
            f"| {r['planning_s']:.1f} | {r['solver_status']} | {r.get('source', '-')} "
            f"| {_objective_ratio(r)} | {_simulated_cells(r)} | {_program_dtypes_cell(r)} |")
    return "\n".join(lines)


def _program_dtypes_cell(row: dict) -> str:
    """autopar's makespan over the best fitting baseline's, both with their collectives read
    as a GPU compiles them (``simulate(..., program_dtypes=True)``; dash for a row from
    before that measure)."""
    best = row.get("best_program_dtypes_baseline")
    ours = row["programs"]["autopar"].get("makespan_program_dtypes_s")
    if ours is None:
        return "-"
    if not best:
        return "none fits"
    return f"{best} {ours / row['programs'][best]['makespan_program_dtypes_s']:.2f}"


def _simulated_cells(row: dict) -> str:
    """The summary's timeline columns (dashes for a row from before they existed)."""
    ours = row["programs"]["autopar"]
    if "makespan_s" not in ours:
        return "- | - | - | - | -"
    best = row.get("best_simulated_baseline")
    best_cell = (f"{best} {row['programs'][best]['limit_ratio']:.2f}" if best else "none fits")
    return (f"{_ms(row['limit_s'])} | {_ms(ours['makespan_s'])} | {_ms(ours['exposed_comm_s'])} "
            f"| {ours['limit_ratio']:.2f} | {best_cell}")


def _objective_ratio(row: dict) -> str:
    """The ILP's objective over the estimate's step time of the ILP's own plan."""
    objective, estimated = row.get("ilp_objective_s"), row.get("ilp_plan_step_s")
    if not objective or not estimated:
        return "-"
    return f"{objective / estimated:.3f}"


def detail_table(rows: list[dict]) -> str:
    """Every compiled program of every row: reference step time, then the simulated
    timeline's makespan, exposed communication and ratio to the compute-only limit."""
    lines = ["| model | mesh | program | step ms | wire MiB | TFLOP/dev | peak GiB | fits "
             "| sim ms | exposed ms | / limit | sim ms, collectives as a GPU compiles them |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for name, p in r.get("programs", {}).items():
            simulated = (f"{_ms(p['makespan_s'])} | {_ms(p['exposed_comm_s'])} "
                         f"| {p['limit_ratio']:.2f}" if "makespan_s" in p else "- | - | -")
            native = p.get("makespan_program_dtypes_s")
            simulated += f" | {_ms(native)}" if native is not None else " | -"
            lines.append(f"| {r['model']} | {r['mesh']} | {name} | {_ms(p['step_time_s'])} "
                         f"| {p['wire_bytes'] / MIB:.1f} | {p['flops'] / 1e12:.3f} "
                         f"| {p['peak_memory_bytes'] / GIB:.2f} | {'yes' if p['fits'] else 'no'} "
                         f"| {simulated} |")
    return "\n".join(lines)


def markdown(rows: list[dict], meta: dict) -> str:
    head = (f"# autopar sharding benchmark\n\n"
            f"Reference step time on the `{meta['hardware']}` profile, priced from each "
            f"program's compiled HLO (wire bytes of every collective, per-device flops); peak "
            f"memory as XLA compiled it for {meta['devices']} simulated CPU devices. "
            f"ratio = autopar / best baseline that fits in memory (lower is better). "
            f"plan from: the ILP's own plan (ilp) or a propagated seed's (propagated); ILP "
            f"objective / estimate: the ILP's objective (communication charged for what the "
            f"plan's timeline does not hide) over the estimate's step time of the ILP's own "
            f"plan (its makespan, where collectives overlap compute). "
            f"sim ms: the makespan of the program's simulated timeline (kernels at their "
            f"roofline, loops at their trip counts, asynchronous collectives overlapping "
            f"compute; `autopar.cost_model.timeline`); exposed ms: the part of it the compute "
            f"stream waits for communication; limit ms: the compute-only limit, the "
            f"single-device program's simulated step over the {meta['devices']} devices with "
            f"all communication hidden; / limit: sim ms over limit ms (1.00 is the best any "
            f"plan can do); best sim baseline: the fitting baseline with the least sim ms; "
            f"collectives as a GPU compiles them: the same timelines with each collective "
            f"XLA:CPU carries in float32 for bf16 values priced at bf16, and each all-reduce "
            f"XLA:CPU slices per device priced as the reduce-scatter it stands for "
            f"(`simulate(..., program_dtypes=True)`), autopar's over the best fitting "
            f"baseline's (lower is better). "
            f"Ran {meta['duration_s']:.0f} s ({meta.get('rows_cpu_s', 0):.0f} CPU s) with "
            f"{meta['jobs']} worker(s) on {meta['cpus']} CPU core(s), jax {meta['jax']}, "
            f"{meta['date']}.\n\n")
    return (head + summary_table(rows) + "\n\n## Every program\n\n" + detail_table(rows)
            + "\n")


def to_json(rows: list[dict], meta: dict) -> str:
    return json.dumps({"meta": meta, "rows": rows}, indent=1, default=str)
