"""The HiGHS driver: the ILP of ``passes.ilp`` solved through ``scipy.optimize.milp``.

The LP relaxation is solved first (by the HiGHS bindings scipy ships, so that within one
solve an LP of the constraints an earlier one had starts from that one's optimal basis:
:func:`shared_bases`) and taken when integral; a fractional one starts a dive
(:func:`_from_relaxation`), and only then does the MIP run, with a warm start's objective as
its cutoff (:func:`warm_start`). Each HiGHS run is bounded by work, not time: simplex
iterations for the LP, branch-and-bound nodes for the MIP (:class:`Work`), so a plan does not
depend on how busy the machine is; at the limit the best incumbent is kept. The time limit
stays as a safety net, and a :class:`SolverFallbackWarning` says when it fired. One thread and
fixed tie breaks (:func:`_tie_break`) make the same ILP give the same plan. Measurements
behind these choices: ``docs/solver_notes.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import scipy.sparse

from autopar.errors import SolverFallbackWarning, warn
from autopar.passes.ilp import IlpBuilder
from autopar.passes.solution import SolveStatus

#: scipy.optimize.milp's status for "other" (HiGHS refused an option, among others).
HIGHS_OTHER_STATUS = 4
#: scipy.optimize.milp's status for "iteration or time limit reached".
LIMIT_STATUS = 1
#: HiGHS's model status at its node limit (scipy does not know it and says "other").
NODE_LIMIT_MARK = "HiGHS Status 16"
#: The message of a run HiGHS stopped at its node limit.
NODE_LIMIT_MESSAGE = "node limit reached"


@dataclass(frozen=True)
class Work:
    """How much work one solve may do, whatever the wall clock says: the LP relaxation's
    simplex iterations (``lp_iterations_per_row`` per constraint, at least ``lp_iterations``),
    the branch-and-bound nodes of each MIP run (the dive's and the MIP's), and whether HiGHS
    runs its sub-MIP heuristics (RINS, RENS) at the root, which the node limit does not
    bound. Above ``mip_max_nonzeros`` constraint nonzeros, no MIP runs after a dive whose plan
    is outside the gap: its root alone (an LP as large as the relaxation, then cuts) is bound
    by no work limit, so only the wall clock would stop it."""
    mip_nodes: int = 500
    lp_iterations: int = 100_000
    lp_iterations_per_row: int = 20
    sub_mips: bool = True           # HiGHS's RINS and RENS heuristics (sub-MIPs at the root)
    mip_max_nonzeros: int = 300_000

    def lp_limit(self, rows: int) -> int:
        return max(self.lp_iterations, self.lp_iterations_per_row * rows)


#: The work of a plain solve (``passes.solve``). Root-solved ILPs (most: see the notes) take
#: one node and a few simplex iterations per row.
SOLVE_WORK = Work()


def solve_milp(c, A, lb, ub, integer, time_limit_s: float, upper=None, gap: float = 1e-3,
               cutoff=None, work: Work = SOLVE_WORK):
    """(result, seconds) of HiGHS on: minimize ``c @ x`` with ``lb <= A @ x <= ub``, ``x``
    integral where ``integer``, ``0 <= x <= upper`` (1 when None), to the relative ``gap``,
    within ``work`` (the same answer on any machine); ``time_limit_s`` is a safety net, and a
    SolverFallbackWarning says when it stopped HiGHS first.
    ``cutoff``: an objective some plan is known to reach (a warm start), or a function giving
    it (or None), called only when a dive or the MIP runs: HiGHS's ``objective_bound`` option,
    which prunes every branch that cannot beat it. The result's ``fun`` is the cost of its ``x``
    without the tie breaks, and its ``ending`` the :class:`SolveStatus` its plan has.

    The LP relaxation goes first (:func:`_from_relaxation`); the MIP then gets what is left of
    ``time_limit_s``, and at least :data:`MIP_MIN_SHARE` of it, unless the ILP is larger than
    ``work.mip_max_nonzeros`` and a dive found a plan: that plan is then the answer (none
    when over a given cutoff). One thread and fixed tie breaks, so the same ILP gives the same
    plan; HiGHS's feasibility jump heuristic is off, as these ILPs are solved at the root. A
    HiGHS that refuses the thread option (its thread pool is fixed by a process's first solve)
    solves again without it. Branching follows pseudo-costs from the first node, with no
    strong branching (``mip_pscost_minreliable`` 0)."""
    options = {"time_limit": time_limit_s, "disp": bool(os.environ.get("AUTOPAR_HIGHS_LOG")),
               "mip_rel_gap": gap, "mip_heuristic_run_feasibility_jump": False,
               "mip_pscost_minreliable": 0,  # no strong branching: see docs/solver_notes.md
               "threads": 1, "node_limit": work.mip_nodes,
               **({} if work.sub_mips else {"mip_heuristic_run_rins": False,
                                            "mip_heuristic_run_rens": False}),
               "simplex_iteration_limit": work.lp_limit(A.shape[0])}
    costs = c + _tie_break(c)
    start = time.perf_counter()
    run = _Runner(costs, A, lb, ub, upper)

    def resolved():
        nonlocal cutoff
        if callable(cutoff):
            cutoff = cutoff()
        return cutoff
    # A dive the MIP follows looks only under the cutoff, as the MIP does; one without the
    # MIP after it (see Work) looks for any plan, which the cutoff then judges.
    mip_follows = _nonzeros(A) <= work.mip_max_nonzeros
    res, dived = _from_relaxation(run, integer, options, costs, gap, upper,
                                  resolved if mip_follows else None)
    if (res is not None and cutoff is not None and not callable(cutoff)
            and float(costs @ res.x) > cutoff):
        # Over a given cutoff: an integral relaxation's optimum is the ILP's, so no plan
        # beats the cutoff, as the MIP would prove; a dive's plan may miss one that does,
        # which the MIP looks for where it may run (below), as for a dive outside the gap.
        if res.message == RELAXATION_MESSAGE:
            res = scipy.optimize.OptimizeResult(x=None, fun=None, status=2,
                                                message=CUTOFF_MESSAGE)
        else:
            res, dived = None, res
    if res is None and dived is not None and not mip_follows:
        # No MIP at this size (see Work): the dive's plan, the same on any machine, unless a
        # given cutoff asks for better.
        over = (cutoff is not None and not callable(cutoff)
                and float(costs @ dived.x) > cutoff)
        res = scipy.optimize.OptimizeResult(x=None, fun=None) if over else dived
        res.status, res.message = LIMIT_STATUS, LARGE_DIVE_MESSAGE
        res.ending = SolveStatus.DIVE
    if res is None:
        cutoff = resolved()
        if dived is not None and cutoff is not None and float(costs @ dived.x) > cutoff:
            dived = None  # the cutoff asks for better
        if dived is not None:  # the MIP looks for a better plan than the dive's
            cutoff = float(costs @ dived.x)
            options.update(PROVING_OPTIONS)
        if cutoff is not None:
            options["objective_bound"] = cutoff
        options["time_limit"] = max(time_limit_s - (time.perf_counter() - start),
                                    time_limit_s * MIP_MIN_SHARE)
        res = run(integer, options)
        if res.x is None and dived is not None:
            # None better: proven (infeasible under the dive's objective), or not in time.
            dived.status, dived.message = (0, DIVE_MESSAGE) if res.status == 2 else (
                1, DIVE_UNPROVEN_MESSAGE)
            res = dived
    if res.x is not None:
        res.fun = float(c @ res.x)
    res.setdefault("ending", SolveStatus.OPTIMAL if res.status == 0 else SolveStatus.TIME_LIMIT)
    took = time.perf_counter() - start
    if run.timed_out:
        warn(f"autopar: HiGHS reached the {time_limit_s:g}s safety-net time limit before its "
             f"work limit (after {took:.1f}s): this plan may differ on a faster or less busy "
             "machine. Raise `time_limit_s` for a plan that depends only on the program.",
             SolverFallbackWarning)
    return res, took


def _nonzeros(A) -> int:
    return A.nnz if scipy.sparse.issparse(A) else int(np.count_nonzero(A))


class _Runner:
    """``run(integrality, options, bounds=None)``: scipy's milp on the ILP with those (bounds:
    the variables', when not ``0 <= x <= upper``), or for the LP relaxation (no integrality,
    the ILP's own bounds) HiGHS itself, started from the basis of an earlier LP of the same
    constraints (:func:`_relaxation`). ``timed_out``: whether a run stopped on its time limit
    (the safety net) rather than its work limits."""

    def __init__(self, costs, A, lb, ub, upper):
        self.costs, self.A, self.lb, self.ub, self.upper = costs, A, lb, ub, upper
        self.timed_out = False

    def __call__(self, integrality, options, bounds=None):
        ilp = integrality is not None and np.any(np.asarray(integrality) > 0)
        if not ilp and bounds is None:
            res = _relaxation(self, options)
            if res is not None:
                return res
        # HiGHS's simplex iteration limit also cuts each LP inside its MIP (which then
        # stalls): only a pure LP takes it; a MIP is bounded by nodes.
        options = {k: v for k, v in options.items()
                   if k != ("simplex_iteration_limit" if ilp else "node_limit")}
        with warnings.catch_warnings():
            # scipy passes HiGHS's own options (objective_bound, threads, ...) through
            # verbatim, warning that it does.
            warnings.filterwarnings("ignore", "Unrecognized options", RuntimeWarning)
            res = scipy.optimize.milp(
                self.costs, integrality=integrality,
                bounds=(scipy.optimize.Bounds(0, 1 if self.upper is None else self.upper)
                        if bounds is None else bounds),
                constraints=scipy.optimize.LinearConstraint(self.A, self.lb, self.ub),
                options=options)
        if NODE_LIMIT_MARK in (res.message or ""):
            res.status, res.message = LIMIT_STATUS, NODE_LIMIT_MESSAGE
        elif res.x is None and res.status == HIGHS_OTHER_STATUS and "threads" in options:
            return self(integrality, {k: v for k, v in options.items() if k != "threads"},
                        bounds)
        if res.status == LIMIT_STATUS and (res.message or "").startswith("Time limit"):
            self.timed_out = True
        return res


#: What :func:`_relaxation` uses of scipy's HiGHS bindings.
_BINDING_NAMES = ("_Highs", "HighsLp", "MatrixFormat", "HighsStatus", "HighsModelStatus")


def _bindings():
    """The HiGHS bindings scipy ships (``scipy.optimize._highspy._core``: the HiGHS its milp
    runs), or None where this scipy has none, or not all of :data:`_BINDING_NAMES` (a private
    module: a scipy that changes it gets its milp's LP, from scratch)."""
    try:
        from scipy.optimize._highspy import _core
    except ImportError:
        return None
    return _core if all(hasattr(_core, name) for name in _BINDING_NAMES) else None


#: Within :func:`shared_bases`: constraints key (:func:`_constraints_key`) -> the first optimal
#: basis of an LP of those constraints. The ILP around a plan and the ILP with rings charged
#: in full (``passes.solve``) change the first ILP's costs each its own way, so each starts
#: from the first's optimum, the nearest (``docs/solver_notes.md``).
_BASES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("autopar_lp_bases",
                                                                   default=None)


@contextlib.contextmanager
def shared_bases():
    """Within it, an LP relaxation whose constraints an earlier one had starts from that
    one's optimal basis (:func:`_relaxation`). Outside, each starts from scratch: a plan does
    not depend on what the process solved before."""
    token = _BASES.set({})
    try:
        yield
    finally:
        _BASES.reset(token)


def _constraints_key(A, lb, ub, upper) -> bytes:
    """A digest of an LP's constraints and bounds: two LPs of one key differ in their costs
    only, so an optimal basis of one is a basis of the other."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (A.indptr, A.indices, A.data, lb, ub,
                 np.asarray(1.0 if upper is None else upper, float), np.asarray(A.shape)):
        digest.update(np.ascontiguousarray(part).tobytes())
    return digest.digest()


def _relaxation(run: _Runner, options: dict):
    """The LP relaxation of ``run``'s ILP by HiGHS through scipy's own bindings, with the
    options scipy's milp would pass (so the same optimum: the rest of the solve is unchanged),
    started, within :func:`shared_bases`, from the optimal basis of an earlier LP of the same
    constraints and bounds where there is one: the ILP again with other costs (around the
    plan, or with the rings charged in full, ``passes.solve``) then takes far fewer simplex
    iterations (``docs/solver_notes.md``). None where scipy has no such bindings, or bindings
    of another shape (scipy's milp then solves it, from scratch)."""
    core = _bindings()
    if core is None:
        return None
    try:
        return _solved_relaxation(core, run, options)
    except (AttributeError, TypeError, ValueError):   # bindings unlike scipy 1.17's and 1.18's
        return None


def _solved_relaxation(core, run: _Runner, options: dict):
    """:func:`_relaxation` through ``core``, scipy's HiGHS bindings."""
    A = scipy.sparse.csc_matrix(run.A)
    n = A.shape[1]
    upper = np.broadcast_to(np.asarray(1.0 if run.upper is None else run.upper, float), (n,))
    lp = core.HighsLp()
    lp.num_col_, lp.num_row_ = n, A.shape[0]
    lp.col_cost_ = np.asarray(run.costs, float)
    lp.col_lower_, lp.col_upper_ = np.zeros(n), np.array(upper)
    lp.row_lower_ = np.broadcast_to(np.asarray(run.lb, float), (A.shape[0],)).copy()
    lp.row_upper_ = np.broadcast_to(np.asarray(run.ub, float), (A.shape[0],)).copy()
    lp.a_matrix_.format_ = core.MatrixFormat.kColwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, A.shape[0]
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = A.indptr, A.indices, A.data
    bases = _BASES.get()
    key = None if bases is None else _constraints_key(A, lp.row_lower_, lp.row_upper_,
                                                      run.upper)
    basis = None if bases is None else bases.get(key)
    settings = {"output_flag": bool(options.get("disp")), "presolve": "off",
                **{k: options[k] for k in ("threads", "time_limit", "simplex_iteration_limit")
                   if k in options}}
    highs = core._Highs()
    for name, value in settings.items():
        highs.setOptionValue(name, value)
    highs.passModel(lp)
    if basis is not None:
        highs.setBasis(basis)
    if highs.run() == core.HighsStatus.kError and "threads" in options:
        # the process's HiGHS thread pool has another count (see solve_milp)
        return _solved_relaxation(core, run,
                                  {k: v for k, v in options.items() if k != "threads"})
    status = highs.getModelStatus()
    if status == core.HighsModelStatus.kOptimal:
        if bases is not None:
            bases.setdefault(key, highs.getBasis())
        x = np.array(highs.getSolution().col_value)
        return scipy.optimize.OptimizeResult(x=x, fun=float(run.costs @ x), status=0,
                                             message="Optimal", nit=highs.getInfo()
                                             .simplex_iteration_count)
    if status == core.HighsModelStatus.kTimeLimit:
        run.timed_out = True
    limits = (core.HighsModelStatus.kTimeLimit, core.HighsModelStatus.kIterationLimit)
    return scipy.optimize.OptimizeResult(
        x=None, fun=None, status=LIMIT_STATUS if status in limits else
        2 if status == core.HighsModelStatus.kInfeasible else HIGHS_OTHER_STATUS,
        message=highs.modelStatusToString(status))


def note_time_limit(run) -> None:
    """Marks ``run`` (a :class:`_Runner`) as stopped by the wall clock."""
    if isinstance(run, _Runner):
        run.timed_out = True


#: The least share of a solve's time limit the MIP gets after the LP relaxation
#: (:func:`_from_relaxation`, which may take the whole limit) was fractional or did not
#: finish; so a solve takes at most 1 + MIP_MIN_SHARE times its limit.
MIP_MIN_SHARE = 0.25
#: How far from an integer an integer variable of the LP relaxation's optimum may be.
INTEGRAL_TOLERANCE = 1e-6
#: The message of a solve that took an integral LP relaxation's optimum.
RELAXATION_MESSAGE = "optimal (an integral LP relaxation)"
#: The message of a solve whose integral relaxation's optimum is over its cutoff.
CUTOFF_MESSAGE = "no plan under the cutoff (an integral LP relaxation)"
#: The message of a solve that took the plan of a dive from a fractional relaxation.
DIVE_MESSAGE = "optimal within the gap (a dive from the LP relaxation)"
#: The message of a solve that took a dive's plan the MIP found none better than in time.
DIVE_UNPROVEN_MESSAGE = "time limit (the plan of a dive from the LP relaxation)"
#: The message of a solve that took a dive's plan without the MIP (``Work.mip_max_nonzeros``),
#: or found none under a given cutoff that way.
LARGE_DIVE_MESSAGE = "the plan of a dive from the LP relaxation (no MIP at this size)"
#: HiGHS's options for a MIP after a dive's plan, which is then its cutoff: no root heuristic
#: that solves a sub-MIP (RINS, RENS, root reduced costs). These ILPs' dives find their
#: optimum or near it, and most of such a MIP's time went to those heuristics: see
#: docs/solver_notes.md.
PROVING_OPTIONS = {"mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False,
                   "mip_heuristic_run_root_reduced_cost": False}
#: The share of a solve's time limit a dive (:func:`_from_relaxation`) may take (a safety
#: net: the dive is bounded by ``Work.mip_nodes``).
DIVE_SHARE = 0.25


def _from_relaxation(run, integer, options: dict, costs, gap: float, upper=None,
                     cutoff=None):
    """The ILP's solution read from its LP relaxation, or None when the MIP must run.
    ``run(integrality, options, bounds=None)`` solves the ILP with those (bounds: the
    variables', when not the ILP's own). ``cutoff``: None, or a function giving the objective
    a dive's plan must beat (or None), asked for only when a dive runs.

    An integral optimum of the relaxation is an optimum of the ILP (the tie breaks make it the
    one the MIP returns). From a fractional one, the integer variables it left integral are
    fixed and the MIP solves the rest (a dive), in at most :data:`DIVE_SHARE` of the time limit
    and only in what the LP left of it; the dive's plan is taken when within ``gap`` of the
    relaxation's objective, a lower bound of the ILP's, as the whole MIP stopped at that gap
    would be.

    Returns (the solution, or None when the MIP must run; a dive's plan outside the gap, or
    None): the MIP then looks for a better plan than that one, which stays the answer when
    it finds none."""
    start = time.perf_counter()
    relaxed = run(np.zeros_like(integer), {
        "time_limit": options["time_limit"], "disp": options["disp"],
        "presolve": False, **{k: options[k] for k in ("threads", "simplex_iteration_limit")
                              if k in options}})
    if relaxed.x is None or relaxed.status != 0:
        return None, None
    ints = np.asarray(integer) > 0
    off = np.abs(relaxed.x - np.round(relaxed.x)) > INTEGRAL_TOLERANCE
    if not off[ints].any():
        relaxed.x[ints] = np.round(relaxed.x[ints])
        relaxed.message = RELAXATION_MESSAGE
        return relaxed, None
    left_s = min(options["time_limit"] - (time.perf_counter() - start),
                 options["time_limit"] * DIVE_SHARE)
    if left_s <= 0:  # the LP took the whole limit: the safety net fired
        note_time_limit(run)
        return None, None
    fixed = ints & ~off
    lo = np.zeros(len(costs))
    hi = np.broadcast_to(np.asarray(1.0 if upper is None else upper, float), lo.shape).copy()
    lo[fixed] = hi[fixed] = np.round(relaxed.x[fixed])
    beat = None if cutoff is None else cutoff()
    # Under a cutoff, HiGHS prunes what cannot beat it: a dive with no plan under it ends at
    # once (a tiny scanned LM on a 3-D mesh: 1.2 s, against 34 s to find a plan over it).
    dived = run(integer, {**options, "time_limit": left_s,
                          **({} if beat is None else {"objective_bound": beat})},
                scipy.optimize.Bounds(lo, hi))
    if dived.x is None:
        return None, None
    bound, objective = float(costs @ relaxed.x), float(costs @ dived.x)
    if objective - bound > gap * max(abs(objective), 1e-9):
        return None, dived
    dived.status, dived.message = 0, DIVE_MESSAGE  # within the gap, whatever stopped it
    return dived, None


#: The tie breaks' scale, a share of the largest cost (see :func:`solve_milp`): far inside the
#: solver's gap.
TIE_BREAK = 1e-7


def _tie_break(c) -> np.ndarray:
    """A cost per variable, the same in every run, small enough to choose only among plans
    the ILP's costs cannot tell apart."""
    scale = TIE_BREAK * max(1.0, float(np.abs(c).max(initial=0.0)))
    return np.random.default_rng(0).random(len(c)) * scale


def cutoff_of(objective_us: float) -> float:
    """HiGHS's cutoff for a warm start of this objective: a hair above it, so a plan as good
    (which the tie breaks may prefer) is not cut off."""
    return objective_us * (1 + 1e-6) + 1e-9


def warm_start(builder: IlpBuilder, c: np.ndarray, plans) -> tuple[np.ndarray, float] | None:
    """(point, objective) of the best of ``plans`` the ILP can take, or None."""
    points = [x for x in (builder.point(p) for p in plans) if x is not None]
    if not points:
        return None
    best = min(points, key=lambda x: float(c @ x))
    return best, float(c @ best)

