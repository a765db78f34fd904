"""autopar.plan and autopar.parallelize."""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autopar._cache import PlanCache
from autopar._check_memory import check_compiled_memory
from autopar._compat import xla_cpu_dots_in_f32
from autopar._dispatch import Program, SignatureChanged, Split, as_planned, signature
from autopar._export import logical_names
from autopar._gc import with_gc_paused
from autopar._stack import with_roomy_stack
from autopar._judge import abstract, main_dtype, simulated_step_s
from autopar._layers import weight_leaves
from autopar._mesh import as_auto_mesh, axis_sizes, with_mesh_when_asked
from autopar._multiprocess import process_0_plan
from autopar import _axis_roles, _inputs, _pipeline, _stage_plan
from autopar._plan import Plan
from autopar._progress import clock_start, progress_clock, progress_line
from autopar._sizes import format_bytes
from autopar.baselines import (baseline_io_shardings, baseline_kinds, baseline_kwargs,
                               baseline_shardings, structure_of_jaxpr)
from autopar.errors import (ArgumentError, AttentionWarning, InfeasiblePlanError,
                            MemoryBudgetWarning, PipelineError, ReplanWarning, warn)
from autopar.passes.estimate import estimate, plan_collectives
from autopar.cost_model.hardware import axis_levels, get_profile
from autopar.cost_model.hlo import analyze, program_peak_bytes
from autopar.passes.annotate import flatten_hints, to_spec
from autopar.passes.backend_options import as_options, choose
from autopar.passes.sequence_parallel import attention_labels
from autopar.passes.emit import compiler_option_notes
from autopar.passes.flax_metadata import check as check_metadata
from autopar.passes.flax_metadata import merge as merge_hints
from autopar.passes.flax_metadata import metadata_hints, traced_under_rules
from autopar.passes.ir import itemsize
from autopar.passes.memory_budget import default_memory_budget_bytes
from autopar.passes.pipeline import PlanOptions, Remat, run_pipeline
from autopar.passes.remat import RematPolicy
from autopar.passes.strategies import MeshContext


def _paths(tree) -> list[str]:
    """The key path of every leaf of ``tree`` (a treedef), as ``jax.tree_util.keystr`` writes
    it."""
    return list(_paths_of(tree))


@functools.lru_cache(maxsize=64)
def _paths_of(tree) -> tuple[str, ...]:
    # Cached: a plan reads each tree's paths several times, and a deep model has thousands.
    dummy = jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves)
    return tuple(jax.tree_util.keystr(p)
                 for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0])


def _state_ties(traced) -> list[tuple[int, int]]:
    """Outputs that replace an input (:func:`autopar._axis_roles.state_ties`): they keep the
    input's sharding."""
    return _axis_roles.state_ties(list(zip(_paths(traced.in_tree), traced.in_avals)),
                                  list(zip(_paths(traced.out_tree), traced.out_avals)))


def _baseline_seeds(example_args, jax_mesh, sizes):
    """seeds_of for run_pipeline: (kind -> a Spec per flat input leaf, the input shardings of
    each hand-written baseline that applies to these arguments; the same for data
    parallelism over each single mesh axis of a mesh with several, "batch over <axis>").
    The baselines read the program's structure (``autopar._tp_structure``) from its trace."""
    def specs_of(traced, kind, name, structure, **kwargs):
        try:
            tree = baseline_shardings(kind, example_args, jax_mesh, structure=structure,
                                      **kwargs)
        except ArgumentError:  # the arguments or the mesh do not suit this baseline
            return None
        specs = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))
        if len(specs) != len(traced.in_avals):  # boxed (flax metadata) arguments
            return None
        return [to_spec(s, a.shape, sizes, f"the {name} baseline")
                for s, a in zip(specs, traced.in_avals)]

    def of(traced) -> tuple[dict, dict]:
        args = traced.in_tree.children()
        structure = (structure_of_jaxpr(traced.closed_jaxpr, args[0].num_leaves)
                     if len(args) >= 2 else None)
        seeds = {kind: specs_of(traced, kind, kind, structure,
                                **baseline_kwargs(jax_mesh, kind))
                 for kind in baseline_kinds(jax_mesh, example_args, structure)}
        axes = jax_mesh.axis_names if len(jax_mesh.axis_names) > 1 else ()
        batch = {f"batch over {a}": specs_of(traced, "dp", f"batch over {a}", structure,
                                             batch_axes=(a,))
                 for a in axes}
        return ({k: v for k, v in seeds.items() if v is not None},
                {k: v for k, v in batch.items() if v is not None})
    return of


def _remat_option(remat) -> dict | None:
    """``plan(remat=...)`` as a forced :class:`passes.pipeline.Remat` (as a dict), or None."""
    if isinstance(remat, bool):
        return None
    names = [p.value for p in RematPolicy]
    if remat not in names:
        raise ArgumentError(f"`remat` must be True, False or a policy name ({', '.join(names)}), "
                            f"got {remat!r}")
    return {"layers": None, "policy": remat}


#: With ``verbose=None`` (the default), progress shows once planning has taken this long.
QUIET_S = 10.0


def _progress(enabled: bool | None):
    """Progress lines on stderr, each with the seconds since planning (or the command) started:
    always (True), never (False), or (None) from the first line after :data:`QUIET_S` seconds
    of this planning on, after the line before it, so a long plan (a deep unrolled model)
    says what it is doing and a short one stays quiet."""
    if enabled is False:
        return lambda msg: None
    begun = time.perf_counter()
    start = clock_start() or begun
    state = {"shown": enabled is True, "held": None}

    def show(t, msg):
        progress_line(msg, t)

    def progress(msg):
        t = time.perf_counter() - start
        if not state["shown"]:
            if time.perf_counter() - begun < QUIET_S:
                state["held"] = (t, msg)
                return
            state["shown"] = True
            print("[autopar] planning is taking a while (verbose=False silences this, "
                  "verbose=True shows it all)", file=sys.stderr, flush=True)
            if state["held"] is not None:
                show(*state["held"])
        show(t, msg)
    return progress


