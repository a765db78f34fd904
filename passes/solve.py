"""Pass 6, solve: pick one strategy per node by integer linear programming.

The ILP (its formulation: ``passes.ilp``) is solved by HiGHS (``passes.highs``), starting from
the best of the propagated plans it is given (a warm start); a plan over the memory budget is
refitted under it (``passes.memory_fit``). Then it is built again around its plan, with the
communication that plan's timeline hides taken off, so that the objective prices the makespan,
and solved again where that plan is not proven optimal (:func:`_with_overlap`); before that,
state the plan gathers at the step's end is kept in its update's sharding where that shortens
the makespan (``passes.at_rest``). A plan that takes collective matmuls competes with the plan
found the same way with them charged in full (:func:`solve`). With no solution in the time
limit a greedy plan is used, and a warning says so.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import scipy.optimize

from autopar._sizes import format_bytes
from autopar.errors import InfeasiblePlanError, SolverFallbackWarning, warn
from autopar.passes.at_rest import MAX_NODES as REST_MAX_NODES, rest_in_update_sharding
from autopar.passes.background import Deferred
from autopar.passes.dedup import Groups
from autopar.passes.estimate import hidden_comm, plan_makespan
from autopar.passes.highs import cutoff_of, shared_bases, solve_milp, warm_start
from autopar.passes.ilp import RINGS, IlpBuilder, choice_of
from autopar.passes.ir import Graph
from autopar.passes.memory_budget import BudgetRows, plan_peak
from autopar.passes.memory_fit import fit_budget, inputs_take_their_slices
from autopar.passes.solution import Solution, SolveStatus, Source
from autopar.passes.strategies import MeshContext

__all__ = ["Solution", "SolveStatus", "Source", "greedy", "solve"]


def solve(graph: Graph, strats, groups: Groups, mesh: MeshContext, *,
          time_limit_s: float = 60.0, memory_budget_bytes: float | None = None,
          warm: list[list[int]] | Deferred = (), progress=lambda msg: None,
          preferences: dict | None = None) -> Solution:
    """The ILP's plan. ``warm``: plans made elsewhere (propagated ones) to start from, or a
    :class:`passes.background.Deferred` of name -> plan (made when first asked for): the
    best objective among them is HiGHS's cutoff (``passes.highs.solve_milp``), and when the
    solver finds nothing better in its time limit, that plan is the solution (status
    :attr:`SolveStatus.WARM_START`). With ``memory_budget_bytes``, a plan over the budget is
    refitted (``passes.memory_fit.fit_budget``). When none fits, the plan without the budget,
    marked ``fits_budget=False`` (``passes.memory_fit.over_budget_error`` says why); the
    budget's rows are made in the background while HiGHS solves (``passes.background``).
    ``preferences``: node -> a penalty per strategy, a tie break (``passes.ilp``).

    The ILP without a reference charges every reduction in full and a collective matmul only
    what its own pieces leave exposed, so it takes rings that hide what the plan's timeline
    would hide anyway (a reduce-scatter beside independent compute). When its plan takes one,
    the ILP's plan with rings charged in full (``IlpBuilder(..., rings_in_full=True)``),
    refitted to the budget and priced with its overlap but not solved again around it (that
    would double the time of a solve that is not proven optimal), competes, and the one of
    the shorter makespan is taken (``Solution.rings_dropped``)."""
    with shared_bases():   # the ILPs below share the first's constraints
        return _solve(graph, strats, groups, mesh, time_limit_s, memory_budget_bytes, warm,
                      progress, preferences)


def _solve(graph: Graph, strats, groups: Groups, mesh: MeshContext, time_limit_s: float,
           memory_budget_bytes: float | None, warm, progress, preferences) -> Solution:
    """:func:`solve`'s work, within its :func:`passes.highs.shared_bases`."""
    rows = (None if memory_budget_bytes is None else
            Deferred(BudgetRows, graph, strats, groups, mesh, memory_budget_bytes))
    if rows is not None:
        rows.start()
    builder = IlpBuilder(graph, strats, groups, mesh, preferences).build()
    solution = _solved(builder, rows, warm, time_limit_s, progress)
    rings = _rings(builder, solution)
    if not rings:
        return solution
    progress(f"ILP again with collective matmuls charged in full, to check the plan's {rings} "
             "ring(s) against a plan without them")
    plain = IlpBuilder(graph, strats, groups, mesh, preferences, like=builder,
                       rings_in_full=True).build()
    left_s = max(time_limit_s - solution.solve_time_s, time_limit_s * OVERLAP_TIME_SHARE)
    with warnings.catch_warnings(record=True) as said:  # said only if its plan is taken
        warnings.simplefilter("always", SolverFallbackWarning)
        other = _solved(plain, rows, warm, left_s, progress, again=False)
    took_s = solution.solve_time_s + other.solve_time_s
    makespans = [plan_makespan(graph, strats, s.choice, mesh)[0] for s in (solution, other)]
    shorter = other.fits_budget and makespans[1] < makespans[0]
    progress(f"ILP with rings charged in full: a plan of makespan {makespans[1] * 1e3:.3f} ms "
             f"against {makespans[0] * 1e3:.3f}; " + ("taken" if shorter else "not taken"))
    for w in said if shorter else ():
        warn(str(w.message), w.category)
    return dataclasses.replace(other if shorter else solution, solve_time_s=took_s,
                               rings_dropped=shorter)


