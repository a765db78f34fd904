"""The pass pipeline. :func:`run_pipeline` lists the passes in order:

trace -> [remat] -> annotate -> strategies -> propagate -> cluster -> solve -> emit

With ``search=False`` propagation gives the whole plan and cluster/solve do not run (plain
GSPMD). When no plan fits the memory budget, the passes after trace run again on the program
with layers rematerialized (``passes.remat``): every layer, or fewer when that is predicted
faster and still fits (:func:`_remat_search`).
Pipeline stages and collective overlap are not in this version; see README.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

from autopar.passes.estimate import value_specs
from autopar.errors import MemoryBudgetWarning, RematWarning
from autopar.passes.annotate import annotate
from autopar.passes.background import Deferred, usable_cores
from autopar.passes.cluster import cluster
from autopar.passes.dedup import Groups, node_keys, structural_colors, tie_groups
from autopar.passes.emit import build_flat_fn
from autopar.passes.ir import Graph
from autopar.passes.memory_budget import input_labels, peak_lower_bound_bytes
from autopar.passes.memory_fit import over_budget_error
from autopar.passes.propagate import propagate
from autopar.passes.candidates import (
    best_of,
    candidate_starts,
    propagate_from,
    propagated_plans,
    step_times,
)
from autopar.passes.remat import (
    RematPolicy,
    rematerialize,
    residual_bytes,
    scanned_layers,
)
from autopar.passes.solution import Solution, SolveStatus, Source
from autopar.passes.solve import solve
from autopar.passes.strategies import MeshContext, Strategy, build_strategies
from autopar.passes.trace import Traced, trace


@dataclass(frozen=True)
class Remat:
    """Layers rematerialized (None: every layer), and the policy (``passes.remat``)."""
    layers: tuple[str, ...] | None
    policy: RematPolicy

    def to_dict(self) -> dict:
        return {"layers": None if self.layers is None else list(self.layers),
                "policy": self.policy.value}

    @classmethod
    def from_dict(cls, d: dict) -> Remat:
        return cls(None if d["layers"] is None else tuple(d["layers"]), RematPolicy(d["policy"]))


@dataclass
class PipelineResult:
    traced: Traced
    strats: list[list[Strategy]]
    solution: Solution
    fallbacks: dict[str, int]
    flat_fn: object = None
    timings_s: dict[str, float] = field(default_factory=dict)
    ilp_groups: int = 0
    ilp_stats: dict = field(default_factory=dict)  # ILP size before and after coarsening
    groups: Groups | None = None
    remat: Remat | None = None

    @property
    def graph(self) -> Graph:
        return self.traced.graph


@dataclass(frozen=True)
class _Options:
    """What every planning attempt of one call shares (see :func:`run_pipeline`)."""
    mesh_ctx: MeshContext
    in_specs_of: object
    out_specs_of: object
    ties_of: object
    time_limit_s: float
    progress: object
    choice: list[int] | None
    search: bool
    hint_labels_of: object
    seeds_of: object
    dedup_layers: bool
    memory_budget_bytes: float | None


def run_pipeline(fn, args, mesh_ctx: MeshContext, jax_mesh, *, in_specs_of=None,
                 out_specs_of=None, ties_of=None, time_limit_s: float = 60.0,
                 progress=lambda msg: None, choice=None, search: bool = True,
                 hint_labels_of=None, seeds_of=None, dedup_layers: bool = True,
                 memory_budget_bytes: float | None = None, strict_budget: bool = True,
                 remat: bool = True, remat_choice: Remat | None = None) -> PipelineResult:
    """in_specs_of(traced) / out_specs_of(traced) give the pinned Spec (or None) per flat leaf;
    hint_labels_of(traced) gives (in labels, out labels) naming those leaves in messages;
    seeds_of(traced) gives name -> a Spec (or None) per flat input leaf: starting points whose
    propagated plans compete with the ILP's (``passes.propagate.best_of``);
    ties_of(traced) gives (output leaf, input leaf) pairs that must share a sharding.
    ``search=False``: annotations plus propagation only (no ILP); free values are replicated.
    ``choice``: a strategy index per node from an earlier solve of the same program (a plan
    cache), with ``remat_choice`` its rematerialized layers; the solve is skipped. ValueError
    if it does not fit this graph's strategies.
    ``dedup_layers``: structurally identical nodes (copies of a layer) share one decision
    (``passes.dedup``). ``memory_budget_bytes``: the per-device peak the plan must fit in
    (``passes.memory_budget``); when no plan fits, with ``remat`` layers are rematerialized
    until one does; if none still fits, InfeasiblePlanError, or with
    ``strict_budget=False`` a MemoryBudgetWarning and the plan that ignores the budget."""
    t0 = time.perf_counter()
    progress("tracing")
    traced = trace(fn, args)
    trace_s = time.perf_counter() - t0
    opts = _Options(mesh_ctx, in_specs_of, out_specs_of, ties_of, time_limit_s, progress,
                    choice, search, hint_labels_of, seeds_of, dedup_layers, memory_budget_bytes)
    if remat_choice is not None:
        layers = remat_choice.layers or tuple(residual_bytes(traced, remat_choice.policy))
        if not layers and remat_choice.layers is None:
            warnings.warn(
                f"autopar: remat={remat_choice.policy.value!r} asks to rematerialize every "
                "layer, but this program has none autopar can recompute. Layers are the "
                "top-level modules of the first argument (the parameters) of a differentiated "
                "train step, found at the top level of the program (or in one `jax.jit` of the "
                "whole function); a function without a backward pass, or whose backward pass is "
                "inside a nested `jax.jit`, has none. Planned without rematerialization: wrap "
                "the layers in `jax.checkpoint` to recompute them.", RematWarning, stacklevel=4)
        remat_choice = Remat(layers, remat_choice.policy) if layers else None
        if remat_choice is not None:
            traced = rematerialize(traced, list(layers), remat_choice.policy)
    searched = remat and search and choice is None
    # No plan of the program as it is may fit: then the remat search goes first.
    first = searched and _needs_remat(traced, opts)
    result = _remat_search(traced, opts, None) if first else None
    if result is None or not result.solution.fits_budget:
        result = _plan(traced, opts)
        result.remat = remat_choice
        if not result.solution.fits_budget:
            fitting = _remat_search(traced, opts, result) if searched and not first else None
            result = fitting if fitting is not None and fitting.solution.fits_budget else (
                _over_budget(traced, opts, result, searched, remat and search, strict_budget))

    graph, strats, solution = result.graph, result.strats, result.solution
    specs = value_specs(graph, strats, solution.choice)
    node_in_specs = {n.id: strats[n.id][solution.choice[n.id]].in_specs for n in graph.nodes}
    result.flat_fn = build_flat_fn(result.traced, specs, node_in_specs, jax_mesh)
    result.timings_s = {"trace": trace_s, **result.timings_s,
                        "total": time.perf_counter() - t0}
    return result


def _plan(traced: Traced, o: _Options) -> PipelineResult:
    """The passes after trace, on one traced program: its strategies and chosen solution."""
    timings = {}
    graph = traced.graph
    t = time.perf_counter()
    in_specs = o.in_specs_of(traced) if o.in_specs_of else []
    out_specs = o.out_specs_of(traced) if o.out_specs_of else []
    in_labels, out_labels = o.hint_labels_of(traced) if o.hint_labels_of else (None, None)
    labels = annotate(graph, in_specs, out_specs, o.mesh_ctx.axis_sizes, in_labels, out_labels)
    o.progress(f"building strategies for {len(graph.nodes)} nodes")
    keys = node_keys(graph)
    strats, fallbacks = build_strategies(graph, o.mesh_ctx, keys)
    timings["strategies"] = time.perf_counter() - t

    ties = []
    if o.ties_of is not None:
        ties = [(graph.output_nodes[out], graph.input_nodes[i]) for out, i in o.ties_of(traced)]
    t = time.perf_counter()
    o.progress("propagating annotations")
    prop = propagate(graph, strats, o.mesh_ctx, labels, ties, complete=not o.search)
    timings["propagate"] = time.perf_counter() - t

    # The candidate plans propagate in a child process while this one clusters the graph and
    # solves the ILP (passes.background).
    seeded, timed, batch_seeds = (_candidates(traced, strats, labels, ties, o)
                                  if o.search and o.choice is None else (None, None, {}))
    t = time.perf_counter()
    groups, ilp_stats = None, {}
    if o.search:
        groups = cluster(graph, strats, o.mesh_ctx, ties)
        ilp_stats = {"ilp_nodes_before": len(graph.nodes),
                     "ilp_groups_followed": len(groups.members)}
        if o.dedup_layers:
            groups = tie_groups(groups, structural_colors(graph, keys))
        ilp_stats["ilp_groups"] = len(groups.members)
    timings["cluster"] = time.perf_counter() - t

    t = time.perf_counter()
    if not o.search:
        solution = Solution(choice=prop.choice, objective_us=0.0, status=SolveStatus.NOT_RUN,
                            num_variables=0, num_constraints=0, solve_time_s=0.0,
                            source=Source.PROPAGATED, candidate="propagated")
    elif o.choice is not None:
        if len(o.choice) != len(strats) or any(not 0 <= c < len(s)
                                               for c, s in zip(o.choice, strats)):
            raise ValueError("the cached choice does not fit this program's strategies")
        solution = Solution(choice=list(o.choice), objective_us=0.0,
                            status=SolveStatus.NOT_RUN, num_variables=0, num_constraints=0,
                            solve_time_s=0.0, source=Source.CACHED)
    else:
        solution = _solve(traced, strats, groups, labels, ties, o, ilp_stats,
                          (seeded, timed, batch_seeds))
    timings["solve"] = time.perf_counter() - t
    return PipelineResult(traced, strats, solution, fallbacks, timings_s=timings,
                          ilp_groups=len(groups.members) if groups else 0,
                          ilp_stats=ilp_stats, groups=groups)


def _by_node(traced: Traced, seeds: dict) -> dict:
    """Seeds (name -> a spec or None per input leaf) as name -> input node id -> spec."""
    return {name: {traced.graph.input_nodes[i]: spec for i, spec in enumerate(leaf_specs)
                   if spec is not None} for name, leaf_specs in seeds.items()}


def _candidates(traced: Traced, strats, labels, ties, o: _Options
                ) -> tuple[Deferred, Deferred, dict]:
    """The propagated candidate plans (``passes.propagate.propagated_plans``: of the
    annotations, and of each baseline seed) and their predicted step times, as Deferreds of
    name -> plan and name -> seconds, started in child processes: seconds of Python each on a
    deep model, while this process clusters the graph and solves the ILP, which needs them
    only when its LP relaxation is fractional. As many children as cores but one (one on two
    cores; each child copies the pages of the graph it touches, so more children than cores
    cost more than they save). Also the batch seeds (name -> input node id -> spec),
    propagated only when the ILP does not finish."""
    seeds, batch_seeds = o.seeds_of(traced) if o.seeds_of else ({}, {})
    starts = candidate_starts(labels, _by_node(traced, seeds))
    o.progress(f"propagating {len(starts)} candidate plans")
    workers = max(1, min(len(starts), usable_cores() - 1))
    parts = [Deferred(_propagate_and_time, traced.graph, strats, o.mesh_ctx, labels, ties,
                      starts[k::workers], process=True).start() for k in range(workers)]
    names = [name for name, _ in starts]
    return (Deferred(_in_order, names, parts, 0), Deferred(_in_order, names, parts, 1),
            _by_node(traced, batch_seeds))


def _propagate_and_time(graph, strats, mesh_ctx: MeshContext, labels, ties, starts
                        ) -> tuple[dict, dict]:
    """(name -> plan, name -> predicted step time) of the propagations from ``starts``."""
    plans = propagate_from(graph, strats, mesh_ctx, labels, ties, starts)
    return plans, step_times(graph, strats, mesh_ctx, plans)


def _in_order(names: list[str], parts: list[Deferred], k: int) -> dict:
    """The ``k``-th dict of each of ``parts`` (name -> plan, name -> time), merged in
    ``names``' order."""
    merged = {}
    for part in parts:
        merged.update(part.result()[k])
    return {name: merged[name] for name in names}