@progress_clock()  # its progress lines, and those of the plans it makes, on one clock
def plan(fn: Callable, *example_args, mesh, hardware=None, memory_budget=None,
         in_shardings=None, out_shardings=None, search: bool = True, logical_axis_rules=None,
         time_limit_s: float = 300.0, tie_state: bool = True, axis_level_overrides=None,
         baseline_seeds: bool = True, remat: bool | str = True,
         check_memory: bool | None = None, verbose: bool | None = None,
         pipeline="auto", overlap: bool = True, batch_axes=None, attention=None,
         exportable: bool = False) -> Plan:
    """Plan how to run ``fn`` on ``mesh``.

    Args:
      fn: a single-device JAX function, e.g. a train step ``(params, opt_state, batch) ->
        (params, opt_state, loss)``.
      *example_args: arrays or ``jax.ShapeDtypeStruct`` pytrees with the shapes and dtypes of a
        real call. Nothing is executed while planning.
      mesh: a ``jax.sharding.Mesh`` (any axis types), a dict ``{"data": 2, "model": 4}``, or
        the same as the CLI's text ``"data=2,model=4"``.
      hardware: a profile name (``"h100"``, ``"tpu-v5e"``, ...), a HardwareProfile, or a path to
        a profile JSON from ``autopar profile``. Default (None, as in ``autopar.compare`` and
        the CLI's ``report``): the current backend's profile (``cpu`` on CPU devices; an
        accelerator without one gets the nearest, with a warning).
      memory_budget: per-device bytes the plan's peak memory must fit in (as
        ``plan.estimate.peak_memory_bytes`` predicts it), or a size such as ``"40GiB"`` or
        ``"64GB"``. Default: the profile's HBM capacity less 10%. When no sharding fits, layers
        are rematerialized (see ``remat``); when still none fits a given budget,
        ``InfeasiblePlanError`` names the smallest peak found and what dominates it; when none
        fits the default one, a ``MemoryBudgetWarning`` says so, as it does for a budget over
        one device's memory (not on simulated CPU devices, whose memory is a guess).
      in_shardings / out_shardings: hints, a pytree (or prefix) of PartitionSpec, NamedSharding
        or None ("autopar decides") shaped like the arguments / results. A hint is always kept.
      logical_axis_rules: MaxText-style ``[("batch", "data"), ("mlp", "model"), ...]``: how
        the logical axis names of flax partitioning metadata on the arguments map to mesh
        axes. Metadata (linen ``nn.with_partitioning`` / ``nn.with_logical_partitioning``,
        nnx ``sharding=``) are hints like ``in_shardings``, which win where both are given.
        Pass the boxed arguments as they are.
      search: False plans like plain GSPMD: the annotations plus their propagation, no ILP;
        values propagation leaves free are replicated. Fast, and a baseline for the search.
      time_limit_s: a safety net on each ILP solve's wall-clock time. Solves are bounded by
        work (simplex iterations, branch-and-bound nodes), so the same
        inputs give the same plan on a busy machine and an idle one; when this limit stops
        a solve first, the best plan found so far is kept and a ``SolverFallbackWarning``
        says the plan may depend on the machine.
      tie_state: results that replace an argument (same pytree path, shape and dtype, such as
        new parameters; or, where no result sits at an argument's path, the first argument's
        path inside it, as ``state = step(state)`` returns) keep that argument's sharding.
      axis_level_overrides: e.g. ``{"data": "dcn"}``: which interconnect a mesh axis crosses.
      baseline_seeds: also plan by propagation from each hand-written baseline's input
        shardings that applies (data parallel, FSDP, Megatron, expert parallel; see
        ``autopar.baselines``), under the annotations, when the ILP needs them: it starts
        from the best of these when its LP relaxation is fractional (a warm start: HiGHS's
        cutoff), and whichever plan, its own or one of these, is predicted fastest is kept
        (``plan.stats["candidates_step_s"]`` lists them), unless the ILP proved its plan
        optimal on a graph too large for them to pay (``passes.candidates.best``). When it
        did not prove its plan optimal, data parallelism over each single mesh axis is tried
        the same way (which axis carries the batch).
      remat: True: when no sharding plan fits the memory budget, let the planner
        rematerialize layers of a train step (``passes.remat``: as ``jax.checkpoint`` with the
        ``dots_saveable`` policy, else ``nothing_saveable``): every layer, or fewer (largest
        activations first) when that gives a plan predicted faster that still fits
        (``passes.pipeline``'s remat search). A policy name (``"dots_saveable"`` or
        ``"nothing_saveable"``): rematerialize every layer with it. False: never.
        ``plan.stats["remat"]`` and the report say which layers.
      check_memory: compile the plan (from abstract arguments; nothing runs) and check its
        per-device peak as XLA reports it (``memory_analysis()``) against ``memory_budget``.
        When it is over, plan again under a budget lowered by the miss, up to twice, then
        raise ``InfeasiblePlanError`` with the predicted and compiled peaks.
        ``plan.stats["memory_checks"]`` lists each round. Default: on when ``memory_budget``
        is given (and the plan is not loaded from a plan cache); ``True`` without a
        ``memory_budget`` checks against the default budget.
      verbose: print progress to stderr: True always, False never, None (the default) once
        planning has taken 10 s.
      pipeline: ``autopar.Pipeline(axis="stage", ...)`` cuts the step's scanned layers into
        stages over that mesh axis (the step must compute its gradients with
        ``autopar.value_and_grad`` or ``autopar.grad``), choosing what it leaves None
        (microbatches, schedule) by the stage search; ``plan.pipeline`` says what was chosen.
        "auto" (the default): when the step marks its loss, also plan pipelined over each
        axis on a slower link than the mesh's fastest (across nodes; every axis when nothing
        else fits), compile each candidate, and keep the one whose compiled program simulates
        fastest on ``hardware`` among those whose compiled peak fits the memory budget
        (``plan.stats["pipeline_search"]`` gives each one's estimate,
        ``plan.stats["pipeline_search_compiled"]`` its program's).
        None: never pipeline.
      overlap: True (the default): also consider strategies that hide communication behind
        compute where the hardware runs collectives asynchronously (a GPU or TPU profile):
        collective matmuls, an all-gather or reduce-scatter split into ring steps each
        overlapping a chunk of its matmul (``passes.overlap``). False: none (for comparison).
        ``plan.stats["overlap"]`` records it; the report names each rewritten op.
      batch_axes: the mesh axes that carry the batch (a name or names): the leading dim of
        every batch argument (each argument after the first that no result replaces) is
        split over them, unless ``in_shardings`` says otherwise, and every op that reads a
        batch argument, and every layer's matmul, pays ten times the plan's lower bound for
        taking the batch split otherwise: it stays there unless leaving saves more than that.
        Default None: by the axis names, as a tie break only: among plans predicted equally
        fast, the batch goes on axes named ``data``, ``batch``, ``dp`` or ``fsdp``, and model
        dims on ``model``, ``tensor``, ``tp`` or ``expert``. ``plan.stats["axis_roles"]`` says
        which axes the program's ops take the batch split over, with a ``note`` when those
        are not the batch axes.
      attention: how every attention node is split (``autopar.attention``, or attention
        autopar recognizes; see ``docs/context_parallel.md``): ``"ulysses"``, ``"ring"``,
        ``"heads"``, ``"batch"`` or ``"replicated"``, over axes the ILP chooses; with the
        mesh axes named as the report writes them, over those: ``"ring(seq)"``,
        ``"ulysses(seq) + ring(data)"``. None (the default): the ILP chooses per layer.
        ``ArgumentError`` when the shapes or the mesh cannot take the one asked.
      exportable: True: a plan whose program is the one plain ``jax.jit(fn,
        in_shardings=plan.in_shardings, out_shardings=plan.out_shardings)`` compiles (XLA's
        propagation decides every intermediate value), so ``plan.to_python`` takes it home
        exactly. The searched plan's input and output shardings and, without hints, each
        hand-written baseline's are compiled that way (from the arguments' shapes; nothing
        runs), and the one whose program simulates fastest on ``hardware`` among those whose
        compiled peak fits the memory budget is kept (none fits: ``InfeasiblePlanError`` for a
        given budget, a ``MemoryBudgetWarning`` for the default one):
        ``plan.stats["exportable"]`` gives each one's simulated step and peak. No pipeline and
        no overlap rewrites. The plan's estimate is autopar's propagation of those shardings;
        ``plan.validate()`` compares it with the program. Default False: the searched plan,
        which also pins intermediate values (``plan.jit()`` runs it; its exported specs alone
        may compile otherwise).

    Returns:
      A :class:`Plan`. In a multi-process run (``jax.distributed``) every process must call
      ``plan`` alike; each returns process 0's plan, so all compile the same program.

    Example::

      plan = autopar.plan(train_step, params, opt_state, batch, mesh={"data": 2, "model": 4})
      params, opt_state, loss = plan.jit()(params, opt_state, batch)
    """
    _inputs.example_arguments(fn, example_args)
    checked = _inputs.options(dict(
        mesh=mesh, hardware=hardware, memory_budget=memory_budget, in_shardings=in_shardings,
        out_shardings=out_shardings, search=search, logical_axis_rules=logical_axis_rules,
        time_limit_s=time_limit_s, tie_state=tie_state, axis_level_overrides=axis_level_overrides,
        baseline_seeds=baseline_seeds, remat=remat, check_memory=check_memory, verbose=verbose,
        pipeline=pipeline, overlap=overlap, batch_axes=batch_axes, attention=attention))
    memory_budget, time_limit_s = checked["memory_budget"], checked["time_limit_s"]
    in_shardings, out_shardings = checked["in_shardings"], checked["out_shardings"]
    options = {"mesh": mesh, "hardware": hardware, "in_shardings": in_shardings,
               "out_shardings": out_shardings, "search": search,
               "logical_axis_rules": logical_axis_rules, "time_limit_s": time_limit_s,
               "tie_state": tie_state, "axis_level_overrides": axis_level_overrides,
               "baseline_seeds": baseline_seeds, "remat": remat, "pipeline": pipeline,
               "overlap": overlap, "batch_axes": batch_axes,
               "attention": attention}
    if _inputs.flag(exportable, "exportable"):
        return _plan_exportable(fn, example_args, memory_budget, verbose, options)
    choice, forced_remat = _FORCED.get()
    token = _FORCED.set((None, None))  # the cached choice is this plan's, not a stage's
    try:
        return _plan_checked(fn, example_args, memory_budget, check_memory, verbose, options,
                             choice, forced_remat)
    finally:
        _FORCED.reset(token)