def _rings(builder: IlpBuilder, solution: Solution) -> int:
    """How many collective matmuls ``solution`` takes, if it is a plan that fits its budget
    (else 0)."""
    if not solution.fits_budget or solution.memory_rows:
        return 0
    strats = builder.strats
    return sum(strats[n][c].rewrite is not None and strats[n][c].rewrite.kind in RINGS
               for n, c in enumerate(solution.choice))


def _solved(builder: IlpBuilder, rows: Deferred | None, warm, time_limit_s: float,
            progress, again: bool = True) -> Solution:
    """The plan of ``builder``'s ILP (see :func:`solve`), refitted to the budget, priced with
    its overlap and, with ``again``, solved again around it (:func:`_with_overlap`)."""
    c, A, lb, ub, integer = builder.matrices()
    started = []  # the warm start, once asked for: an integral relaxation needs none

    def cutoff() -> float | None:
        started.append(warm_start(builder, c, warm.result().values()
                                  if isinstance(warm, Deferred) else warm))
        return None if started[0] is None else cutoff_of(started[0][1])

    res, took = solve_milp(c, A, lb, ub, integer, time_limit_s, cutoff=cutoff)
    start = started[0] if started else None
    progress(f"ILP: {took:.2f}s, {res.message}"
             + ("" if start is None else f" (warm start: cutoff {start[1]:.1f} us)"))
    if start is not None and (res.x is None or c @ res.x > cutoff_of(start[1])):
        res = _keep_warm_start(res, start, time_limit_s)
    if res.status == 2:  # infeasible: pins are the only hard constraints
        raise InfeasiblePlanError(
            "no sharding plan satisfies the pinned shardings: two hints or "
            "with_sharding_constraint calls contradict each other. Remove one of them.")
    budget = None if rows is None else rows.result()
    if res.x is None:
        return _greedy_solution(builder, budget, res, took, time_limit_s)
    solution = _solution(res, builder, took)
    if budget is not None:
        solution = _fit(builder, budget, solution, time_limit_s, progress)
    # A plan proven optimal, or refitted to the budget (or over it), is only priced with its
    # overlap: around a serial optimum no plan prices below it but through the approximated
    # terms (see _with_overlap), and a solve without the budget's rows finds plans over it.
    settled = (not again or solution.status is SolveStatus.OPTIMAL
               or bool(solution.memory_rows) or not solution.fits_budget)
    return _with_overlap(builder, budget, solution, time_limit_s, progress,
                         solves=0 if settled else OVERLAP_SOLVES)


#: Solves at most after the first, each pricing the overlap of the plan before it.
OVERLAP_SOLVES = 2
#: A plan found around another replaces it only if its makespan is shorter by this share:
#: less is within what the plan's estimate can tell (it prices no memory traffic).
OVERLAP_MIN_GAIN = 0.01
#: No solve around a plan starts with less than this share of the time limit left.
OVERLAP_TIME_SHARE = 0.1


