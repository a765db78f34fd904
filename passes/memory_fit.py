"""The memory fit: a plan over the per-device memory budget is refitted under it.

The budget's rows (``passes.memory_budget.BudgetRows``: bytes live at a node, per plan) enter
the ILP of ``passes.ilp`` as penalties first (:func:`_penalties`), then as hard constraints to
polish a slow fitting plan (:func:`_hard_rows`); when no plan fits, the plan of least peak is
searched for (:func:`_smallest_peak`) and :func:`over_budget_error` names it and what
dominates it. Measurements behind the knobs: ``docs/solver_notes.md``.
"""

from __future__ import annotations

import math
import time

import numpy as np

from autopar._sizes import format_bytes
from autopar.errors import InfeasiblePlanError
from autopar.passes.dedup import Groups
from autopar.passes.highs import Work, solve_milp
from autopar.passes.ilp import IlpBuilder, choice_of
from autopar.passes.ir import Graph, NodeKind
from autopar.passes.memory_budget import (
    LIVE_AT_PEAK,
    MAX_ROUNDS,
    BudgetRows,
    breakdown,
    peak_lower_bound_bytes,
    peaks_over,
    plan_peak,
)
from autopar.passes.solution import Solution
from autopar.passes.strategies import MeshContext

# Relative optimality gap once memory rows are in: they weaken the LP bound, and closing the
# last fraction of a percent can take HiGHS ten times as long.
MEMORY_GAP = 5e-2
#: Penalty solves of :func:`_penalties` (a tight budget needs a penalty up to
#: PENALTY_STEP ** 4 times the first), each bounded by PENALTY_WORK: a penalized objective
#: has many near-ties, and proving one optimal can take HiGHS far longer than finding it;
#: the penalty is a heuristic anyway. Work, not time, bounds them, so a busy machine finds
#: the same plan (the time limit is a safety net).
PENALTY_SOLVES = 5
PENALTY_WORK = Work(mip_nodes=50)
#: The factor between successive penalties until a plan fits.
PENALTY_STEP = 8.0
#: A plan that fits within this of the plain plan's objective ends the refit; a slower one is
#: polished by solves of the memory rows as hard constraints (:func:`_hard_rows`, at most
#: HARD_ROW_SOLVES, each adding a row for each of up to HARD_ROW_NEW_ROWS stretches of nodes
#: its plan is over the budget at), each bounded by HARD_ROW_WORK: HiGHS takes much longer
#: under hard rows, mostly at the MIP's root, which no node limit bounds. So the sub-MIP
#: heuristics are off (the same plans, in half the time, on the wide MLP's), and no MIP
#: follows the LP relaxation's dive: its plan, or none under the cutoff, is the solve's
#: answer (docs/solver_notes.md, "No MIP after a hard-row solve's dive").
PENALTY_CLOSE_ENOUGH = 1e-3
HARD_ROW_SOLVES = 2
HARD_ROW_NEW_ROWS = 4
HARD_ROW_WORK = Work(mip_nodes=200, sub_mips=False, mip_max_nonzeros=0)
#: Each solve of the least-peak search (:func:`_smallest_peak`).
LEAST_PEAK_WORK = Work(mip_nodes=100)
#: Graphs with these nodes (loops) are not polished: a plan polished to the budget's edge
#: compiles over it, as the model misses how XLA:CPU packs a loop's stacked buffers.
LOOP_KINDS = (NodeKind.CARRY, NodeKind.SCAN_IN, NodeKind.SCAN_OUT)