def _plan_exportable(fn, example_args, memory_budget, verbose, options) -> Plan:
    """``plan(..., exportable=True)``: the searched plan's input and output shardings and
    (without hints) each baseline's, compiled under plain ``jax.jit``; the fastest program
    that fits the memory budget becomes a plan that pins nothing in between."""
    if options["pipeline"] not in (None, "auto"):
        raise ArgumentError(
            "`exportable=True` plans without a pipeline: plain jax.jit cannot run a plan's "
            "pipeline stages from input and output shardings alone. Pass `pipeline=None`, or "
            "drop `exportable=True` and run the plan with `plan.jit()`.")
    options = {**options, "pipeline": None, "overlap": False}
    progress = _progress(verbose)
    searched = _plan_checked(fn, example_args, memory_budget, False, verbose, options)
    mesh = searched.mesh
    io = {"autopar": (searched.in_shardings, searched.out_shardings)}
    hinted = (options["in_shardings"] is not None or options["out_shardings"] is not None
              or any(hint is not None for hint, _ in metadata_hints(
                  example_args, options["logical_axis_rules"])))
    for kind in () if hinted else baseline_kinds(mesh, example_args):
        try:
            io[kind] = baseline_io_shardings(fn, example_args, mesh, kind,
                                             **baseline_kwargs(mesh, kind))
        except ArgumentError:  # the arguments or the mesh do not suit this baseline
            pass
    progress(f"exportable: compiling {len(io)} candidate shardings under plain jax.jit")
    profile = get_profile(options["hardware"])
    budget = (memory_budget if memory_budget is not None
              else default_memory_budget_bytes(profile))
    programs, compiled = _judge_plain(fn, example_args, io, profile)
    pinned_s, _ = _judged(searched.jit().lower(*abstract(example_args)).compile(), profile,
                         main_dtype(fn, example_args))
    fitting = [name for name, (_, peak) in programs.items() if peak <= budget]
    if not fitting:
        fitting = _none_fits(programs, budget, memory_budget is not None)
    best = min(fitting, key=lambda name: programs[name][0])  # the searched plan first among equals
    plain = analyze(compiled[best])   # for to_python's check; the programs are let go
    del compiled
    ins, outs = io[best]
    planned = _plan_checked(fn, example_args, None, False, verbose,
                            {**options, "in_shardings": ins, "out_shardings": outs,
                             "search": False, "pin_intermediates": False})
    planned.stats = {**planned.stats, "exportable": {
        "chosen": best, "step_s": {name: t for name, (t, _) in programs.items()},
        "pinned_step_s": pinned_s,
        "peak_bytes": {name: peak for name, (_, peak) in programs.items()}}}
    planned._plain_summary = (fn, plain)
    return planned