def _solve(traced: Traced, strats, groups: Groups, labels, ties, o: _Options,
           ilp_stats: dict, candidates_of: tuple[Deferred, Deferred, dict]) -> Solution:
    """The ILP's plan, then the best of it and the propagated candidates (``candidates_of``,
    from :func:`_candidates`)."""
    graph = traced.graph
    seeded, timed, batch_seeds = candidates_of
    o.progress(f"solving the ILP over {len(groups.members)} groups "
               f"({len(graph.nodes)} nodes before coarsening)")
    solution = solve(graph, strats, groups, o.mesh_ctx, time_limit_s=o.time_limit_s,
                     memory_budget_bytes=o.memory_budget_bytes, warm=seeded,
                     progress=o.progress)
    candidates, known_s = seeded.result(), timed.result()
    ilp_stats.update(ilp_edges_before=solution.edges_before, ilp_edges=solution.edges_after,
                     memory_rows=solution.memory_rows,
                     memory_budget_bytes=o.memory_budget_bytes)
    o.progress(f"ILP: {solution.num_variables} variables, {solution.num_constraints} "
               f"constraints, {solution.edges_after} edge classes "
               f"({solution.edges_before} edges); {solution.status.value} in "
               f"{solution.solve_time_s:.2f}s")
    if solution.status is not SolveStatus.OPTIMAL and batch_seeds:
        # The ILP weighs every mesh axis for the batch, but did not finish: try each one
        # outside it, by propagation.
        o.progress(f"the ILP did not finish: propagating the batch over each of "
                   f"{len(batch_seeds)} mesh axes")
        candidates.update(propagated_plans(graph, strats, o.mesh_ctx, labels, ties,
                                           batch_seeds, annotations_alone=False))
    # Also the predicted step time and peak of the plan taken (and of the others).
    o.progress(f"comparing the ILP's plan with {len(candidates)} propagated ones")
    solution, ilp_stats["candidates_step_s"], ilp_stats["candidates_peak_bytes"] = best_of(
        solution, graph, strats, o.mesh_ctx, candidates, o.memory_budget_bytes, known_s)
    return solution