def _with_overlap(builder: IlpBuilder, budget: BudgetRows | None, solution: Solution,
                  time_limit_s: float, progress, solves: int) -> Solution:
    """The plan of the ILP whose communication costs are what exceeds the overlap of a
    reference plan's timeline (``passes.estimate.hidden_comm``), and its objective with the
    plan as its own reference: its estimated makespan, as the ILP prices it.

    The first solve charges every collective in full. The ILP around a reference charges a
    strategy's reductions, latencies and incoming moves less what the reference's timeline
    hides of them at that node or edge (a linear term: the hidden time is a constant per node
    and edge), and is solved from the reference (a warm start and cutoff). A plan gets at
    most the reference's hidden time in all, except through the terms priced axis by axis or
    shared by several readers, so around a proven serial optimum a solve could only find that
    approximation's errors: the caller asks for none there (``solves=0``). A plan found
    becomes the reference only if its makespan is shorter by :data:`OVERLAP_MIN_GAIN` and it
    fits the memory budget; the loop ends when none does, after ``solves`` solves, or when
    less than :data:`OVERLAP_TIME_SHARE` of ``time_limit_s`` is left. A plan the ILP cannot
    take as a point (none of a group's members has its strategy) keeps the serial objective.
    A plan that fits the budget first keeps state in its update's sharding where that pays
    (:func:`_state_at_rest`, unless :func:`_fit` already did): the first reference is that
    plan."""
    graph, strats, groups, mesh = builder.g, builder.strats, builder.groups, builder.mesh
    took_s, solved = solution.solve_time_s, 0

    def makespan(choice):
        return plan_makespan(graph, strats, choice, mesh)[0]

    if solution.fits_budget and not solution.state_at_rest:
        solution = _state_at_rest(builder, budget, solution, makespan)

    while True:
        overlap = IlpBuilder(graph, strats, groups, mesh, builder.preferences,
                             hidden_comm(graph, strats, solution.choice, mesh),
                             like=builder).build()
        here = overlap.point(solution.choice)
        if here is None:
            return dataclasses.replace(solution, solve_time_s=took_s, overlap_solves=solved)
        objective_us = float(np.asarray(overlap.cost) @ here)
        solution = dataclasses.replace(solution, objective_us=objective_us, solve_time_s=took_s,
                                       overlap_solves=solved)
        left_s = time_limit_s - took_s
        if solved == solves or left_s < time_limit_s * OVERLAP_TIME_SHARE:
            return solution
        c, A, lb, ub, integer = overlap.matrices()
        progress(f"ILP again around the plan, its communication charged less what the plan's "
                 f"timeline hides (solve {solved + 1} of at most {solves})")
        res, took = solve_milp(c, A, lb, ub, integer, left_s,
                               cutoff=cutoff_of(solution.objective_us))
        took_s, solved = took_s + took, solved + 1
        choice = (None if res.x is None or float(c @ res.x) >= solution.objective_us * (1 - 1e-6)
                  else choice_of(res.x, graph, groups, overlap.offset))
        if choice is not None:
            inputs_take_their_slices(graph, strats, groups, mesh, choice)
            if (makespan(choice) > makespan(solution.choice) * (1 - OVERLAP_MIN_GAIN)
                    or budget is not None
                    and plan_peak(graph, strats, choice, mesh)[0] > budget.budget_bytes):
                choice = None
        progress(f"ILP with overlap: {took:.2f}s, {res.message}; " + (
            "the plan stays" if choice is None else "a plan of a shorter makespan"))
        if choice is None:
            return dataclasses.replace(solution, solve_time_s=took_s, overlap_solves=solved)
        solution = dataclasses.replace(solution, choice=choice, status=res.ending)


def _state_at_rest(builder: IlpBuilder, budget: BudgetRows | None, solution: Solution,
                   makespan) -> Solution:
    """``solution`` with the state it gathers at the step's end kept between steps in its
    update's sharding where that shortens the makespan (:func:`_rest_moves`), if the plan
    still fits the memory budget."""
    graph, strats, mesh = builder.g, builder.strats, builder.mesh
    choice, moved = _rest_moves(builder, solution.choice, makespan)
    if not moved or (budget is not None
                     and plan_peak(graph, strats, choice, mesh)[0] > budget.budget_bytes):
        return solution
    return dataclasses.replace(solution, choice=choice, state_at_rest=moved)


def _rest_moves(builder: IlpBuilder, choice: list[int], makespan) -> tuple[list[int], int]:
    """(``choice`` with state kept in its update's sharding where that shortens ``makespan``,
    the arrays moved: ``passes.at_rest``). Only where collectives run beside compute
    (``HardwareProfile.async_collectives``): in line, a gather costs the same wherever it is;
    and on graphs of at most ``passes.at_rest.MAX_NODES`` nodes."""
    graph, strats, groups, mesh = builder.g, builder.strats, builder.groups, builder.mesh
    if not mesh.profile.async_collectives or len(graph.nodes) > REST_MAX_NODES:
        return choice, 0
    return rest_in_update_sharding(graph, strats, groups, choice, makespan,
                                   hidden_comm(graph, strats, choice, mesh))


def _keep_warm_start(res, start: tuple[np.ndarray, float], time_limit_s: float):
    """The warm start's plan as the solver's result, when the solver found nothing better than
    it: proven (infeasible under the cutoff), or not found in time (then a warning). A plan
    within the cutoff's slack of it is as good: the tie breaks may prefer it."""
    proven = res.status == 2
    if not proven:
        warn(f"autopar: the ILP found no plan better than the propagated one in "
             f"{time_limit_s:.0f}s ({res.message}); using that plan. Raise `time_limit_s` for "
             "a better one.", SolverFallbackWarning)
    return scipy.optimize.OptimizeResult(x=start[0], fun=start[1], status=0 if proven else 1,
                                         message="warm start", ending=SolveStatus.WARM_START)