def _none_fits(programs: dict, budget: float, given: bool) -> list[str]:
    """Every candidate, when none of their compiled peaks fits the ``budget``: with a
    ``given`` budget InfeasiblePlanError, else a MemoryBudgetWarning."""
    least = min(programs, key=lambda name: programs[name][1])
    said = (f"no exportable plan fits the memory budget of {format_bytes(budget)} per device: "
            f"the least compiled peak is {format_bytes(programs[least][1])} ({least}'s shardings)")
    if given:
        raise InfeasiblePlanError(
            f"{said}. Raise memory_budget, use more devices, or plan without "
            "`exportable=True`: a searched plan may pin shardings that hold less.")
    warn(f"autopar: {said}; the fastest is kept.", MemoryBudgetWarning)
    return list(programs)


def _judged(compiled, profile, dtype) -> tuple[float, int]:
    """(the simulated step s, the compiled peak bytes per device) of ``compiled``: what a
    candidate program is kept or dropped by."""
    return simulated_step_s(compiled, profile, dtype), program_peak_bytes(compiled)


def _judge_plain(fn, example_args, io: dict, profile) -> tuple[dict, dict]:
    """(name -> (simulated step s, compiled peak bytes per device), name -> the compiled
    program) of ``fn`` under plain ``jax.jit`` with each (in_shardings, out_shardings) of
    ``io``, compiled from the arguments' shapes."""
    dtype, shapes = main_dtype(fn, example_args), abstract(example_args)
    compiled = {name: jax.jit(fn, in_shardings=ins, out_shardings=outs).lower(*shapes).compile()
                for name, (ins, outs) in io.items()}
    return {name: _judged(c, profile, dtype) for name, c in compiled.items()}, compiled


#: (choice, remat) a plan cache's entry gives :func:`plan` to take instead of solving;
#: (None, None) otherwise. Set only by :meth:`Parallelized._plan`, around one call.
_FORCED: contextvars.ContextVar = contextvars.ContextVar("autopar_forced_solution",
                                                         default=(None, None))


@with_roomy_stack
def _plan_checked(fn, example_args, memory_budget, check_memory, verbose, options,
                  choice=None, forced_remat=None) -> Plan:
    """:func:`plan` after its arguments are checked; ``choice`` and ``forced_remat``: a
    solution to take instead of solving (a plan cache's entry, process 0's plan)."""
    options = {**options, "choice": choice, "forced_remat": forced_remat}
    progress = _progress(verbose)
    mesh = options["mesh"]
    try:
        planned, failure = with_mesh_when_asked(
            lambda: _planned_checked(fn, example_args, memory_budget, check_memory, options,
                                     progress), mesh), None
    except Exception as e:  # raised by process_0_plan, after telling the other processes
        planned, failure = None, e
    # Multi-process: the same plan on every process (and on every process this call or none).
    return process_0_plan(
        planned, lambda choice, remat: with_mesh_when_asked(lambda: _plan_once(
            fn, example_args, memory_budget, progress=progress,
            **{**options, "choice": choice, "forced_remat": remat}), mesh),
        progress, failure)


def _planned_checked(fn, example_args, memory_budget, check_memory, options, progress) -> Plan:
    """:func:`_plan_once`, then the compiled memory check when asked (by default, with a
    budget given and no solution to take)."""
    planned = _plan_once(fn, example_args, memory_budget, progress=progress, **options)
    if check_memory is None:
        check_memory = memory_budget is not None and options["choice"] is None
    if not check_memory:
        return planned
    budget = (memory_budget if memory_budget is not None
              else default_memory_budget_bytes(get_profile(options["hardware"])))
    return check_compiled_memory(
        planned, budget,
        lambda target: _plan_once(fn, example_args, memory_budget, target, progress=progress,
                                  **options),
        progress)


