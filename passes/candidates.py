"""Plan selection: candidate plans beside the ILP's, made by complete propagation from the
annotations and from seeds (a hand-written baseline's input shardings), and the plan
predicted fastest among them and the ILP's (:func:`best_of`). The seeds' plans are made only
for the ILP's warm start and to referee the ILP's plan where that pays (:func:`best`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.cost_model.spec import Spec
from autopar.passes.background import Deferred
from autopar.passes.estimate import estimate, plan_collectives, plan_peak_memory_bytes
from autopar.passes.ir import Graph
from autopar.passes.propagate import propagate
from autopar.passes.solution import Solution, SolveStatus, Source
from autopar.passes.strategies import MeshContext, Strategy
from autopar.passes.trace import Traced


def propagated_plans(graph: Graph, strats, mesh: MeshContext, labels: dict[int, str], ties=(),
                     seeds: dict[str, dict[int, Spec]] | None = None,
                     annotations_alone: bool = True) -> dict[str, list[int]]:
    """Candidate plans beside the ILP's: the complete propagation of the annotations (when
    there are any, and ``annotations_alone``), and with each of ``seeds`` (name -> input node
    id -> spec: a hand-written baseline's input shardings, say) added under them. The ILP's
    clustering, its per-edge pricing and its time limit can miss a plan that propagation from
    a good start finds; the ILP starts from the best of these (``passes.solve``'s warm start)
    and :func:`best_of` compares them with its plan. (:func:`candidate_starts` and
    :func:`propagate_from` are its two halves, for callers that spread the work.)"""
    return propagate_from(graph, strats, mesh, labels, ties,
                          candidate_starts(labels, seeds, annotations_alone))


def candidate_starts(labels: dict[int, str], seeds: dict[str, dict[int, Spec]] | None = None,
                     annotations_alone: bool = True) -> list[tuple[str, dict | None]]:
    """:func:`propagated_plans`'s plans to make: (name, ``extra`` for
    ``passes.fixed.seed``) each."""
    return ([("propagated (annotations)", None)] if labels and annotations_alone else []) + [
        (f"propagated ({name})", extra) for name, extra in (seeds or {}).items()]


def propagate_from(graph: Graph, strats, mesh: MeshContext, labels: dict[int, str], ties,
                   starts: list[tuple[str, dict | None]]) -> dict[str, list[int]]:
    """Name -> the complete propagation's plan, for each of ``starts``
    (:func:`candidate_starts`). Starts of the same seeds (two baselines that split this
    program alike) share one propagation and one plan."""
    made: dict = {}  # the seeds, as a key -> their plan
    plans = {}
    for name, extra in starts:
        key = None if extra is None else tuple(sorted(extra.items()))
        if key not in made:
            made[key] = propagate(graph, strats, mesh, labels, ties, complete=True, warn=False,
                                  extra=extra).choice
        plans[name] = made[key]
    return plans


def step_times(graph: Graph, strats, mesh: MeshContext,
               plans: dict[str, list[int]]) -> dict[str, float]:
    """Each plan's predicted step time in seconds (the estimate, without memory), made once
    per plan object (:func:`propagate_from` gives equal starts one)."""
    by_plan: dict[int, float] = {}
    for choice in plans.values():
        if id(choice) not in by_plan:
            by_plan[id(choice)] = estimate(graph, strats, choice, mesh,
                                           plan_collectives(graph, strats, choice, mesh),
                                           memory=False).step_time_s
    return {name: by_plan[id(choice)] for name, choice in plans.items()}


def best_of(solution: Solution, graph: Graph, strats, mesh: MeshContext,
            candidates: dict[str, list[int]], memory_budget_bytes: float | None = None,
            known_s: dict[str, float] | None = None):
    """The plan predicted fastest among the ILP's ``solution`` and ``candidates`` (name ->
    plan, :func:`propagated_plans`), by the estimate (``cost_model.estimate``); a plan that
    fits ``memory_budget_bytes`` first. So with annotations, search never does worse than
    ``search=False``, and never worse than the seeds' plans. Returns (solution, predicted step
    time per plan name, predicted peak bytes per plan name); the ILP's plan is named by
    :attr:`Solution.name`, and a candidate taken becomes a :attr:`Source.PROPAGATED` solution
    of that name. Peaks are predicted fastest plan first, up to the first that fits (the
    slower ones cannot win), so the fastest plan's is always there. When none fits, every
    peak is predicted, and a candidate's below the solve's least peak found becomes it.
    ``known_s``: step times of candidates already predicted (:func:`step_times`)."""
    own = solution.name
    plans = {own: solution.choice, **candidates}
    known_s = {name: t for name, t in (known_s or {}).items() if name in candidates}
    times = step_times(graph, strats, mesh,
                       {name: choice for name, choice in plans.items() if name not in known_s})
    times = {name: times[name] if name in times else known_s[name] for name in plans}
    peaks: dict[str, int] = {}
    best = None
    for name in sorted(plans, key=times.get):  # stable: the ILP's plan first among equals
        peaks[name] = plan_peak_memory_bytes(graph, strats, plans[name], mesh.axis_sizes,
                                             mesh.results_held)
        fits = (solution.fits_budget if name == own else
                memory_budget_bytes is None or peaks[name] <= memory_budget_bytes)
        if best is None or fits:
            best = solution if name == own else dataclasses.replace(
                solution, choice=plans[name], source=Source.PROPAGATED, candidate=name,
                fits_budget=fits)
        if fits:
            break
    if not best.fits_budget and best.least_peak_choice is not None:
        # Nothing fits: the smallest peak found (the error reports it) may be a candidate's.
        least = min(peaks, key=peaks.get)
        if peaks[least] < best.least_peak_bytes:
            best = dataclasses.replace(best, least_peak_bytes=peaks[least],
                                       least_peak_choice=plans[least])
    return best, times, peaks


@dataclass(frozen=True)
class Problem:
    """What every propagation of one program reads: its graph and strategies, the mesh, the
    annotations (node id -> the hint that pins it) and the ties ((output node, input node)
    pairs sharing a sharding)."""
    graph: Graph
    strats: list[list[Strategy]]
    mesh_ctx: MeshContext
    labels: dict[int, str]
    ties: list[tuple[int, int]]


@dataclass(frozen=True)
class Candidates:
    """Candidate plans, made when first asked for (:func:`prepare`): ``annotated``, the plan of
    the annotations alone (when there are any), and ``seeded``, the seeds' plans, each a
    Deferred of (name -> plan, name -> predicted step time (s)); ``seeds``, a Deferred of
    (name -> input node id -> spec, the same for the batch seeds); ``plans``, a Deferred of
    every plan (the ILP's warm start)."""
    problem: Problem
    annotated: Deferred
    seeded: Deferred
    seeds: Deferred
    plans: Deferred


def by_node(traced: Traced, seeds: dict[str, list[Spec | None]]) -> dict[str, dict[int, Spec]]:
    """Seeds (name -> a spec or None per input leaf) as name -> input node id -> spec."""
    return {name: {traced.graph.input_nodes[i]: spec for i, spec in enumerate(leaf_specs)
                   if spec is not None} for name, leaf_specs in seeds.items()}


def seeds_by_node(traced: Traced, seeds_of) -> tuple[dict, dict]:
    """``seeds_of(traced)`` (the seeds and the batch seeds, name -> a spec or None per input
    leaf; None: none) by node (:func:`by_node`)."""
    seeds, batch_seeds = seeds_of(traced) if seeds_of else ({}, {})
    return by_node(traced, seeds), by_node(traced, batch_seeds)


def prepare(problem: Problem, seeds: Deferred) -> Candidates:
    """The candidate plans of ``problem``: the propagations from its annotations alone and
    from each of ``seeds`` (a Deferred of :func:`seeds_by_node`), with their predicted step
    times. Each part is made when first asked for: the seeds' plans are seconds of Python on a
    deep model, which only the ILP's warm start and the referee (:func:`best`) need."""
    annotated = Deferred(_propagate_and_time, problem, candidate_starts(problem.labels))
    seeded = Deferred(_seeded, problem, seeds)
    return Candidates(problem=problem, annotated=annotated, seeded=seeded, seeds=seeds,
                      plans=Deferred(_plans, annotated, seeded))


#: The seeds' plans referee a plan the ILP proved optimal only on graphs of at most this many
#: nodes: a proven serial optimum prices the overlap only around itself (``passes.solve``), so
#: a seed's plan can overlap more and be faster; on larger graphs their propagations take
#: seconds (docs/design.md, "Baseline seeds and warm start").
REFEREE_MAX_NODES = 20_000


def best(candidates: Candidates, solution: Solution, memory_budget_bytes: float | None,
         progress) -> tuple[Solution, dict[str, float], dict[str, int]]:
    """The fastest predicted of the ILP's ``solution`` and the candidates, a plan within
    ``memory_budget_bytes`` first; with each plan's predicted step time and peak, by name
    (``best_of``). The annotations' plan always competes, so search never does worse than
    ``search=False``. The seeds' plans compete when the ILP's plan is not proven optimal, and
    on a graph of at most :data:`REFEREE_MAX_NODES` nodes; the batch seeds' only when it is
    not proven optimal. ``progress`` reports what it does."""
    p = candidates.problem
    plans, known_s = (dict(part) for part in candidates.annotated.result())
    proven = solution.status is SolveStatus.OPTIMAL
    if not proven or len(p.graph.nodes) <= REFEREE_MAX_NODES:
        seeded, seeded_s = candidates.seeded.result()
        plans.update(seeded)
        known_s.update(seeded_s)
        batch_seeds = {} if proven else candidates.seeds.result()[1]
        if batch_seeds:
            # The ILP weighs every mesh axis for the batch, but its plan is not proven
            # optimal: try each one outside it, by propagation.
            progress(f"the ILP's plan is not proven optimal: propagating the batch over each "
                     f"of {len(batch_seeds)} mesh axes")
            plans.update(propagated_plans(p.graph, p.strats, p.mesh_ctx, p.labels, p.ties,
                                          batch_seeds, annotations_alone=False))
    progress(f"comparing the ILP's plan with {len(plans)} propagated ones")
    return best_of(solution, p.graph, p.strats, p.mesh_ctx, plans, memory_budget_bytes,
                   known_s)


def _propagate_and_time(problem: Problem, starts: list[tuple[str, dict | None]]
                        ) -> tuple[dict, dict]:
    """(name -> plan, name -> predicted step time) of the propagations from ``starts``."""
    p = problem
    plans = propagate_from(p.graph, p.strats, p.mesh_ctx, p.labels, p.ties, starts)
    return plans, step_times(p.graph, p.strats, p.mesh_ctx, plans)


def _seeded(problem: Problem, seeds: Deferred) -> tuple[dict, dict]:
    """:func:`_propagate_and_time` of the starts of ``seeds`` (:func:`seeds_by_node`)."""
    return _propagate_and_time(problem, candidate_starts({}, seeds.result()[0],
                                                         annotations_alone=False))


def _plans(*parts: Deferred) -> dict[str, list[int]]:
    """Name -> plan of each of ``parts`` (Deferreds of :func:`_propagate_and_time`)."""
    return {name: plan for part in parts for name, plan in part.result()[0].items()}
