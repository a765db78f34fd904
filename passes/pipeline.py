"""The pass pipeline. :func:`run_pipeline` runs the passes in order:

trace -> [remat] -> annotate -> strategies -> propagate -> [candidates] -> cluster -> solve -> emit

([remat]: when asked for or when the memory budget needs it; [candidates]: when the ILP runs.)
Each pass takes the planning state (:class:`_State`) and returns it with its own fields
filled in. :func:`timed_pass` wraps every pass: it reports the pass's progress, adds its wall
time to ``timings_s`` and, when ``PlanOptions.verify_ir``, verifies the IR after it
(``passes.verify``). With ``search=False`` propagation gives the whole plan and cluster/solve
do not run (plain GSPMD). When no plan fits the memory budget, the passes after trace run
again on the program with layers rematerialized (``passes.remat``): every layer, or fewer
when that is predicted faster and still fits (:func:`_plan_within_budget`).
The strategies pass also adds the overlap strategies (``passes.overlap``: collective matmul,
prefetch) when ``PlanOptions.overlap`` and ``search``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from jax.sharding import Mesh

from autopar._sizes import format_bytes
from autopar.cost_model.spec import Spec
from autopar.errors import MemoryBudgetWarning, RematWarning, warn
from autopar.passes import candidates
from autopar.passes import sequence_parallel  # noqa: F401  (registers attention's strategies)
from autopar.passes.annotate import annotate
from autopar.passes.background import Deferred
from autopar.passes.cluster import cluster
from autopar.passes.dedup import Groups, node_keys, structural_colors, tie_groups
from autopar.passes.emit import build_flat_fn
from autopar.passes.estimate import estimate, plan_collectives, value_specs
from autopar.passes.ir import Graph
from autopar.passes.memory_budget import input_labels, peak_lower_bound_bytes
from autopar.passes.overlap import with_collective_matmuls, with_prefetch
from autopar.passes.propagate import propagate
from autopar.passes.remat import RematPolicy, rematerialize, residual_bytes, scanned_layers
from autopar.passes.memory_fit import over_budget_error
from autopar.passes.solution import Solution, SolveStatus, Source
from autopar.passes.solve import solve
from autopar.passes.strategies import MeshContext, Strategy, build_strategies
from autopar.passes.trace import Traced, trace
from autopar.passes.verify import debug_requested, verify

#: Per flat input (or output) leaf of the traced program: its pinned Spec, or None.
SpecsOf = Callable[[Traced], list[Spec | None]]
#: (input leaf labels, output leaf labels): how messages name the pinned leaves.
LabelsOf = Callable[[Traced], tuple[list[str] | None, list[str] | None]]
#: (output leaf, input leaf) pairs that must share a sharding.
TiesOf = Callable[[Traced], list[tuple[int, int]]]
#: (name -> a Spec or None per input leaf, the seeds whose propagated plans compete with the
#: ILP's (``passes.candidates``); the same for the batch seeds, propagated only when the
#: ILP does not finish).
SeedsOf = Callable[[Traced], tuple[dict[str, list[Spec | None]], dict[str, list[Spec | None]]]]

#: The ``timings_s`` key each pass's wall time adds to (``Plan.stats["timings_s"]``, read by
#: the report and the benchmarks). Annotation counts as strategies; the remat, candidates and
#: emit passes count in the total only.
TIMINGS_KEY = {"trace": "trace", "annotate": "strategies", "strategies": "strategies",
               "propagate": "propagate", "cluster": "cluster", "solve": "solve",
               "total": "total"}

#: A plan with every layer rematerialized is taken when it is predicted at most this much
#: slower than the plan that ignores the budget; else fewer layers are tried too.
REMAT_SLACK = 0.1


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


def _quiet(message: str) -> None:
    """Progress that reports nothing."""


@dataclass(frozen=True)
class PlanOptions:
    """How :func:`run_pipeline` plans one program.

    ``mesh_ctx``: the mesh as the planner sees it; ``jax_mesh``: the mesh the plan runs on.
    The ``*_of`` providers read the traced program (None: nothing of their kind; see their
    types). ``search=False``: annotations plus propagation only (no ILP); free values are
    replicated. ``choice``: a strategy index per node from an earlier solve of the same
    program (a plan cache), with ``remat_choice`` its rematerialized layers; the solve is
    skipped (ValueError if it does not fit this graph's strategies). ``dedup_layers``:
    structurally identical nodes (copies of a layer) share one decision (``passes.dedup``).
    ``memory_budget_bytes``: the per-device peak the plan must fit in
    (``passes.memory_budget``); when no plan fits, with ``remat`` layers are rematerialized
    until one does; if none still fits, InfeasiblePlanError, or with ``strict_budget=False``
    a MemoryBudgetWarning and the plan that ignores the budget. ``progress``: told what the
    passes do. ``verify_ir``: check the IR after every pass (``passes.verify``).
    ``overlap``: with ``search``, also offer the strategies that hide their communication
    behind their compute (``passes.overlap``) where the hardware runs collectives
    asynchronously; False: none.
    ``preferences_of``: node id -> a penalty per strategy, the ILP's tie break
    (``passes.ilp``; the mesh axes' names). ``pin_intermediates``: False emits no sharding
    inside the program, leaving XLA to propagate the arguments' and results' shardings (what
    plain ``jax.jit`` with them compiles).
    """
    mesh_ctx: MeshContext
    jax_mesh: Mesh
    in_specs_of: SpecsOf | None = None
    out_specs_of: SpecsOf | None = None
    hint_labels_of: LabelsOf | None = None
    ties_of: TiesOf | None = None
    seeds_of: SeedsOf | None = None
    preferences_of: Callable[[Traced], dict[int, Callable[[Strategy], float]]] | None = None
    time_limit_s: float = 60.0
    search: bool = True
    choice: tuple[int, ...] | None = None
    remat_choice: Remat | None = None
    dedup_layers: bool = True
    memory_budget_bytes: float | None = None
    strict_budget: bool = True
    remat: bool = True
    progress: Callable[[str], None] = _quiet
    verify_ir: bool = field(default_factory=debug_requested)
    overlap: bool = True
    pin_intermediates: bool = True


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
class _State:
    """One program as the passes have left it: each pass returns a copy with its own fields
    filled in (the comments name the pass). ``timings_s``, one dict shared by the copies of
    one planning attempt, collects the passes' wall times."""
    options: PlanOptions
    timings_s: dict[str, float]
    traced: Traced | None = None                     # trace, remat
    remat: Remat | None = None                       # remat
    labels: dict[int, str] | None = None             # annotate: node -> the hint pinning it
    ties: list[tuple[int, int]] = field(default_factory=list)  # annotate: (output, input) node
    seeds: Deferred | None = None                    # annotate: candidates' (None: no search)
    keys: list[tuple] | None = None                  # strategies: a structural key per node
    strats: list[list[Strategy]] | None = None       # strategies
    fallbacks: dict[str, int] = field(default_factory=dict)  # strategies
    propagated: list[int] | None = None              # propagate: the plan, without search
    candidates: candidates.Candidates | None = None  # candidates
    groups: Groups | None = None                     # cluster
    ilp_stats: dict = field(default_factory=dict)    # cluster, solve
    solution: Solution | None = None                 # solve
    flat_fn: Callable | None = None                  # emit

    def result(self) -> PipelineResult:
        return PipelineResult(
            traced=self.traced, strats=self.strats, solution=self.solution,
            fallbacks=self.fallbacks, flat_fn=self.flat_fn, timings_s=self.timings_s,
            ilp_groups=len(self.groups.members) if self.groups else 0,
            ilp_stats=self.ilp_stats, groups=self.groups, remat=self.remat)


def timed_pass(name: str, progress: str | Callable[[_State], str | None] | None = None):
    """Make ``run(state, *args) -> state`` pass ``name`` of the pipeline: it first reports
    ``progress`` (a message, or one made of the state given; None: none), then adds its wall
    time to the returned state's ``timings_s[TIMINGS_KEY[name]]`` (when it has a key) and,
    with ``verify_ir``, verifies the IR it leaves (InvalidIRError naming the pass)."""
    def decorate(run: Callable[..., _State]) -> Callable[..., _State]:
        @functools.wraps(run)
        def timed(state: _State, *args) -> _State:
            message = progress(state) if callable(progress) else progress
            if message:
                state.options.progress(message)
            start_s = time.perf_counter()
            state = run(state, *args)
            if name in TIMINGS_KEY:
                key = TIMINGS_KEY[name]
                state.timings_s[key] = (state.timings_s.get(key, 0.0)
                                        + time.perf_counter() - start_s)
            if state.options.verify_ir and state.traced is not None:
                verify(state.traced.graph, after=name)
            return state
        return timed
    return decorate


def run_pipeline(fn: Callable, args: tuple, options: PlanOptions) -> PipelineResult:
    """``fn`` at ``args``, planned under ``options``: the passes of the module docstring,
    with the plan's emitted function (``flat_fn``) and each pass's wall time (``timings_s``:
    trace, strategies, propagate, cluster, solve and total)."""
    return _passes(_State(options, timings_s={}), fn, args).result()


@timed_pass("total")
def _passes(state: _State, fn: Callable, args: tuple) -> _State:
    # trace: the jaxpr of fn, inlined into one flat Graph
    state = _trace(state, fn, args)
    # [remat]: the layers that a cached plan or `plan(remat=<policy>)` names, recomputed
    state = _rematerialize(state, _forced_remat(state))
    # annotate -> strategies -> propagate -> cluster -> solve (_plan), and again with layers
    # rematerialized when no plan fits the memory budget
    state = _plan_within_budget(state)
    # emit: the chosen plan as one function of the flat arguments
    return _emit(state)


def _plan(state: _State) -> _State:
    """The passes after trace, on ``state``'s program: one planning attempt, timed apart."""
    state = replace(state, timings_s=dict(state.timings_s))
    # annotate: hints pin their values; the ties and the candidates' seeds, by node
    state = _annotate(state)
    # strategies: every node's shardings, with their costs
    state = _strategies(state)
    # propagate: the pinned shardings through the graph, cutting the strategies they rule out
    state = _propagate(state)
    # candidates: whole plans propagated from the annotations and each seed, when asked for
    state = _candidates(state)
    # cluster: nodes that follow a leader, or repeat a layer, share one decision
    state = _cluster(state)
    # solve: the ILP's plan, or a candidate predicted faster
    return _solve(state)


@timed_pass("trace", progress="tracing")
def _trace(state: _State, fn: Callable, args: tuple) -> _State:
    return replace(state, traced=trace(fn, args))


@timed_pass("remat")
def _rematerialize(state: _State, remat: Remat | None) -> _State:
    if remat is None:
        return state
    traced = rematerialize(state.traced, list(remat.layers), remat.policy)
    return replace(state, traced=traced, remat=remat)


@timed_pass("annotate")
def _annotate(state: _State) -> _State:
    """The hints pin their values (``passes.annotate``); the ties, as graph nodes, and when
    the ILP is to run, the candidate plans' seeds, made when first asked for."""
    o, traced = state.options, state.traced
    graph = traced.graph
    in_specs = o.in_specs_of(traced) if o.in_specs_of else []
    out_specs = o.out_specs_of(traced) if o.out_specs_of else []
    in_labels, out_labels = o.hint_labels_of(traced) if o.hint_labels_of else (None, None)
    labels = annotate(graph, in_specs, out_specs, o.mesh_ctx.axis_sizes, in_labels, out_labels)
    ties = [(graph.output_nodes[out], graph.input_nodes[i])
            for out, i in (o.ties_of(traced) if o.ties_of else [])]
    if not o.search or o.choice is not None:
        return replace(state, labels=labels, ties=ties)
    # The seeds are made when their plans are (passes.candidates.prepare).
    return replace(state, labels=labels, ties=ties,
                   seeds=Deferred(candidates.seeds_by_node, traced, o.seeds_of))


def _strategies_message(state: _State) -> str:
    return f"building strategies for {len(state.traced.graph.nodes)} nodes"


@timed_pass("strategies", progress=_strategies_message)
def _strategies(state: _State) -> _State:
    keys = node_keys(state.traced.graph)
    strats, fallbacks = build_strategies(state.traced.graph, state.options.mesh_ctx, keys)
    if state.options.overlap and state.options.search:
        strats = with_collective_matmuls(state.traced.graph, strats, state.options.mesh_ctx)
        strats = with_prefetch(state.traced.graph, strats, state.options.mesh_ctx)
    return replace(state, keys=keys, strats=strats, fallbacks=fallbacks)


@timed_pass("propagate", progress="propagating annotations")
def _propagate(state: _State) -> _State:
    o = state.options
    prop = propagate(state.traced.graph, state.strats, o.mesh_ctx, state.labels, state.ties,
                     complete=not o.search)
    return replace(state, propagated=prop.choice)


@timed_pass("candidates")
def _candidates(state: _State) -> _State:
    if state.seeds is None:
        return state
    problem = candidates.Problem(graph=state.traced.graph, strats=state.strats,
                                 mesh_ctx=state.options.mesh_ctx, labels=state.labels,
                                 ties=state.ties)
    return replace(state, candidates=candidates.prepare(problem, state.seeds))


@timed_pass("cluster")
def _cluster(state: _State) -> _State:
    o, graph = state.options, state.traced.graph
    if not o.search:
        return state
    groups = cluster(graph, state.strats, o.mesh_ctx, state.ties)
    ilp_stats = {"ilp_nodes_before": len(graph.nodes), "ilp_groups_followed": len(groups.members)}
    if o.dedup_layers:
        groups = tie_groups(groups, structural_colors(graph, state.keys))
    ilp_stats["ilp_groups"] = len(groups.members)
    return replace(state, groups=groups, ilp_stats=ilp_stats)


def _solving_message(state: _State) -> str | None:
    if state.candidates is None:
        return None
    return (f"solving the ILP over {len(state.groups.members)} groups "
            f"({len(state.traced.graph.nodes)} nodes before coarsening)")


@timed_pass("solve", progress=_solving_message)
def _solve(state: _State) -> _State:
    """The ILP's plan, or the best of it and the candidates; without search the propagated
    plan, and with a cached choice that one (ValueError if it does not fit)."""
    o, strats = state.options, state.strats
    if not o.search:
        choice, source = state.propagated, Source.PROPAGATED
    elif o.choice is not None:
        if len(o.choice) != len(strats) or any(not 0 <= c < len(s)
                                               for c, s in zip(o.choice, strats)):
            raise ValueError("the cached choice does not fit this program's strategies")
        choice, source = list(o.choice), Source.CACHED
    else:
        return replace(state, solution=_ilp(state))
    return replace(state, solution=Solution(
        choice=choice, objective_us=0.0, status=SolveStatus.NOT_RUN, num_variables=0,
        num_constraints=0, solve_time_s=0.0, source=source,
        candidate="propagated" if source is Source.PROPAGATED else ""))


def _ilp(state: _State) -> Solution:
    """The ILP's plan, then the best of it and the candidate plans."""
    o, graph, stats = state.options, state.traced.graph, state.ilp_stats
    preferences = None if o.preferences_of is None else o.preferences_of(state.traced)
    solution = solve(graph, state.strats, state.groups, o.mesh_ctx, time_limit_s=o.time_limit_s,
                     preferences=preferences,
                     memory_budget_bytes=o.memory_budget_bytes, warm=state.candidates.plans,
                     progress=o.progress)
    own = estimate(graph, state.strats, solution.choice, o.mesh_ctx,
                   plan_collectives(graph, state.strats, solution.choice, o.mesh_ctx),
                   memory=False)
    stats.update(ilp_edges_before=solution.edges_before, ilp_edges=solution.edges_after,
                 memory_rows=solution.memory_rows, memory_budget_bytes=o.memory_budget_bytes,
                 # The ILP's own plan and its objective (with memory rows, penalties included),
                 # which prices the plan's makespan (candidates_step_s[ilp_plan]); its serial
                 # time (compute plus every collective), and the solves that priced overlap.
                 ilp_plan=solution.name, ilp_objective_s=solution.objective_us / 1e6,
                 ilp_plan_serial_s=own.compute_time_s + own.comm_time_s,
                 ilp_overlap_solves=solution.overlap_solves,
                 rings_dropped=solution.rings_dropped,
                 state_at_rest=solution.state_at_rest)
    o.progress(f"ILP: {solution.num_variables} variables, {solution.num_constraints} "
               f"constraints, {solution.edges_after} edge classes "
               f"({solution.edges_before} edges); {solution.status.value} in "
               f"{solution.solve_time_s:.2f}s")
    # Also the predicted step time and peak of the plan taken (and of the others).
    solution, stats["candidates_step_s"], stats["candidates_peak_bytes"] = candidates.best(
        state.candidates, solution, o.memory_budget_bytes, o.progress)
    return solution


@timed_pass("emit")
def _emit(state: _State) -> _State:
    graph, strats, choice = state.traced.graph, state.strats, state.solution.choice
    specs = value_specs(graph, strats, choice)
    taken = [strats[n.id][choice[n.id]] for n in graph.nodes]
    node_in_specs = {n.id: s.in_specs for n, s in zip(graph.nodes, taken)}
    rewrites = {n.id: s.rewrite for n, s in zip(graph.nodes, taken) if s.rewrite is not None}
    if not state.options.pin_intermediates:
        specs, rewrites = {}, {}
        node_in_specs = {n: (None,) * len(s) for n, s in node_in_specs.items()}
    return replace(state, flat_fn=build_flat_fn(state.traced, specs, node_in_specs,
                                                state.options.jax_mesh, rewrites))


def _forced_remat(state: _State) -> Remat | None:
    """``remat_choice``'s layers in this program (None: every layer ``passes.remat`` can
    recompute); None, with a RematWarning, when it asks for every layer and there is none."""
    forced = state.options.remat_choice
    if forced is None:
        return None
    layers = forced.layers or tuple(residual_bytes(state.traced, forced.policy))
    if not layers and forced.layers is None:
        warn(
            f"autopar: remat={forced.policy.value!r} asks to rematerialize every "
            "layer, but this program has none autopar can recompute. Layers are the "
            "top-level modules of the first argument (the parameters) of a differentiated "
            "train step, found at the top level of the program (or in one `jax.jit` of the "
            "whole function); a function without a backward pass, or whose backward pass is "
            "inside a nested `jax.jit`, has none. Planned without rematerialization: wrap "
            "the layers in `jax.checkpoint` to recompute them.", RematWarning)
    return Remat(layers, forced.policy) if layers else None


def _plan_within_budget(state: _State) -> _State:
    """``state``'s program planned (:func:`_plan`). When the plan is over the memory budget
    and a search may rematerialize: the fastest fitting plan with layers rematerialized
    (:func:`_remat_search`), tried first when no plan of the program as it is can fit
    (:func:`_needs_remat`). Over the budget still: :func:`_over_budget`."""
    o = state.options
    searched = o.remat and o.search and o.choice is None
    first = searched and _needs_remat(state)
    fitting = _remat_search(state, None) if first else None
    if fitting is not None:
        return fitting
    plain = _plan(state)
    if plain.solution.fits_budget:
        return plain
    fitting = _remat_search(state, plain) if searched and not first else None
    return fitting if fitting is not None else _over_budget(plain, searched)


def _needs_remat(state: _State) -> bool:
    """Whether no plan of the program as it is fits the memory budget, as
    :func:`passes.memory_budget.peak_lower_bound_bytes` shows without planning it."""
    o = state.options
    budget = o.memory_budget_bytes
    if budget is None:
        return False
    devices = math.prod(o.mesh_ctx.axis_sizes.values())
    bound = peak_lower_bound_bytes(state.traced.graph, devices, o.mesh_ctx.results_held)
    if bound > budget:
        o.progress(f"memory: every plan without rematerialization peaks at "
                   f"{format_bytes(bound)} or more, over the budget of "
                   f"{format_bytes(budget)}")
    return bound > budget


def _over_budget(plain: _State, searched: bool) -> _State:
    """``plain``, over the budget: InfeasiblePlanError when ``strict_budget``, else it with a
    MemoryBudgetWarning. ``searched``: whether the remat search ran."""
    o, traced = plain.options, plain.traced
    layers = bool(residual_bytes(traced, RematPolicy.NOTHING))
    advice = _scan_advice(traced) if o.remat and o.search else ""
    if layers and not o.remat and o.remat_choice is None:  # the user turned remat off
        advice += (" Rematerializing layers may make a plan fit: plan with `remat=True` (the "
                   "default).")
    error = over_budget_error(
        traced.graph, plain.strats, plain.groups, o.mesh_ctx, o.memory_budget_bytes,
        input_labels(traced.in_tree, _replaced_leaves(traced.graph, plain.ties)),
        o.time_limit_s, plain.solution,
        " (rematerializing every layer did not make one fit either)"
        if searched and layers else "", advice)
    if o.strict_budget:
        raise error
    warn(f"autopar: {error} The plan below ignores the default budget.", MemoryBudgetWarning)
    return plain


def _replaced_leaves(graph, ties) -> frozenset[int]:
    """Flat argument leaves a result replaces (``ties``: (output node, input node) pairs)."""
    position = {node: i for i, node in enumerate(graph.input_nodes)}
    return frozenset(position[n] for _, n in ties if n in position)


def _scan_advice(traced: Traced) -> str:
    """What to do about layers under a ``lax.scan``, which the remat pass cannot recompute."""
    stacked = scanned_layers(traced)
    if not stacked:
        return ""
    return (f" autopar cannot rematerialize the layers under a scan ({', '.join(stacked)}): "
            "wrap the scanned layer in `nn.remat` (`jax.checkpoint`) with a policy such as "
            "`jax.checkpoint_policies.dots_saveable` to keep fewer activations.")


def _step_s(attempt: _State) -> float:
    """The predicted step time of an attempt's chosen plan (``passes.candidates.best_of``)."""
    return attempt.ilp_stats["candidates_step_s"][attempt.solution.name]


def _fastest_peak_bytes(attempt: _State) -> float:
    """The predicted peak of an attempt's fastest plan, whether it fits the budget or not."""
    times = attempt.ilp_stats["candidates_step_s"]
    return attempt.ilp_stats["candidates_peak_bytes"][min(times, key=times.get)]


def _remat_search(state: _State, plain: _State | None) -> _State | None:
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
    o = state.options
    budget = o.memory_budget_bytes
    for policy in (RematPolicy.DOTS, RematPolicy.NOTHING):
        saved = residual_bytes(state.traced, policy)
        order = sorted(saved, key=lambda name: -saved[name])
        if not order:
            return None

        def attempt(k: int, order=order, policy=policy) -> _State:
            o.progress(f"rematerializing {k} of {len(order)} layers ({policy.value}) to fit "
                       "the memory budget")
            return _plan(_rematerialize(state, Remat(tuple(order[:k]), policy)))

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