@with_gc_paused
def _plan_once(fn: Callable, example_args, memory_budget, target_bytes=None, *, mesh, hardware,
               in_shardings, out_shardings, search, logical_axis_rules, time_limit_s,
               tie_state, axis_level_overrides, baseline_seeds, remat, pipeline, batch_axes,
               progress, overlap, choice, forced_remat, attention=None,
               pin_intermediates: bool = True) -> Plan:
    """:func:`plan` without the compiled memory check; ``target_bytes``: the budget to plan
    under when it is not ``memory_budget`` itself (lowered after a check)."""
    if target_bytes is None:
        target_bytes = memory_budget
    if pipeline == "auto" and choice is None:
        return _plan_auto(fn, example_args, memory_budget, target_bytes, progress=progress,
                          mesh=mesh, hardware=hardware, in_shardings=in_shardings,
                          out_shardings=out_shardings, search=search,
                          logical_axis_rules=logical_axis_rules, time_limit_s=time_limit_s,
                          tie_state=tie_state, axis_level_overrides=axis_level_overrides,
                          baseline_seeds=baseline_seeds, remat=remat, overlap=overlap,
                          batch_axes=batch_axes, attention=attention, choice=choice,
                          forced_remat=forced_remat)
    forced = forced_remat if forced_remat is not None else _remat_option(remat)
    jax_mesh = as_auto_mesh(mesh)
    stages = _pipeline.requested(pipeline, jax_mesh)
    sizes = axis_sizes(jax_mesh)
    profile = get_profile(hardware)
    levels = axis_levels(jax_mesh, profile, axis_level_overrides)
    on_cpu = jax_mesh.devices.flat[0].platform == "cpu"
    mesh_ctx = MeshContext(tuple(jax_mesh.axis_names), sizes, levels, profile,
                           emulated_reduce_scatter=on_cpu, upcast_16bit_collectives=on_cpu,
                           dots_in_f32=on_cpu and xla_cpu_dots_in_f32(),
                           results_held=on_cpu, attention=attention)

    meta = metadata_hints(example_args, logical_axis_rules)
    check_metadata(meta, example_args, sizes)
    labels = {}  # what -> the source of each leaf's hint, for messages

    def pins(hints, what):
        def of(traced):
            tree = traced.in_tree if what == "in_shardings" else traced.out_tree
            avals = traced.in_avals if what == "in_shardings" else traced.out_avals
            hs, paths = flatten_hints(hints, tree, what), _paths(tree)
            labels[what] = [f"{what}{p}" for p in paths]
            if what == "in_shardings":  # explicit hints over flax metadata
                hs, labels[what] = merge_hints(hs, meta, paths, [len(a.shape) for a in avals])
            specs = [to_spec(h, a.shape, sizes, n) for h, a, n in zip(hs, avals, labels[what])]
            if what == "in_shardings" and axis_roles.explicit:
                specs = _axis_roles.pin_batch(specs, traced, batch_of(traced), axis_roles.batch,
                                              sizes)
            return specs
        return of

    axis_roles = _axis_roles.roles(jax_mesh.axis_names, batch_axes)

    def batch_of(traced) -> list[int]:
        return _axis_roles.batch_leaves(traced, _state_ties(traced) if tie_state else [])

    def preferences_of(traced) -> dict:
        """The ILP's tie break by axis names (node -> a penalty per strategy)."""
        return _axis_roles.preferences(traced.graph, batch_of(traced), axis_roles,
                                       weight_leaves(traced.in_tree))

    traced_fn = traced_under_rules(fn, logical_axis_rules, jax_mesh)
    options = PlanOptions(
        mesh_ctx=mesh_ctx, jax_mesh=jax_mesh, in_specs_of=pins(in_shardings, "in_shardings"),
        out_specs_of=pins(out_shardings, "out_shardings"),
        hint_labels_of=lambda _: (labels.get("in_shardings"), labels.get("out_shardings")),
        ties_of=_state_ties if tie_state else None,
        seeds_of=_baseline_seeds(example_args, jax_mesh, sizes) if baseline_seeds else None,
        preferences_of=preferences_of,
        time_limit_s=time_limit_s, search=search,
        choice=None if choice is None else tuple(choice),
        remat_choice=None if forced is None else Remat.from_dict(forced),
        memory_budget_bytes=(target_bytes if target_bytes is not None
                             else default_memory_budget_bytes(profile)),
        strict_budget=memory_budget is not None, remat=remat is True, progress=progress,
        overlap=overlap, pin_intermediates=pin_intermediates)
    plan_layer = plan_post = None
    if stages not in (None, _pipeline.MARK):
        planner = (jax_mesh, stages.axis, profile, axis_level_overrides, plan)
        plan_layer = _stage_plan.layer_planner(*planner)
        plan_post = _stage_plan.post_planner(*planner)
    with _pipeline.planning(stages, jax_mesh, plan_layer,
                            _activation_budget(example_args, jax_mesh, options),
                            plan_post) as context:
        result = run_pipeline(traced_fn, example_args, options)
    graph, strats, choice = result.graph, result.strats, result.solution.choice
    comms = plan_collectives(graph, strats, choice, mesh_ctx)
    est = _pipeline.with_stages(estimate(graph, strats, choice, mesh_ctx, comms), context)
    pipeline_record = _pipeline.record(context, est)
    marked = _pipeline.marked(context)
    if not search and target_bytes is not None and est.peak_memory_bytes > target_bytes:
        raise InfeasiblePlanError(
            f"with search=False the propagated plan peaks at {format_bytes(est.peak_memory_bytes)} "
            f"per device, over memory_budget={format_bytes(target_bytes)}; propagation "
            "does not search for a plan that fits. Use search=True (the default) to let the "
            "ILP fit the budget, or annotate more of the program (e.g. shard the parameters).")
    traced = result.traced

    def shardings(node_ids, tree, side):
        specs = []
        for n in node_ids:
            s = strats[n][choice[n]]
            specs.append((s.out_specs if side == "in" else s.in_specs)[0])
        return jax.tree_util.tree_unflatten(
            tree, [NamedSharding(jax_mesh, sp.to_partition_spec()) for sp in specs])

    sol = result.solution
    stats = {"nodes": len(graph.nodes), "ilp_groups": result.ilp_groups,
             "ilp_variables": sol.num_variables, "ilp_constraints": sol.num_constraints,
             "solver_status": sol.name, "source": sol.source.value,
             "timings_s": result.timings_s, **result.ilp_stats,
             "remat": result.remat.to_dict() if result.remat else None,
             "loss_marked": marked, "hardware_default": hardware is None,
             "logical_axes": logical_names(example_args), "overlap": overlap,
             "rewrites": _rewrites(graph, strats, choice),
             "axis_roles": _axis_roles.check(
                 graph, strats, choice, batch_of(traced), axis_roles, sizes,
                 made="searched" if search else "propagated" if pin_intermediates
                 else "exported")}
    device = jax_mesh.devices.flat[0]
    option_notes = choose(profile, device, compiler_option_notes(graph, device.platform))
    stats["compiler_options"] = [n.to_dict() for n in option_notes]
    stats["attention"] = attention_labels(graph, strats, choice)
    if attention is not None and not stats["attention"]:
        warn(
            f"`attention={attention!r}` was asked for, but the step has no attention autopar "
            "recognizes: it is planned as it is, nothing split over the sequence. Call "
            "`autopar.attention`, or write attention in a form docs/context_parallel.md lists "
            "and take the gradient with `autopar.value_and_grad`.", AttentionWarning)
    # the compiled program's ops are named jit(<fn>)/..., as under the user's own jax.jit
    result.flat_fn.__name__ = getattr(fn, "__name__", "step")
    return Plan(jax_mesh, shardings(graph.input_nodes, traced.in_tree, "in"),
                shardings(graph.output_nodes, traced.out_tree, "out"), est, profile.name,
                _paths(traced.in_tree), _paths(traced.out_tree), result.fallbacks, stats,
                result.flat_fn, traced.in_tree, traced.out_tree, traced.in_avals,
                (graph, strats, choice, comms),
                compiler_options=as_options(option_notes),
                pipeline=pipeline_record)


