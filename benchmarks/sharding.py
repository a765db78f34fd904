"""One row of the sharding benchmark: autopar's plan and the hand-written baselines for one
workload on one mesh, each compiled from ShapeDtypeStruct arguments and priced from its
compiled HLO (``autopar._compare.measure``), never from autopar's own estimate: the reference
step time (no overlap) and the simulated timeline's makespan and exposed communication, the
makespan also as a ratio to the compute-only limit (``autopar._compare.compute_only_limit_s``,
computed once per model, hardware and device count in each process).

Programs are compiled with :data:`COMPILE_OPTIONS`:

* :data:`FAST_COMPILE`: XLA skips LLVM optimisation, which halves CPU compile time and
  changes no measure (SPMD partitioning, collectives, flops and buffer assignment all run
  before it; ``tests/test_benchmarks.py`` checks the measures agree);
* no excess precision: XLA:CPU computes bf16 matmuls and convolutions in f32, and with excess
  precision allowed it drops the f32-bf16-f32 round trip wherever nothing (such as autopar's
  sharding constraints) stands between the two converts. Off, every program rounds where its
  dtypes say, as a bf16 GPU kernel does (docs/benchmarks.md has what it changed).
"""

from __future__ import annotations

import functools
import time
import traceback

import jax
import jax.numpy as jnp

import autopar
from autopar import baselines
from autopar._mesh import as_auto_mesh
from autopar._compare import _baseline_kwargs, baseline_kinds, compute_only_limit_s, measure
from benchmarks.workloads import WORKLOADS, abstract_train_step
from autopar.cost_model.hardware import get_profile
from autopar.cost_model.timeline import simulate

#: XLA options for the benchmark's compiles (see the module docstring).
FAST_COMPILE = {"xla_backend_optimization_level": 0}
COMPILE_OPTIONS = {**FAST_COMPILE, "xla_allow_excess_precision": False}

#: Mesh shapes -> axis names: 1-D data parallel, 2-D data x model, 3-D data x model x expert.
AXIS_NAMES = {1: ("data",), 2: ("data", "model"), 3: ("data", "model", "expert")}


def mesh_axes(shape: tuple[int, ...]) -> dict[str, int]:
    """(2, 4) -> {'data': 2, 'model': 4}."""
    return dict(zip(AXIS_NAMES[len(shape)], shape))


def mesh_label(shape: tuple[int, ...]) -> str:
    return "x".join(str(n) for n in shape)


def _measured_dict(name: str, compiled, profile, dtype, limit_s: float) -> dict:
    """``compiled``'s measures (``autopar._compare.measure``), and its simulated step with the
    collectives XLA:CPU widened at the program's dtypes (``makespan_program_dtypes_s``)."""
    m = measure(name, compiled, profile, dtype)
    native = simulate(compiled.as_text(), profile, dtype, scheduled=profile.async_collectives,
                      program_dtypes=True)
    return {"step_time_s": m.step_time_s, "wire_bytes": m.wire_bytes, "flops": m.flops,
            "peak_memory_bytes": m.peak_memory_bytes, "fits": m.fits(profile),
            "collectives": len(m.summary.collectives), "makespan_s": m.makespan_s,
            "exposed_comm_s": m.exposed_comm_s, "limit_ratio": m.makespan_s / limit_s,
            "makespan_program_dtypes_s": native.step_time_s}


def limit_s(model: str, hardware: str, dtype, devices: int) -> float:
    """The compute-only limit of ``model``'s train step over ``devices`` devices on
    ``hardware`` (``autopar._compare.compute_only_limit_s``), compiled once per process for
    each workload configuration."""
    return _limit_s(model, repr(WORKLOADS[model]), hardware, dtype, devices)


@functools.lru_cache(maxsize=None)
def _limit_s(model: str, _workload: str, hardware: str, dtype, devices: int) -> float:
    fn, args = abstract_train_step(model)
    return compute_only_limit_s(fn, args, get_profile(hardware), dtype, devices,
                                COMPILE_OPTIONS)


def compile_plan(plan, args, compiler_options=None):
    """The plan's program compiled from abstract ``args``."""
    return plan.jit().lower(*args).compile(compiler_options=compiler_options)


def compile_baseline(fn, args, mesh, kind: str, compiler_options=None):
    """A hand-written baseline (as ``autopar.compare`` builds it) compiled from ``args``."""
    jitted = baselines.jit_baseline(fn, args, mesh, kind, **_baseline_kwargs(mesh, kind))
    return jitted.lower(*args).compile(compiler_options=compiler_options)


def best_baseline(programs: dict, by: str = "step_time_s") -> str | None:
    """The name of the baseline that fits in memory with the least ``by`` (the reference step
    time, or ``"makespan_s"``); None if none fits."""
    fitting = {k: v for k, v in programs.items() if k != "autopar" and v["fits"]}
    return min(fitting, key=lambda k: fitting[k][by]) if fitting else None


def run_row(model: str, shape: tuple[int, ...], hardware: str = "h100",
            dtype=jnp.bfloat16, plan_kwargs: dict | None = None) -> dict:
    """Plan, compile and price one (model, mesh) row; an exception becomes the row's error.
    ``plan_kwargs`` go to ``autopar.plan`` (e.g. ``time_limit_s``)."""
    row = {"model": model, "mesh": mesh_label(shape), "axes": mesh_axes(shape),
           "hardware": hardware}
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        row.update(_measure_row(model, shape, hardware, dtype, plan_kwargs or {}))
    except Exception as e:  # noqa: BLE001 (one broken row must not lose the others)
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc()
    row["wall_s"] = time.perf_counter() - start
    row["cpu_s"] = time.process_time() - cpu_start  # this process's CPU time, all threads
    return row


def _measure_row(model, shape, hardware, dtype, plan_kwargs) -> dict:
    profile = get_profile(hardware)
    fn, args = abstract_train_step(model)
    mesh = as_auto_mesh(mesh_axes(shape))
    start = time.perf_counter()
    plan = autopar.plan(fn, *args, mesh=mesh, hardware=profile, **plan_kwargs)
    planning_s = time.perf_counter() - start
    limit = limit_s(model, hardware, dtype, mesh.devices.size)
    programs = {"autopar": _measured_dict(
        "autopar", compile_plan(plan, args, COMPILE_OPTIONS), profile, dtype, limit)}
    for kind in baseline_kinds(mesh, args):
        compiled = compile_baseline(fn, args, mesh, kind, COMPILE_OPTIONS)
        programs[kind] = _measured_dict(kind, compiled, profile, dtype, limit)
    best = best_baseline(programs)
    ratio = (programs["autopar"]["step_time_s"] / programs[best]["step_time_s"]
             if best else None)
    stats = plan.stats
    ilp_plan_s = stats.get("candidates_step_s", {}).get(stats.get("ilp_plan"))
    return {"planning_s": planning_s, "solver_status": stats.get("solver_status"),
            "source": stats.get("source"), "ilp_objective_s": stats.get("ilp_objective_s"),
            "ilp_plan_step_s": ilp_plan_s,
            "predicted_step_time_s": plan.estimate.step_time_s, "programs": programs,
            "best_baseline": best, "ratio": ratio, "limit_s": limit,
            "best_simulated_baseline": best_baseline(programs, "makespan_s"),
            "best_program_dtypes_baseline": best_baseline(programs, "makespan_program_dtypes_s"),
            "devices": jax.device_count()}