class _Refit:
    """One refit's ILP, budget rows and search for the least peak: what its solves share."""

    def __init__(self, builder: IlpBuilder, budget: BudgetRows, time_limit_s: float,
                 start: list[int], progress):
        self.builder, self.budget, self.progress = builder, budget, progress
        self.time_limit_s, self.start = time_limit_s, start
        self.least, self.least_choice = float("inf"), None  # of the plans the solves find

    def smallest(self) -> tuple[int, list[int]]:
        """:func:`_smallest_peak`'s plan, said."""
        b = self.builder
        found = _smallest_peak(b.g, b.strats, b.groups, b.mesh, self.budget, self.time_limit_s,
                               self.start)
        self.progress(f"least peak found: {format_bytes(found[0])}")
        return found

    def penalty(self) -> np.ndarray:
        """Bytes live at the rows of ``budget.cuts``, per variable, in budgets."""
        p = np.zeros(self.builder.n)
        for t, _ in self.budget.cuts:
            for i, coef in self.budget.row(t, self.builder.offset).items():
                p[i] += coef
        return p

    def attempt(self, res) -> tuple[float, bool, list[int]]:
        """The plan's peak, whether the row where it peaks joined the cuts (it was over the
        budget at a node no row covered), and the plan."""
        b, budget = self.builder, self.budget
        choice = choice_of(res.x, b.g, b.groups, b.offset)
        inputs_take_their_slices(b.g, b.strats, b.groups, b.mesh, choice)
        peak, t, copies = plan_peak(b.g, b.strats, choice, b.mesh)
        if peak < self.least:
            self.least, self.least_choice = peak, choice
        if peak > budget.budget_bytes and (t, copies) not in budget.cuts:
            budget.cuts.append((t, copies))
            return peak, True, choice
        return peak, False, choice


def fit_budget(builder: IlpBuilder, budget: BudgetRows, time_limit_s: float,
               start: list[int], start_s: float, objective_us: float, progress):
    """((least peak found, its plan), (choice, objective in us, seconds) of the cheapest plan
    found that fits the budget, or None). ``start``: the plan that ignores the budget, solved in
    ``start_s``, of ILP objective ``objective_us``.

    Penalties first (:func:`_penalties`). A fitting plan more than
    :data:`PENALTY_CLOSE_ENOUGH` slower than ``start`` is polished with the rows as hard
    constraints (:func:`_hard_rows`; not on graphs with loops, :data:`LOOP_KINDS`). Only when
    no penalty gives a plan that fits is the plan of least peak searched for
    (:func:`_smallest_peak`), and taken when it fits; it also gives the smallest peak an
    ``InfeasiblePlanError`` names. A budget under
    :func:`passes.memory_budget.peak_lower_bound_bytes` skips the penalties."""
    g, mesh = builder.g, builder.mesh
    c, A, lb, ub, integer = builder.matrices()
    t0 = time.perf_counter()
    refit = _Refit(builder, budget, time_limit_s, start, progress)
    bound = peak_lower_bound_bytes(g, math.prod(mesh.axis_sizes.values()), mesh.results_held)
    if bound > budget.budget_bytes:
        return refit.smallest(), None
    total = time.perf_counter() - t0
    best, took = _penalties(refit, (c, A, lb, ub, integer), time_limit_s, objective_us)
    total += took
    if (best is not None and float(c @ best.x) > objective_us * (1 + PENALTY_CLOSE_ENOUGH)
            and not any(n.kind in LOOP_KINDS for n in g.nodes)):
        t = time.perf_counter()
        polished = _hard_rows(refit, float(c @ best.x), objective_us, time_limit_s)
        total += time.perf_counter() - t
        if polished is not None:
            best = polished
    if best is not None:
        return (refit.least, refit.least_choice), (
            choice_of(best.x, g, builder.groups, builder.offset), float(c @ best.x), total)
    return _least_peak_plan(refit, c, total)


def _penalties(refit: _Refit, ilp: tuple, limit_s: float, objective_us: float):
    """(the result of the first penalty's plan that fits, or None; seconds solving).

    Faster plans first, by penalty (Lagrangian relaxation): minimize time + lam * (bytes live
    at the rows of ``budget.cuts``, the nodes where plans peaked), from lam = ``objective_us``
    / PENALTY_STEP per budget (a budget's worth of bytes at the rows costs an eighth of a
    step, so a plan just over the budget gives up little time), raising lam until a plan
    fits, adding the row of every node a plan peaks at (past lam_max, where memory outweighs
    every cost, only while that still lowers the peak). Each solve does PENALTY_WORK at most
    (``limit_s``: its safety-net time limit)."""
    c, A, lb, ub, integer = ilp
    budget, progress = refit.budget, refit.progress
    best, total, last_peak = None, 0.0, float("inf")
    lam_max = max(float(np.abs(c).sum()), 1.0)
    lam = min(max(objective_us / PENALTY_STEP, 1.0), lam_max)
    for _ in range(PENALTY_SOLVES):
        res, took = solve_milp(c + lam * refit.penalty(), A, lb, ub, integer, limit_s,
                               gap=MEMORY_GAP, work=PENALTY_WORK)
        total += took
        if res.x is None:
            break
        peak, new_row, _ = refit.attempt(res)
        slower = float(c @ res.x) / max(objective_us, 1e-9) - 1
        progress(f"memory penalty {lam:.3g} us per budget: {took:.2f}s, peak "
                 f"{format_bytes(peak)}, {slower:+.1%} time")
        if peak <= budget.budget_bytes:
            best = res
            break
        if new_row:
            continue  # the same penalty again, now over the row where this plan peaked too
        if peak >= last_peak * 0.999 and lam >= lam_max:
            break  # a larger penalty no longer lowers the peak
        last_peak = peak
        lam *= PENALTY_STEP
    return best, total