def _greedy_solution(builder: IlpBuilder, budget: BudgetRows | None, res, took: float,
                     time_limit_s: float) -> Solution:
    """The greedy plan, said, when the ILP found no solution in time."""
    graph, strats, groups, mesh = builder.g, builder.strats, builder.groups, builder.mesh
    warn(f"autopar: the ILP found no solution in {time_limit_s:.0f}s ({res.message}); using "
         "a greedy plan (or a propagated one predicted faster, with baseline_seeds). Raise "
         "`time_limit_s` for a better one.", SolverFallbackWarning)
    choice = greedy(graph, strats, groups, mesh)
    fits = budget is None or plan_peak(graph, strats, choice, mesh)[0] <= budget.budget_bytes
    edges_before, edges_after = builder.edge_counts()
    return Solution(choice=choice, objective_us=float("nan"), status=SolveStatus.GREEDY,
                    num_variables=builder.n, num_constraints=len(builder.rows),
                    solve_time_s=took, edges_before=edges_before, edges_after=edges_after,
                    fits_budget=fits)


def _solution(res, builder: IlpBuilder, took: float) -> Solution:
    """The solver's result as a Solution."""
    choice = choice_of(res.x, builder.g, builder.groups, builder.offset)
    inputs_take_their_slices(builder.g, builder.strats, builder.groups, builder.mesh, choice)
    edges_before, edges_after = builder.edge_counts()
    return Solution(choice=choice, objective_us=float(res.fun), status=res.ending,
                    num_variables=builder.n, num_constraints=len(builder.rows),
                    solve_time_s=took, edges_before=edges_before, edges_after=edges_after,
                    source=Source.ILP)


def _fit(builder: IlpBuilder, budget: BudgetRows, solution: Solution, time_limit_s: float,
         progress) -> Solution:
    """``solution``, or when it is over the budget, it with its state kept in its update's
    sharding (:func:`_rest_moves`, which holds less between steps) when that fits, else the plan
    the memory fit finds under it (``passes.memory_fit.fit_budget``; its ILP does not know
    that move, which :func:`_with_overlap` then tries on the plan it finds), else it marked as
    not fitting."""
    graph, strats, groups, mesh = builder.g, builder.strats, builder.groups, builder.mesh
    peak, t, copies = plan_peak(graph, strats, solution.choice, mesh)
    if peak <= budget.budget_bytes:
        return solution
    choice, moved = _rest_moves(builder, solution.choice,
                                lambda c: plan_makespan(graph, strats, c, mesh)[0])
    if moved and plan_peak(graph, strats, choice, mesh)[0] <= budget.budget_bytes:
        return dataclasses.replace(solution, choice=choice, state_at_rest=moved)
    progress(f"memory: the plan peaks at {format_bytes(peak)} at node {t}, over the budget "
             f"of {format_bytes(budget.budget_bytes)}")
    budget.cuts.append((t, copies))
    (least, least_choice), fitted = fit_budget(builder, budget, time_limit_s, solution.choice,
                                               solution.solve_time_s, solution.objective_us,
                                               progress)
    if fitted is None:
        return dataclasses.replace(solution, fits_budget=False, memory_rows=len(budget.cuts),
                                   least_peak_bytes=least, least_peak_choice=least_choice)
    choice, objective_us, took = fitted
    inputs_take_their_slices(graph, strats, groups, mesh, choice)
    return dataclasses.replace(solution, choice=choice, objective_us=objective_us,
                               solve_time_s=solution.solve_time_s + took,
                               memory_rows=len(budget.cuts), least_peak_bytes=least,
                               least_peak_choice=least_choice)


def greedy(graph: Graph, strats, groups: Groups, mesh: MeshContext) -> list[int]:
    """Each group, in node order, takes its cheapest strategy given the choices made so far."""
    picked: dict[int, int] = {}
    for node in graph.nodes:
        g = groups.group_of[node.id]
        if g in picked:
            continue
        best, best_cost = 0, float("inf")
        for i in range(groups.sizes[g]):
            cost = 0.0
            for n in groups.members[g]:
                s = strats[n][groups.index_map[n][i]]
                cost += s.cost_s * graph.nodes[n].trip_count
                for pos, vid in enumerate(graph.nodes[n].ins):
                    if vid is None:
                        continue
                    u, k = graph.producer[vid]
                    gu = groups.group_of[u]
                    if gu in picked:
                        src = strats[u][groups.index_map[u][picked[gu]]].out_specs[k]
                        cost += mesh.reshard_time_s(src, s.in_specs[pos], graph.values[vid])
            if cost < best_cost:
                best, best_cost = i, cost
        picked[g] = best
    return [int(groups.index_map[n][picked[groups.group_of[n]]]) for n in range(len(graph.nodes))]
