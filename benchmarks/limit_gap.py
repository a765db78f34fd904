"""Where autopar's simulated step goes beyond the compute-only limit, kernel kind by kind.

``python -m benchmarks.limit_gap [--rows gpt:8 gpt:2x4 ...]`` compiles, for each row of the
sharding benchmark asked for, the single-device program and autopar's plan (from
ShapeDtypeStructs, with the sharding benchmark's compiler options; nothing runs), simulates
both on the h100 profile as the sharding table does (``cost_model.timeline``), and sums each
program's kernel time by kind: matmuls (a kernel that runs a dot or a convolution), and the
other kernels by the opcode of what they compute (a fusion by its root). The limit's column
is the single-device time over the device count, as the table's limit is. The last lines
give the plan's exposed communication and its makespan over the limit.
"""

from __future__ import annotations

import argparse
import collections
import os

if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

#: Root opcodes read as one kind (everything else is "elementwise and other").
KINDS = {"convert": "convert", "copy": "copy or transpose", "transpose": "copy or transpose",
         "reduce": "reduce", "reduce-window": "reduce", "dynamic-slice": "slice or update",
         "dynamic-update-slice": "slice or update", "slice": "slice or update",
         "concatenate": "concatenate or pad", "pad": "concatenate or pad",
         "broadcast": "broadcast", "iota": "broadcast", "scatter": "gather or scatter",
         "gather": "gather or scatter", "select-and-scatter": "gather or scatter"}
#: Kernels no faster than the profile's launch floor, whatever they compute: split over
#: devices, such a kernel still takes the floor on each.
FLOOR = "at the launch floor"
#: Converts that read or feed a collective: XLA:CPU carries 16-bit collectives in float32
#: and converts around each (``cost_model.hlo.widening``); a GPU or TPU does not.
CONVERT_BESIDE = "convert beside a collective"
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
DEFAULT_ROWS = ("gpt:8", "gpt:2x4", "bert:2x4", "llama:2x4", "mlp:8", "resnet:8")


def _kind(module, computation: str, instruction, beside_collective: bool) -> str:
    """The kind of one kernel (see the module docstring); ``beside_collective``: it reads a
    collective's result or feeds a collective."""
    from autopar.cost_model.hlo_roofline import matmuls
    if matmuls(module, computation, instruction):
        return "matmul"
    opcode = instruction.opcode
    if opcode == "fusion":
        called = instruction.called("calls")
        roots = [i for i in module.computations.get(called[0], ()) if i.root] if called else []
        opcode = roots[0].opcode if roots else opcode
        if opcode == "tuple":
            return "multi-output fusion"
    if opcode == "convert" and beside_collective:
        return CONVERT_BESIDE
    return KINDS.get(opcode, "elementwise and other")


def _beside_collectives(module) -> set[str]:
    """The instructions that read a collective's result or feed a collective."""
    out = set()
    for instructions in module.computations.values():
        collective = {i.name for i in instructions if i.opcode.startswith(COLLECTIVES)}
        for i in instructions:
            if i.name in collective:
                out.update(i.operands)
            elif collective.intersection(i.operands):
                out.add(i.name)
    return out


def kernel_seconds(hlo_text: str, profile, dtype) -> tuple[dict[str, float], object]:
    """(kind -> seconds of kernel time, the timeline) of one compiled program, simulated as
    the sharding table does."""
    from autopar.cost_model.hlo_ir import parse_module
    from autopar.cost_model.timeline import simulate
    timeline = simulate(hlo_text, profile, dtype, scheduled=profile.async_collectives)
    module = parse_module(hlo_text)
    where = {i.name: (c, i) for c, instructions in module.computations.items()
             for i in instructions}
    beside = _beside_collectives(module)
    out: dict[str, float] = collections.defaultdict(float)
    for event in timeline.events:
        if event.level is None and event.name in where:
            computation, instruction = where[event.name]
            took = event.end_s - event.start_s
            floor = took <= profile.launch_overhead_s * (1 + 1e-9)
            out[FLOOR if floor else _kind(module, computation, instruction,
                                          instruction.name in beside)] += took
    return dict(out), timeline