def _least_peak_plan(refit: _Refit, c: np.ndarray, total: float):
    """:func:`fit_budget`'s answer when no penalty's plan fits: the plan of least peak found
    (:func:`_smallest_peak`, or a penalty's), when it fits; ``total``: seconds so far."""
    t = time.perf_counter()
    found = refit.smallest()
    total += time.perf_counter() - t
    if found[0] < refit.least:
        refit.least, refit.least_choice = found
    least, least_choice = refit.least, refit.least_choice
    if least > refit.budget.budget_bytes:
        return (least, least_choice), None
    x = refit.builder.point(least_choice)
    return (least, least_choice), (least_choice, float("nan") if x is None else float(c @ x),
                                   total)


def _hard_rows(refit: _Refit, cutoff_us: float, objective_us: float, time_limit_s: float):
    """The cheapest plan under the memory rows of ``budget.cuts`` as hard constraints and
    faster than ``cutoff_us``, each solve adding rows where its plan is over the budget, for
    at most :data:`HARD_ROW_SOLVES` solves of :data:`HARD_ROW_WORK` each (``time_limit_s``:
    each one's safety-net time limit); None when none fits. The penalty solves price every
    byte at every row, so the plans between a penalty's last plan over the budget and its
    first under it are out of their reach (not on the convex hull); the rows as constraints
    reach them."""
    builder, budget, progress = refit.builder, refit.budget, refit.progress
    for _ in range(HARD_ROW_SOLVES):
        c, A, lb, ub, integer = builder.matrices(
            (budget.row(t, builder.offset), -np.inf, budget.rhs(copies))
            for t, copies in budget.cuts)
        res, took = solve_milp(c, A, lb, ub, integer, time_limit_s, gap=MEMORY_GAP,
                               cutoff=cutoff_us * (1 - 1e-6), work=HARD_ROW_WORK)
        rows = len(budget.cuts)
        if res.x is None:
            progress(f"memory rows as constraints ({rows}): {took:.2f}s, none faster found")
            return None
        peak, _, choice = refit.attempt(res)
        progress(f"memory rows as constraints ({rows}): {took:.2f}s, peak "
                 f"{format_bytes(peak)}, {float(c @ res.x) / objective_us - 1:+.1%} time")
        if peak <= budget.budget_bytes:
            return res
        budget.cuts += [cut for cut in peaks_over(builder.g, builder.strats, choice, builder.mesh,
                                                  budget.budget_bytes, HARD_ROW_NEW_ROWS)
                        if cut not in budget.cuts]
        if len(budget.cuts) == rows:
            return None  # over the budget where a row already is: the rows cannot say more
    return None


