"""The candidate plans beside the ILP's, and the choice among them.

Whole plans propagated from the annotations and from each baseline seed
(``passes.propagate.propagated_plans``) start in child processes (``passes.background``)
while the pipeline clusters the graph and solves the ILP, which needs them only when its LP
relaxation is fractional (its warm start). :func:`best` then takes the fastest plan predicted
among them and the ILP's (``passes.propagate.best_of``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_model.spec import Spec
from autopar.passes.background import Deferred, usable_cores
from autopar.passes.ir import Graph
from autopar.passes.propagate import best_of, propagate_from, propagated_plans, step_times
from autopar.passes.solve import Solution
from autopar.passes.strategies import MeshContext, Strategy
from autopar.passes.trace import Traced


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
    """Candidate plans in the making: ``plans`` and ``times``, Deferreds of name -> plan and
    name -> predicted step time (s); ``batch_seeds`` (name -> input node id -> spec) are
    propagated only when the ILP does not finish."""
    problem: Problem
    plans: Deferred
    times: Deferred
    batch_seeds: dict[str, dict[int, Spec]]


def by_node(traced: Traced, seeds: dict[str, list[Spec | None]]) -> dict[str, dict[int, Spec]]:
    """Seeds (name -> a spec or None per input leaf) as name -> input node id -> spec."""
    return {name: {traced.graph.input_nodes[i]: spec for i, spec in enumerate(leaf_specs)
                   if spec is not None} for name, leaf_specs in seeds.items()}


def start(problem: Problem, starts: list[tuple[str, dict | None]],
          batch_seeds: dict[str, dict[int, Spec]]) -> Candidates:
    """The propagations from ``starts`` (``passes.propagate.candidate_starts``) and their
    predicted step times, started in child processes: seconds of Python each on a deep
    model. As many children as cores but one (one on two cores; each child copies the pages
    of the graph it touches, so more children than cores cost more than they save)."""
    workers = max(1, min(len(starts), usable_cores() - 1))
    parts = [Deferred(_propagate_and_time, problem, starts[k::workers], process=True).start()
             for k in range(workers)]
    names = [name for name, _ in starts]
    return Candidates(problem=problem, plans=Deferred(_in_order, names, parts, 0),
                      times=Deferred(_in_order, names, parts, 1), batch_seeds=batch_seeds)


def best(candidates: Candidates, solution: Solution, memory_budget_bytes: float | None,
         progress) -> tuple[Solution, dict[str, float], dict[str, int]]:
    """The fastest predicted of the ILP's ``solution`` and the candidates, a plan within
    ``memory_budget_bytes`` first; with each plan's predicted step time and peak, by name
    (``passes.propagate.best_of``). When the ILP did not finish, the batch seeds' plans
    compete too. ``progress`` reports what it does."""
    p = candidates.problem
    plans, known_s = candidates.plans.result(), candidates.times.result()
    if solution.status != "optimal" and candidates.batch_seeds:
        # The ILP weighs every mesh axis for the batch, but did not finish: try each one
        # outside it, by propagation.
        progress(f"the ILP did not finish: propagating the batch over each of "
                 f"{len(candidates.batch_seeds)} mesh axes")
        plans.update(propagated_plans(p.graph, p.strats, p.mesh_ctx, p.labels, p.ties,
                                      candidates.batch_seeds, annotations_alone=False))
    progress(f"comparing the ILP's plan with {len(plans)} propagated ones")
    return best_of(solution, p.graph, p.strats, p.mesh_ctx, plans, memory_budget_bytes,
                   known_s)


def _propagate_and_time(problem: Problem, starts: list[tuple[str, dict | None]]
                        ) -> tuple[dict, dict]:
    """(name -> plan, name -> predicted step time) of the propagations from ``starts``."""
    p = problem
    plans = propagate_from(p.graph, p.strats, p.mesh_ctx, p.labels, p.ties, starts)
    return plans, step_times(p.graph, p.strats, p.mesh_ctx, plans)


def _in_order(names: list[str], parts: list[Deferred], k: int) -> dict:
    """The ``k``-th dict of each of ``parts`` (name -> plan, name -> time), merged in
    ``names``' order."""
    merged = {}
    for part in parts:
        merged.update(part.result()[k])
    return {name: merged[name] for name in names}
