"""Judging a plan by what XLA compiled, beside hand-written baselines.

:func:`measure` reads a compiled program's ground truth (``cost_model.hlo``) and prices it on a
hardware profile (``cost_model.reference``). :func:`compare` compiles autopar's plan and the
baselines for the same function and mesh, from abstract arguments, so nothing runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax

from autopar import baselines
from autopar._mesh import as_auto_mesh
from cost_model.hardware import get_profile
from cost_model.hlo import HloSummary, analyze
from cost_model.reference import reference_step_time_s


@dataclass(frozen=True)
class Measured:
    """Per-device measures of one compiled program."""
    name: str
    step_time_s: float        # reference step time on the profile, from the compiled HLO
    wire_bytes: float
    flops: float
    peak_memory_bytes: int
    summary: HloSummary

    def fits(self, profile) -> bool:
        return self.peak_memory_bytes <= profile.hbm_capacity_bytes


def measure(name: str, compiled, profile, dtype) -> Measured:
    s = analyze(compiled)
    return Measured(name, reference_step_time_s(s, profile, dtype), s.wire_bytes, s.flops,
                    s.peak_memory_bytes, s)


def baseline_kinds(mesh, args) -> list[str]:
    """The baselines that apply: DP and FSDP always; Megatron where the mesh has a `model`
    axis (with vocab-parallel embedding too); expert parallel where params hold experts."""
    kinds = ["dp", "fsdp"]
    if "model" in mesh.axis_names:
        kinds += ["megatron", "megatron_vocab"]
    names = {n for p, _ in jax.tree_util.tree_flatten_with_path(args[0])[0]
             for n in baselines.leaf_names(p)}
    if "experts_in" in names:
        kinds.append("expert")
    return kinds


def _baseline_kwargs(mesh, kind: str) -> dict:
    if kind.startswith("megatron"):
        batch_axes = tuple(a for a in mesh.axis_names if a != "model")
    else:
        batch_axes = tuple(mesh.axis_names)
    kw = {"batch_axes": batch_axes or tuple(mesh.axis_names)}
    if kind == "expert":
        kw["expert_axis"] = "expert" if "expert" in mesh.axis_names else mesh.axis_names[-1]
        kw["batch_axes"] = tuple(mesh.axis_names)
    return kw


def compile_baseline(fn, args, mesh, kind: str):
    return baselines.jit_baseline(fn, args, mesh, kind,
                                  **_baseline_kwargs(mesh, kind)).lower(*args).compile()


def predict_baselines(fn, args, mesh, *, hardware="h100", kinds=("dp", "fsdp"), **plan_kwargs):
    """autopar's estimate for each baseline's shardings: a plan whose inputs and outputs are
    pinned to the baseline's (nothing is compiled). Returns {kind: Plan}."""
    import autopar
    jax_mesh = as_auto_mesh(mesh)
    out = {}
    for kind in kinds:
        ins, outs = baselines.baseline_io_shardings(fn, args, jax_mesh, kind,
                                                    **_baseline_kwargs(jax_mesh, kind))
        out[kind] = autopar.plan(fn, *args, mesh=jax_mesh, hardware=hardware,
                                 in_shardings=ins, out_shardings=outs, **plan_kwargs)
    return out


def compare(fn, args, mesh, *, hardware="h100", kinds=None, plan=None,
            dtype=jax.numpy.bfloat16, **plan_kwargs):
    """Measures of autopar's plan and of each baseline, all compiled from ``args``.

    ``dtype`` is the compute dtype whose peak rate prices the flops (the same for every
    program, so it moves no ranking). Returns (plan, {name: Measured}, planning_time_s).
    """
    import autopar
    jax_mesh = as_auto_mesh(mesh)
    profile = get_profile(hardware)
    start = time.perf_counter()
    if plan is None:
        plan = autopar.plan(fn, *args, mesh=jax_mesh, hardware=profile, **plan_kwargs)
    planning_s = time.perf_counter() - start
    results = {"autopar": measure("autopar", plan.compile(), profile, dtype)}
    for kind in kinds if kinds is not None else baseline_kinds(jax_mesh, args):
        results[kind] = measure(kind, compile_baseline(fn, args, jax_mesh, kind), profile,
                                dtype)
    return plan, results, planning_s