def _smallest_peak(graph: Graph, strats, groups: Groups, mesh: MeshContext,
                   budget: BudgetRows, time_limit_s: float, start: list[int]
                   ) -> tuple[int, list[int]]:
    """(peak, choice) of the plan with the least peak found: minimize M over the memory rows
    (each <= M), starting from the rows of ``budget.cuts`` (when there are none, the one where
    plan ``start`` peaks), and adding (to ``budget.cuts``) the row where each plan found
    peaks, as long as that lowers the peak. It prices no resharding, so its plans can peak on
    the copies their mismatched shardings make."""
    b = IlpBuilder(graph, strats, groups, mesh)
    b.add_groups()
    m = b.new_vars(1, False)
    b.cost[m] = 1.0
    best: tuple[int, list[int]] | None = None
    cuts = budget.cuts  # the rows found here serve the caller's later solves too
    if not cuts:
        cuts.append(plan_peak(graph, strats, start, mesh)[1:])
    for _ in range(MAX_ROUNDS):
        b.rows = b.rows[:len(groups.sizes)] + [
            ({**budget.row(t, b.offset), m: -1.0}, -np.inf, budget.rhs(copies) - 1.0)
            for t, copies in cuts]
        c, A, lb, ub, integer = b.matrices()
        upper = np.ones(b.n)
        upper[m] = np.inf
        res, _ = solve_milp(c, A, lb, ub, integer, time_limit_s, upper, gap=MEMORY_GAP,
                            work=LEAST_PEAK_WORK)
        if res.x is None:
            break
        choice = choice_of(res.x, graph, groups, b.offset)
        inputs_take_their_slices(graph, strats, groups, mesh, choice)
        peak, t, copies = plan_peak(graph, strats, choice, mesh)
        if best is None or peak < best[0]:
            best = (peak, choice)
        if (t, copies) in cuts:
            break
        cuts.append((t, copies))
    assert best is not None, "the min-peak ILP has no constraint that can fail"
    return best


def _gib(n: float) -> str:
    return format_bytes(n)


#: What shrinks each part of a peak, for the InfeasiblePlanError message.
_ADVICE = {
    LIVE_AT_PEAK: "a smaller batch or sequence, or rematerialization",
    "optimizer state": "a lower-precision or stateless optimizer",
    "results": "the state the step returns, which XLA:CPU holds for the whole call",
}


def over_budget_error(graph, strats, groups, mesh, budget_bytes: float, input_labels,
                      time_limit_s: float, solution: Solution, tried: str = "",
                      advice: str = "") -> InfeasiblePlanError:
    """The error for a program no plan of which fits ``budget_bytes`` (``solution``: the plan
    found without it): the smallest peak found (the solve's, or a min-peak ILP's when the
    solve did not look for one) and what dominates it. ``tried``: what else was tried, said in
    the message (rematerialization, say); ``advice``: a sentence more on what to do."""
    if solution.least_peak_choice is not None:
        peak, choice = solution.least_peak_bytes, solution.least_peak_choice
    else:
        budget = BudgetRows(graph, strats, groups, mesh, budget_bytes)
        peak, choice = _smallest_peak(graph, strats, groups, mesh, budget, time_limit_s,
                                      solution.choice)
    parts = breakdown(graph, strats, choice, mesh, input_labels)
    detail = ", ".join(f"{name} {_gib(size)}" for name, size in parts if size)
    top = parts[0][0]
    error = InfeasiblePlanError(
        f"no sharding plan fits `memory_budget` = {_gib(budget_bytes)} per device{tried}: the "
        f"smallest peak autopar found is {_gib(peak)} per device, dominated by {top} "
        f"({detail}); a budget of that fits as predicted, and a little less may (the search "
        f"for the least peak is not exhaustive). Raise `memory_budget`, plan on more devices, "
        f"or shrink {top} ({_ADVICE.get(top, 'smaller or lower-precision arrays')}).{advice}")
    error.smallest_peak_bytes = peak
    error.peak_breakdown = parts
    return error


def inputs_take_their_slices(graph: Graph, strats, groups: Groups, mesh: MeshContext,
                             choice: list[int]) -> None:
    """An argument whose every consumer slices it to the same spec (a free local slice) is
    given that spec itself. The time is the same, and the argument then takes less memory
    per device; the ILP sees the two as a tie."""
    users = graph.consumers()
    tied = {groups.group_of[n.id] for n in graph.nodes if n.kind is not NodeKind.INPUT}
    for n in graph.input_nodes:
        if groups.group_of[n] in tied:
            continue  # tied to other nodes (a state output): keep the group's choice
        vid = graph.nodes[n].outs[0]
        wanted = {strats[w][choice[w]].in_specs[pos] for w, pos in users.get(vid, ())}
        if len(wanted) != 1:
            continue
        dst = wanted.pop()
        src = strats[n][choice[n]].out_specs[0]
        if dst is None or dst == src:
            continue
        steps = mesh.reshard(src, dst, graph.values[vid])
        match = [i for i, st in enumerate(strats[n]) if st.out_specs[0] == dst]
        if match and all(step.kind is None for step in steps):
            choice[n] = match[0]