def measure_row(model: str, shape: tuple[int, ...], hardware: str = "h100") -> dict:
    """One row: each kind's kernel time for autopar's plan and for the limit, in seconds."""
    import jax
    import jax.numpy as jnp
    import autopar
    from autopar._mesh import as_auto_mesh
    from autopar.cost_model.hardware import get_profile
    from benchmarks.sharding import COMPILE_OPTIONS, compile_plan, mesh_axes
    from benchmarks.workloads import abstract_train_step
    profile, dtype = get_profile(hardware), jnp.bfloat16
    fn, args = abstract_train_step(model)
    mesh = as_auto_mesh(mesh_axes(shape))
    devices = mesh.devices.size
    plan = autopar.plan(fn, *args, mesh=mesh, hardware=profile, verbose=False)
    planned, timeline = kernel_seconds(compile_plan(plan, args, COMPILE_OPTIONS).as_text(),
                                       profile, dtype)
    single = jax.jit(fn).lower(*args).compile(compiler_options=COMPILE_OPTIONS).as_text()
    alone, limit = kernel_seconds(single, profile, dtype)
    return {"model": model, "shape": shape, "autopar": planned,
            "limit": {k: v / devices for k, v in alone.items()},
            "limit_s": limit.step_time_s / devices, "makespan_s": timeline.step_time_s,
            "exposed_s": timeline.exposed_comm_s, "compute_s": timeline.compute_busy_s}


def print_row(row: dict) -> None:
    kinds = sorted(set(row["autopar"]) | set(row["limit"]),
                   key=lambda k: -(row["autopar"].get(k, 0.0) - row["limit"].get(k, 0.0)))
    label = "x".join(map(str, row["shape"]))
    print(f"\n### {row['model']} on ({label}): {row['makespan_s'] * 1e3:.3f} ms simulated, "
          f"{row['makespan_s'] / row['limit_s']:.2f}x the limit of "
          f"{row['limit_s'] * 1e3:.3f} ms\n")
    print("| kernels | autopar ms | limit ms | over the limit ms |")
    print("|---|---|---|---|")
    for kind in kinds:
        a, b = row["autopar"].get(kind, 0.0), row["limit"].get(kind, 0.0)
        print(f"| {kind} | {a * 1e3:.3f} | {b * 1e3:.3f} | {(a - b) * 1e3:+.3f} |")
    over = row["makespan_s"] - row["limit_s"]
    kernels = sum(row["autopar"].values()) - sum(row["limit"].values())
    print(f"| exposed communication | {row['exposed_s'] * 1e3:.3f} | 0 | "
          f"{row['exposed_s'] * 1e3:+.3f} |")
    print(f"| **all** | {row['makespan_s'] * 1e3:.3f} | {row['limit_s'] * 1e3:.3f} | "
          f"{over * 1e3:+.3f} |")
    # Kernel time the timeline counted but no event carried (a loop's repeated trips).
    unlisted = row["compute_s"] - sum(row["autopar"].values())
    if abs(unlisted) > 1e-6:
        print(f"\n(autopar's compute stream also ran {unlisted * 1e3:.3f} ms of kernels in "
              f"loop trips the timeline repeats without listing; {kernels * 1e3:+.3f} ms "
              "of listed kernels over the limit)")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS),
                        help="model:mesh pairs, e.g. gpt:8 gpt:2x4 (default: %(default)s)")
    opts = parser.parse_args(argv)
    from benchmarks.run import parse_shape
    rows = []
    for spec in opts.rows:
        model, shape = spec.split(":")
        rows.append(measure_row(model, parse_shape(shape)))
        print_row(rows[-1])
    return rows


if __name__ == "__main__":
    main()