def _needs_remat(traced: Traced, o: _Options) -> bool:
    """Whether no plan of the program as it is fits the memory budget, as
    :func:`passes.memory_budget.peak_lower_bound_bytes` shows without planning it."""
    budget = o.memory_budget_bytes
    if budget is None:
        return False
    bound = peak_lower_bound_bytes(traced.graph, math.prod(o.mesh_ctx.axis_sizes.values()),
                                   o.mesh_ctx.results_held)
    if bound > budget:
        o.progress(f"memory: every plan without rematerialization peaks at "
                   f"{bound / 2**20:.1f} MiB or more, over the budget of "
                   f"{budget / 2**20:.1f} MiB")
    return bound > budget


def _over_budget(traced: Traced, o: _Options, result: PipelineResult, searched: bool,
                 advise: bool, strict: bool) -> PipelineResult:
    """``result``, over the budget: InfeasiblePlanError when ``strict``, else it with a
    MemoryBudgetWarning."""
    error = over_budget_error(
        result.graph, result.strats, result.groups, o.mesh_ctx, o.memory_budget_bytes,
        input_labels(traced.in_tree), o.time_limit_s, result.solution,
        " (rematerializing every layer did not make one fit either)"
        if searched and residual_bytes(traced, RematPolicy.NOTHING) else "",
        _scan_advice(traced) if advise else "")
    if strict:
        raise error
    warnings.warn(f"autopar: {error} The plan below ignores the default budget.",
                  MemoryBudgetWarning, stacklevel=4)
    return result


