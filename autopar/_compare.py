"""Judging a plan by what XLA compiled, beside hand-written baselines.

:func:`measure` reads a compiled program's ground truth (``cost_model.hlo``) and prices it on a
hardware profile (``cost_model.reference``). :func:`compare` compiles autopar's plan and the
baselines for the same function and mesh, from abstract arguments, so nothing runs.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import jax

from autopar import _api, baselines
from autopar._judge import abstract, main_dtype
from autopar.baselines import baseline_kinds
from autopar.baselines import baseline_kwargs as _baseline_kwargs
from autopar._mesh import as_auto_mesh, mesh_text, same_axes, with_mesh_when_asked
from autopar._stack import with_roomy_stack
from autopar.errors import ArgumentError, ShardingConflictWarning
from autopar.cost_model.hardware import get_profile
from autopar.cost_model.hlo import HloSummary, analyze
from autopar.cost_model.reference import reference_step_time_s
from autopar.cost_model.timeline import simulate


@dataclass(frozen=True)
class Measured:
    """Per-device measures of one compiled program.

    ``step_time_s`` is the reference price: compute plus communication with no overlap, each
    while body's flops counted once (as XLA's cost analysis counts them). ``makespan_s`` and
    ``exposed_comm_s`` come from the simulated timeline (``cost_model.timeline``): kernels at
    their roofline, loops at their trip counts, and on a profile whose collectives run
    asynchronously (GPU, TPU) every collective issued when its operands are ready and awaited
    at its first use, as their schedulers run them (XLA:CPU compiles them synchronously);
    ``exposed_comm_s`` is the part of the makespan the compute stream waits for communication.
    """
    name: str
    step_time_s: float        # reference step time on the profile, from the compiled HLO
    wire_bytes: float
    flops: float
    peak_memory_bytes: int
    summary: HloSummary
    makespan_s: float         # the simulated timeline's step time
    exposed_comm_s: float     # the communication no compute hides, on the timeline

    def fits(self, profile) -> bool:
        return self.peak_memory_bytes <= profile.hbm_capacity_bytes


def measure(name: str, compiled, profile, dtype) -> Measured:
    """``compiled``'s measures on ``profile``, every matmul priced at ``dtype``'s rate (the
    program's own: :func:`main_dtype`; XLA:CPU computes bf16 matmuls in f32, so the compiled
    text cannot tell)."""
    s = analyze(compiled)
    timeline = simulate(compiled.as_text(), profile, dtype,
                        scheduled=profile.async_collectives)
    return Measured(name=name, step_time_s=reference_step_time_s(s, profile, dtype),
                    wire_bytes=s.wire_bytes, flops=s.flops,
                    peak_memory_bytes=s.peak_memory_bytes, summary=s,
                    makespan_s=timeline.step_time_s, exposed_comm_s=timeline.exposed_comm_s)


def compute_only_limit_s(fn, args, profile, dtype, devices: int, compiler_options=None) -> float:
    """The step time no plan over ``devices`` devices can beat: the single-device program's
    simulated timeline (every kernel at its roofline, no communication) split evenly over
    the devices, all communication hidden. ``fn`` is compiled once on one device from the
    shapes of ``args`` (nothing runs)."""
    compiled = jax.jit(fn).lower(*abstract(args)).compile(compiler_options=compiler_options)
    return simulate(compiled.as_text(), profile, dtype).step_time_s / devices


def compile_baseline(fn, args, mesh, kind: str):
    """Baseline ``kind``'s program, compiled (a context-parallel one, ``"ulysses"`` or
    ``"ring"``, by :func:`baselines.compile_context_baseline`)."""
    if kind in {k.value for k in baselines.ContextBaseline}:
        return baselines.compile_context_baseline(fn, args, mesh, kind)
    return baselines.jit_baseline(fn, args, mesh, kind,
                                  **_baseline_kwargs(mesh, kind)).lower(*args).compile()


def predict_baselines(fn, args, mesh, *, hardware=None, kinds=("dp", "fsdp"), search=False,
                      **plan_kwargs):
    """autopar's estimate for each hand-written baseline (``jax.jit`` with the baseline's input
    and output shardings, :func:`compile_baseline`). With ``search=False`` (the default) the
    inside of the program comes from propagating those shardings, as XLA's propagation does
    for the hand-written jit, so the plan predicts the baseline's own program; with
    ``search=True`` the ILP plans the inside, the best program with the baseline's inputs and
    outputs. Nothing is compiled. Returns {kind: Plan}."""
    jax_mesh = as_auto_mesh(mesh)
    out = {}
    for kind in kinds:
        ins, outs = baselines.baseline_io_shardings(fn, args, jax_mesh, kind,
                                                    **_baseline_kwargs(jax_mesh, kind))
        with warnings.catch_warnings():
            # The baseline's own shardings meeting: XLA reshards there too, nothing to tell.
            warnings.simplefilter("ignore", ShardingConflictWarning)
            out[kind] = _api.plan(fn, *args, mesh=jax_mesh, hardware=hardware,
                                     in_shardings=ins, out_shardings=outs, search=search,
                                     **plan_kwargs)
    return out


@with_roomy_stack
def compare(fn, args, mesh, *, hardware=None, kinds=None, plan=None, dtype=None,
            **plan_kwargs):
    """Measures of autopar's plan and of each hand-written baseline, all compiled from
    ``args`` (nothing runs).

    Arguments:
      fn: the function to plan, as for :func:`autopar.plan`.
      args: its example arguments, as a tuple (arrays or ``jax.ShapeDtypeStruct`` leaves).
      mesh: a ``jax.sharding.Mesh``, or axis name -> size.
      hardware: as :func:`autopar.plan`'s (default: this backend's profile).
      kinds: the baselines to compile, by name (``"dp"``, ``"fsdp"``, ``"megatron"``, ...,
        and the context-parallel ``"ulysses"`` and ``"ring"``, over every device, for a train
        step ``fn(params, opt_state, batch) -> (params, opt_state, loss)``); None: every
        baseline that applies to ``fn`` on ``mesh`` (not the context-parallel ones).
      plan: a plan of ``fn`` on ``mesh`` already made; None: plans it here.
      dtype: the compute dtype whose peak rate prices the flops, the same for every program;
        None prices them at the program's own dtypes (its most common floating dtype), so a
        float32 model is not priced as if it ran in bfloat16.
      plan_kwargs: passed on to :func:`autopar.plan` when ``plan`` is None.

    Returns:
      (plan, {name: Measured}, planning_time_s): "autopar" and each baseline's compiled
      program, measured (step time, wire bytes, flops, peak memory, simulated timeline).
    """
    if not isinstance(args, tuple):
        raise ArgumentError(f"`args` must be the tuple of example arguments, got "
                            f"{type(args).__name__}: call compare(fn, (params, batch), mesh)")
    jax_mesh = as_auto_mesh(mesh)
    profile = get_profile(hardware)
    if plan is not None and not same_axes(plan.mesh, jax_mesh):
        raise ArgumentError(
            f"`plan` was made for mesh {mesh_text(plan.mesh)} and the baselines would run "
            f"on {mesh_text(jax_mesh)}: pass the plan's mesh, or leave `plan` out to "
            "plan on this one")
    start = time.perf_counter()
    if plan is None:
        plan = _api.plan(fn, *args, mesh=jax_mesh, hardware=profile, **plan_kwargs)
    planning_s = time.perf_counter() - start

    def baselines_measured():
        priced_at = main_dtype(fn, args) if dtype is None else dtype
        results = {"autopar": measure("autopar", plan.compile(), profile, priced_at)}
        structure = baselines.structure_of(fn, args) if len(args) >= 2 else None
        for kind in kinds if kinds is not None else baseline_kinds(jax_mesh, args, structure):
            results[kind] = measure(kind, compile_baseline(fn, args, jax_mesh, kind), profile,
                                    priced_at)
        return results
    return plan, with_mesh_when_asked(baselines_measured, jax_mesh), planning_s
