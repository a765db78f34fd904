"""Judging a plan by what XLA compiled, beside hand-written baselines.

:func:`measure` reads a compiled program's ground truth (``cost_model.hlo``) and prices it on a
hardware profile (``cost_model.reference``). :func:`compare` compiles autopar's plan and the
baselines for the same function and mesh, from abstract arguments, so nothing runs.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from autopar import _api, baselines
from autopar._judge import abstract, main_dtype
from autopar.baselines import baseline_kinds
from autopar.baselines import baseline_kwargs as _baseline_kwargs
from autopar._mesh import as_auto_mesh, mesh_text, same_axes, with_mesh_when_asked
from autopar._stack import with_roomy_stack
from autopar.errors import ArgumentError, ShardingConflictWarning, UnknownHardwareError
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
    summary: HloSummary = field(repr=False)   # every collective's HLO: kilobytes of text
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


def _kinds(kinds) -> tuple[str, ...] | None:
    """``compare``'s ``kinds``, checked before anything is planned or compiled."""
    if kinds is None:
        return None
    if isinstance(kinds, str):
        raise ArgumentError(f"`kinds` is the string {kinds!r}: pass a tuple of baseline names, "
                            f"e.g. kinds=({kinds!r},)")
    context = {k.value for k in baselines.ContextBaseline}
    for kind in kinds:
        if kind not in context:
            try:
                baselines.parse_kind(kind)
            except ArgumentError:
                choices = [m.value for m in baselines.Baseline] + sorted(context)
                raise ArgumentError(f"unknown baseline kind {kind!r} in `kinds`; valid choices "
                                    f"are {', '.join(map(repr, choices))}") from None
    return tuple(kinds)


def _check_plan(plan, args, mesh) -> None:
    """An ArgumentError unless ``plan`` was made on ``mesh``'s axes for arguments of
    ``args``'s shapes and dtypes (a loaded plan, which has none, is refused when compiled)."""
    if not same_axes(plan.mesh, mesh):
        raise ArgumentError(
            f"`plan` was made for mesh {mesh_text(plan.mesh)} and the baselines would run "
            f"on {mesh_text(mesh)}: pass the plan's mesh, or leave `plan` out to plan on "
            "this one")
    if not plan._arg_avals:
        return
    given = [(tuple(a.shape), jnp.dtype(a.dtype)) for a in jax.tree_util.tree_leaves(
        abstract(args))]
    planned = [(tuple(a.shape), jnp.dtype(a.dtype)) for a in plan._arg_avals]
    if given != planned:
        where = next((i for i, (g, p) in enumerate(zip(given, planned)) if g != p),
                     min(len(given), len(planned)))
        said = (f"argument leaf {plan.in_paths[where]} is {_aval_text(planned[where])} in the "
                f"plan and {_aval_text(given[where])} here" if where < min(len(given),
                                                                            len(planned))
                else f"the plan has {len(planned)} argument leaves and `args` {len(given)}")
        raise ArgumentError(f"`plan` was made for other arguments than `args` ({said}): pass "
                            "the arguments it was planned for, or leave `plan` out to plan for "
                            "these")


def _aval_text(aval) -> str:
    shape, dtype = aval
    return f"{dtype.name}{list(shape)}"


@with_roomy_stack
def compare(fn, args, mesh, *, hardware=None, kinds=None, plan=None, dtype=None,
            **plan_kwargs):
    """Measures of autopar's plan and of each hand-written baseline, all compiled from
    ``args`` (nothing runs).

    Arguments:
      fn: the function to plan, as for :func:`autopar.plan`.
      args: its example arguments, as a tuple (arrays or ``jax.ShapeDtypeStruct`` leaves).
      mesh: a ``jax.sharding.Mesh``, or axis name -> size.
      hardware: as :func:`autopar.plan`'s (default: the profile ``plan`` was made for, else
        this backend's).
      kinds: the baselines to compile, by name (``"dp"``, ``"fsdp"``, ``"megatron"``, ...,
        and the context-parallel ``"ulysses"`` and ``"ring"``, over every device, for a train
        step ``fn(params, opt_state, batch) -> (params, opt_state, loss)``); None: every
        baseline that applies to ``fn`` on ``mesh`` (not the context-parallel ones).
      plan: a plan of ``fn`` on ``mesh`` for arguments shaped as ``args``, already made;
        None: plans it here.
      dtype: the compute dtype whose peak rate prices the flops, the same for every program;
        None prices them at the program's own dtypes (its most common floating dtype), so a
        float32 model is not priced as if it ran in bfloat16.
      plan_kwargs: passed on to :func:`autopar.plan` when ``plan`` is None.

    Returns:
      (plan, {name: Measured}, planning_time_s): "autopar" and each baseline's compiled
      program, measured (step time, wire bytes, flops, peak memory, simulated timeline);
      ``planning_time_s`` is 0 for a ``plan`` given.
    """
    if not isinstance(args, tuple):
        raise ArgumentError(f"`args` must be the tuple of example arguments, got "
                            f"{type(args).__name__}: call compare(fn, (params, batch), mesh)")
    jax_mesh = as_auto_mesh(mesh)
    kinds = _kinds(kinds)
    if plan is not None:
        _check_plan(plan, args, jax_mesh)
    if plan is not None and hardware is None:   # price it on the profile it was planned for
        try:
            profile = get_profile(plan.hardware)
        except UnknownHardwareError:
            raise ArgumentError(f"`plan` was made for hardware profile `{plan.hardware}`, "
                                "which is not a bundled profile's name: pass that profile "
                                "as `hardware=`") from None
    else:
        profile = get_profile(hardware)
    planning_s = 0.0
    if plan is None:
        start = time.perf_counter()
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