def _scan_advice(traced: Traced) -> str:
    """What to do about layers under a ``lax.scan``, which the remat pass cannot recompute."""
    stacked = scanned_layers(traced)
    if not stacked:
        return ""
    return (f" autopar cannot rematerialize the layers under a scan ({', '.join(stacked)}): "
            "wrap the scanned layer in `nn.remat` (`jax.checkpoint`) with a policy such as "
            "`jax.checkpoint_policies.dots_saveable` to keep fewer activations.")


#: A plan with every layer rematerialized is taken when it is predicted at most this much
#: slower than the plan that ignores the budget; else fewer layers are tried too.
REMAT_SLACK = 0.1


def _step_s(result: PipelineResult) -> float:
    """The predicted step time of an attempt's chosen plan (``passes.propagate.best_of``)."""
    return result.ilp_stats["candidates_step_s"][result.solution.name]


def _fastest_peak_bytes(result: PipelineResult) -> float:
    """The predicted peak of an attempt's fastest plan, whether it fits the budget or not."""
    times = result.ilp_stats["candidates_step_s"]
    return result.ilp_stats["candidates_peak_bytes"][min(times, key=times.get)]


def _remat_search(traced: Traced, o: _Options,
                  plain: PipelineResult | None) -> PipelineResult | None:
    """The fastest plan found of the program with layers rematerialized, by the cheaper policy
    first, that fits the memory budget; None when even every layer does not make one fit.
    ``plain``: the plan without rematerialization, over the budget; None when it was not
    planned, as no plan without rematerialization fits (:func:`_needs_remat`).

    Every layer is rematerialized first. Its plan is taken when it is predicted within
    :data:`REMAT_SLACK` of ``plain``'s: the recomputation is cheap next to a sharding the
    budget forces. Else fewer layers, largest residuals first, are planned too: as many as
    bring the fastest plan's peak under the budget if each layer lowers it alike (from
    ``plain``'s fastest plan to the every-layer one's), and the faster of the two fitting
    plans is taken. Without ``plain`` there is neither a time to compare with nor a peak to
    interpolate from: the every-layer plan is taken (planning the program as it is would
    cost as much as the search itself, for a plan known not to fit)."""
    budget = o.memory_budget_bytes
    for policy in (RematPolicy.DOTS, RematPolicy.NOTHING):
        saved = residual_bytes(traced, policy)
        order = sorted(saved, key=lambda name: -saved[name])
        if not order:
            return None

        def attempt(k: int, order=order, policy=policy) -> PipelineResult:
            o.progress(f"rematerializing {k} of {len(order)} layers ({policy.value}) to fit "
                       "the memory budget")
            result = _plan(rematerialize(traced, order[:k], policy), o)
            result.remat = Remat(tuple(order[:k]), policy)
            return result

        every = attempt(len(order))
        if not every.solution.fits_budget:
            continue
        if plain is None or _step_s(every) <= (1 + REMAT_SLACK) * _step_s(plain):
            return every
        none_peak, every_peak = _fastest_peak_bytes(plain), _fastest_peak_bytes(every)
        if every_peak > budget or none_peak <= every_peak:
            return every  # fewer layers would not let the fastest plans fit
        k = math.ceil(len(order) * (none_peak - budget) / (none_peak - every_peak))
        if k >= len(order):
            return every
        fewer = attempt(k)
        o.progress(f"{k} layers rematerialized: {_step_s(fewer) * 1e3:.2f} ms a step; all "
                   f"{len(order)}: {_step_s(every) * 1e3:.2f} ms")
        faster = fewer.solution.fits_budget and _step_s(fewer) < _step_s(every)
        return fewer if faster else every
    return None