def _rewrites(graph, strats, choice) -> dict[str, int]:
    """How many nodes the plan emits as each kind of rewrite (``passes.emit.REWRITES``)."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        rewrite = strats[node.id][choice[node.id]].rewrite
        if rewrite is not None:
            counts[rewrite.kind.value] = counts.get(rewrite.kind.value, 0) + 1
    return counts


def _plan_auto(fn, example_args, memory_budget, target_bytes, *, progress, **options) -> Plan:
    """``pipeline="auto"``: the plan that does not pipeline and, when the step marks its loss
    (``autopar.value_and_grad``), a pipelined plan over each candidate axis
    (``_pipeline.candidate_axes``: the slow ones, or all when nothing else fits); among those
    whose compiled program fits the memory budget, the one that simulates fastest
    (:func:`_referee`) is kept. ``plan.stats["pipeline_search"]`` gives each candidate's
    predicted step time, or why it cannot pipeline; ``"pipeline_search_compiled"`` the
    simulated step of each one's program, ``"pipeline_search_compiled_peak_bytes"`` its
    peak."""
    def planned(pipeline):
        return _plan_once(fn, example_args, memory_budget, target_bytes, progress=progress,
                          pipeline=pipeline, **options)

    base = planned(_pipeline.MARK)
    if not base.stats["loss_marked"]:
        return base
    jax_mesh = as_auto_mesh(options["mesh"])
    profile = get_profile(options["hardware"])
    budget = target_bytes if target_bytes is not None else default_memory_budget_bytes(profile)
    levels = axis_levels(jax_mesh, profile, options["axis_level_overrides"])
    fits = lambda p: p.estimate.peak_memory_bytes <= budget  # noqa: E731
    tried, named = {"none": base.estimate.step_time_s}, {"none": base}
    for axis in _pipeline.candidate_axes(jax_mesh, levels, fits(base)):
        progress(f"pipeline search: stages over {axis!r}")
        try:
            named[axis] = planned(_pipeline.Pipeline(axis=axis))
            tried[axis] = named[axis].estimate.step_time_s
        except PipelineError as e:
            tried[axis] = f"{type(e).__name__}: {e}"
    compiled, peaks = {}, {}
    if len(named) > 1:
        refereed = _referee(list(named.values()), fn, example_args, profile, progress)
        for name, p in list(named.items()):
            if isinstance(refereed[id(p)], str):   # a pipelined candidate XLA did not compile
                tried[name] = refereed[id(p)]
                del named[name]
            else:
                compiled[name], peaks[name] = refereed[id(p)]

    def fits_as_compiled(name) -> bool:
        return peaks.get(name, named[name].estimate.peak_memory_bytes) <= budget

    best_name = min(named, key=lambda n: (not fits_as_compiled(n),
                                          compiled.get(n, named[n].estimate.step_time_s)))
    best = named[best_name]
    best.stats["pipeline_search"] = tried
    if compiled:
        best.stats["pipeline_search_compiled"] = compiled
        best.stats["pipeline_search_compiled_peak_bytes"] = peaks
    return best


def _referee(plans: list[Plan], fn, example_args, profile, progress
             ) -> dict[int, tuple[float, int] | str]:
    """Each candidate of ``pipeline="auto"`` compiled (from the arguments' shapes; nothing
    runs): its step simulated on ``profile`` (``_judge.simulated_step_s``) and its peak per
    device, keyed by the plan's id. The estimates of a pipelined and an unpipelined plan err
    differently (the pipeline's stages are priced from one layer's plan), so the programs
    decide. A pipelined candidate XLA cannot compile gets why instead (the plan without one
    must compile)."""
    progress(f"pipeline search: compiling the {len(plans)} candidates to compare their programs")
    dtype = main_dtype(fn, example_args)
    results: dict[int, tuple[float, int] | str] = {}
    for p in plans:
        try:
            results[id(p)] = _judged(p.jit().lower(*example_args).compile(), profile, dtype)
        except jax.errors.JaxRuntimeError as e:
            if p.pipeline is None:
                raise
            lines = str(e.args[0]).splitlines() if e.args else []
            results[id(p)] = f"does not compile: {lines[0] if lines else type(e).__name__}"
    return results


def _activation_budget(example_args, mesh, options: PlanOptions) -> float:
    """Per-device bytes a pipeline's activations may take: the memory budget less the step's
    arguments and as much again for their new values, spread over the mesh."""
    held = sum(int(np.prod(np.shape(a))) * itemsize(a.dtype)
               for a in jax.tree.leaves(example_args) if hasattr(a, "dtype"))
    return max(options.memory_budget_bytes - 2 * held / mesh.devices.size, 0.0)


class Parallelized:
    """``fn`` planned on its first call for each input signature, then reused.

    The signature is the tree structure, shapes and dtypes of the array arguments and the
    values of the static ones: those named static, and leaves that are not arrays (floats,
    bools, callables, as ``equinox.filter_jit`` treats them; Python ints are arrays).
    ``plans_made`` counts the plans made so far. A call with what the last one had (same
    tree, shapes, dtypes and shardings, such as a train step fed its own results) goes
    straight to the compiled program: its check costs about what ``jax.jit``'s dispatch does.
    """

    def __init__(self, fn: Callable, plan_kwargs: dict, static_argnums=(), static_argnames=(),
                 donate_argnums=(), cache_dir=None):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._kwargs = plan_kwargs
        self._static_argnums, self._static_argnames = _static_arguments(
            fn, _as_tuple(static_argnums, "static_argnums"),
            _as_tuple(static_argnames, "static_argnames"))
        self._donate_argnums = _as_tuple(donate_argnums, "donate_argnums")
        both = set(self._static_argnums) & set(self._donate_argnums)
        if both:
            raise ArgumentError(f"argument(s) {sorted(both)} are both static and donated; a "
                                "static argument is a Python value, not a buffer to donate")
        self._cache: dict[Any, tuple[Split, Program]] = {}
        self._last: tuple | None = None  # (static args, tree, Split, Program) of the last call
        self.plan: Plan | None = None
        self.plans_made = 0      # plans solved
        self.plans_loaded = 0    # plans taken from the disk cache
        self._disk = PlanCache(cache_dir) if cache_dir is not None else None
        self._replan_warned = False
        self._positions = _keyword_positions(fn)

    def __repr__(self) -> str:
        mesh = self._kwargs.get("mesh")
        sizes = mesh if isinstance(mesh, dict) else getattr(mesh, "shape", None)
        shown = " x ".join(f"{a}={n}" for a, n in dict(sizes).items()) if sizes else repr(mesh)
        return (f"autopar.parallelize({self.__name__}, mesh={shown}): {self.plans_made} "
                f"plan(s) made, {self.plans_loaded} loaded from the plan cache")

    def _split(self, args, kwargs):
        if not kwargs and not self._static_argnums:
            return (), (), args
        unknown = sorted(set(kwargs) - set(self._static_argnames))
        if unknown:
            raise ArgumentError(f"keyword argument(s) {unknown} of `{self.__name__}` are not "
                                "static, nor the parameters right after those passed by "
                                "position: pass arrays positionally, or name them in "
                                "static_argnames")
        static = tuple((i, args[i]) for i in self._static_argnums if i < len(args))
        static_kw = tuple(sorted(kwargs.items()))
        try:
            hash((static, static_kw))
        except TypeError as e:
            raise ArgumentError(f"static arguments of `{self.__name__}` must be hashable: {e}"
                                ) from None
        return static, static_kw, tuple(a for i, a in enumerate(args)
                                        if i not in self._static_argnums)

    def _bound_by_position(self, args, kwargs) -> tuple[tuple, dict]:
        """Keyword arguments that are not static and name the parameters right after the
        positional ones (``step(state, batch=batch)``), moved to their positions, as the
        function binds them."""
        if not kwargs:
            return args, kwargs
        args, kwargs = list(args), dict(kwargs)
        for name in self._positions[len(args):]:
            if name is None or name not in kwargs or name in self._static_argnames:
                break
            args.append(kwargs.pop(name))
        return tuple(args), kwargs

    def __call__(self, *args, **kwargs):
        args, kwargs = self._bound_by_position(args, kwargs)
        static, static_kw, dynamic = self._split(args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten(dynamic)
        last = self._last
        if (last is not None and last[1] == tree and last[0] == (static, static_kw)
                and last[2].same_static(leaves)):
            try:  # nothing changed since the last call: straight to the program
                out = last[3].fast(last[2].arrays_of(leaves))
                self.plan = last[3].plan
                return out
            except (SignatureChanged, ValueError, TypeError):
                pass  # new shapes, or arguments placed elsewhere: the full path below
        split = Split.of(leaves, tree)
        key = (static, static_kw, signature(split))
        try:
            hash(key)
        except TypeError as e:
            raise ArgumentError(f"`{self.__name__}`: a leaf of its arguments that is not an "
                                f"array is static and must be hashable: {e}") from None
        if key not in self._cache:
            self._warn_of_replans(key, split)
            self._cache[key] = (split, self._program(args, static, static_kw, split, key[2]))
        program = self._cache[key][1]
        self.plan = program.plan
        placed = as_planned(split.arrays, program.flat_shardings, program.host_ok)
        out = (program(placed) if program.compiled_once else
               program.first_call(placed, self._kwargs.get("verbose")))
        self._last = ((static, static_kw), tree, split, program)
        return out

    def _warn_of_replans(self, key, split: Split) -> None:
        """Warn (once) on the third plan of the same arrays that only a non-array leaf's value
        asked for: a Python float that changes every step (a scheduled learning rate) plans
        and compiles the step again each time."""
        static, static_kw, (tree, leaves, arrays) = key
        same = [k for k in self._cache if k[:2] == (static, static_kw)
                and k[2][0] == tree and k[2][2] == arrays]
        if len(same) != 2 or self._replan_warned:
            return
        self._replan_warned = True
        before = dict(same[-1][2][1])
        try:
            changed = next(((i, before.get(i), v) for i, v in leaves
                            if not before.get(i) == v), None)
        except Exception:  # noqa: BLE001 (a static leaf whose == is not a bool: not named)
            changed = None
        where = "" if changed is None else (
            f" (argument leaf {changed[0]}: {changed[1]!r}, now {changed[2]!r})")
        warn(
            f"`{self.__name__}` is planned and compiled a third time for the same arrays, because "
            f"a leaf that is not an array changed{where}. Such leaves (floats, bools, any "
            "object) are static, as in equinox.filter_jit: pass a value that changes every step "
            "as an array (jnp.asarray(lr)) to keep one plan.", ReplanWarning)

    def _program(self, args, static, static_kw, split: Split, sig) -> Program:
        """Plan ``fn`` for this signature and jit its program."""
        fn, n_args = self._fn, len(args)
        dynamic_pos = [i for i in range(n_args) if i not in self._static_argnums]
        hints = self._kwargs.get("in_shardings")
        if isinstance(hints, tuple) and len(hints) == n_args > len(dynamic_pos):
            static = ", ".join(str(i) for i in range(n_args) if i not in dynamic_pos)
            raise ArgumentError(
                f"`in_shardings` has {n_args} entries, one per argument, but hints the "
                f"{len(dynamic_pos)} non-static arguments only (static argument {static} is "
                "not counted): leave the static arguments' entries out")

        def bound(*dyn):
            leaves = split.merge(jax.tree_util.tree_leaves(dyn))
            full = dict(static)
            full.update(zip(dynamic_pos, jax.tree_util.tree_unflatten(split.tree, leaves)))
            return fn(*(full[i] for i in range(n_args)), **dict(static_kw))
        bound.__name__ = bound.__qualname__ = getattr(fn, "__name__", "fn")  # its errors
        # jax's errors name the file and line of inspect.unwrap(fun): fn's, not this wrapper's;
        # the signature stays bound's own (plan() checks the arguments against it)
        bound.__signature__ = inspect.signature(bound)
        bound.__wrapped__ = fn

        p = self._plan(bound, split.dynamic_tree(), (static, static_kw), sig)
        donate = tuple(dynamic_pos.index(i) for i in self._donate_argnums if i in dynamic_pos)
        if donate:
            p = p.with_donation(donate)
        p._require_program("jit")
        return Program(p, p._flat_fn)

    def _plan(self, bound, dynamic, static, sig) -> Plan:
        disk_key = None
        if self._disk is not None:
            options = {k: v for k, v in self._kwargs.items() if k not in ("mesh", "verbose")}
            disk_key = self._disk.key(self._fn, as_auto_mesh(self._kwargs["mesh"]),
                                      get_profile(self._kwargs.get("hardware")), sig,
                                      static, options, dynamic)

            def replan(choice, remat):
                token = _FORCED.set((choice, remat))
                try:
                    return plan(bound, *dynamic, **self._kwargs)
                finally:
                    _FORCED.reset(token)

            p = self._disk.lookup(disk_key, replan)
            if p is not None:
                self.plans_loaded += 1
                return p
        p = plan(bound, *dynamic, **self._kwargs)
        self.plans_made += 1
        if disk_key is not None:
            self._disk.store(disk_key, p)
        return p


def _keyword_positions(fn: Callable) -> tuple[str | None, ...]:
    """The name of each positional parameter of ``fn`` that may be passed by keyword (None
    for a positional-only one); empty where ``fn`` has no signature to read."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ()
    return tuple(p.name if p.kind is p.POSITIONAL_OR_KEYWORD else None for p in params
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _static_arguments(fn: Callable, argnums: tuple, argnames: tuple) -> tuple[tuple, tuple]:
    """``argnums`` and ``argnames`` completed from ``fn``'s signature, as ``jax.jit`` does: a
    static parameter is static whether it is passed by position or by keyword."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): as given
        return argnums, argnames
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = list(argnames) + [positional[i] for i in argnums
                              if isinstance(i, int) and 0 <= i < len(positional)
                              and positional[i] not in argnames
                              and params[i].kind is not params[i].POSITIONAL_ONLY]
    nums = list(argnums) + [positional.index(n) for n in argnames
                            if n in positional and positional.index(n) not in argnums]
    return tuple(nums), tuple(names)


def _as_tuple(value, name: str) -> tuple:
    if isinstance(value, (int, str)):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise ArgumentError(f"`{name}` must be an int/str or a sequence of them, got "
                            f"{value!r}") from None


def parallelize(fn: Callable | None = None, *, mesh, static_argnums=(), static_argnames=(),
                donate_argnums=(), cache_dir=None, **plan_kwargs):
    """Wrap ``fn`` so that it is planned on its first call for each input signature.

    Usable as ``parallelize(fn, mesh=...)`` or as ``@parallelize(mesh=...)``. Arguments are
    moved to the planned shardings on every call, so plain host arrays work on the first step.
    The wrapper's ``.plan`` is the Plan of the last call; its ``in_shardings`` cover the
    non-static arguments, in order (with no static arguments: shaped like the arguments, ready
    to restore a checkpoint into, see ``examples/checkpoint_orbax.py``).

    Args:
      fn: the single-device function, as :func:`plan` takes it.
      mesh: as :func:`plan`'s: a ``jax.sharding.Mesh``, a dict ``{"data": 2, "model": 4}``
        or ``"data=2,model=4"``.
      static_argnums / static_argnames: arguments that are Python values (hashable), not
        arrays: part of the signature, as in ``jax.jit`` (either names a parameter passed by
        position or by keyword). An array passed by keyword to the parameter right after
        those passed by position (``step(state, batch=batch)``) is taken as passed by
        position; other keyword arguments are refused: pass arrays by position.
      donate_argnums: positional arguments whose buffers the program may reuse for its
        results (e.g. params and optimizer state in a train step), as in ``jax.jit``. The
        plan records them (``plan.donate_argnums``, among the non-static arguments) and its
        peak memory estimate counts the reuse.
      cache_dir: a folder for an on-disk plan cache, so that a restarted program does not
        solve again. An entry is used only for the same function (its source and what it
        closes over), arguments, mesh, hardware, options and versions of autopar and jax; a
        corrupted or stale entry is ignored with a ``StalePlanCacheWarning``, and a folder
        that cannot be written gives an ``UnusableCacheDirWarning`` (the plan is not
        cached).
      plan_kwargs: those of :func:`plan` (``hardware``, ``in_shardings``, ...) but
        ``exportable``, applied to the non-static arguments.

    Example::

      @autopar.parallelize(mesh={"data": 2, "model": 4}, donate_argnums=(0, 1))
      def train_step(params, opt_state, batch): ...
    """
    def wrap(f):
        static, names, donate = _inputs.parallelize_arguments(
            f, static_argnums, static_argnames, donate_argnums, cache_dir)
        if "exportable" in plan_kwargs:
            raise ArgumentError(
                "`parallelize` runs its plans itself, so it takes no `exportable`: drop it, "
                "or call `autopar.plan(..., exportable=True)` and `plan.to_python(path)` to "
                "take a plan home.")
        kwargs = _inputs.options(dict(plan_kwargs, mesh=mesh))
        return Parallelized(f, kwargs, static, names, donate, cache_dir)
    return wrap if fn is None else wrap(fn)
