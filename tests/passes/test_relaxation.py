"""autopar.passes.highs.solve_milp solves the LP relaxation first: an integral optimum of it is
taken (and the warm start's cutoff is never asked for); from a fractional one, a dive (the
integral variables fixed, under the cutoff) whose plan is within the gap of it is taken; else
the MIP runs, with the cutoff. A plan over a given cutoff is never returned."""

import numpy as np
import pytest
import scipy.optimize
import scipy.sparse

from autopar.errors import SolverFallbackWarning

from autopar.passes.highs import (
    CUTOFF_MESSAGE,
    DIVE_MESSAGE,
    DIVE_UNPROVEN_MESSAGE,
    LARGE_DIVE_MESSAGE,
    PROVING_OPTIONS,
    RELAXATION_MESSAGE,
    Work,
    solve_milp,
)
from autopar.passes.solution import SolveStatus


def _ilp(capacity: float):
    """Pick x0 or x1 (binary) to maximize x0 + 2 x1 with x0 + x1 <= ``capacity``."""
    c = np.array([-1.0, -2.0])
    A = scipy.sparse.csr_matrix(np.array([[1.0, 1.0]]))
    return c, A, np.array([-np.inf]), np.array([capacity]), np.array([1, 1])


def test_an_integral_relaxation_is_the_solution_and_needs_no_cutoff():
    asked = []
    res, _ = solve_milp(*_ilp(1.0), time_limit_s=10, cutoff=lambda: asked.append(1))
    assert res.message == RELAXATION_MESSAGE and list(res.x) == [0.0, 1.0]
    assert res.fun == -2.0 and asked == [] and res.ending is SolveStatus.OPTIMAL


def test_a_fractional_relaxation_runs_the_mip_with_the_cutoff():
    asked = []

    def cutoff():
        asked.append(1)
        return -1.0  # some plan reaches -1: the MIP's optimum (-2) beats it
    # The relaxation takes x1 = 1 and x0 = 0.5 (objective -2.5); the MIP cannot.
    res, _ = solve_milp(*_ilp(1.5), time_limit_s=10, cutoff=cutoff)
    assert res.message != RELAXATION_MESSAGE and asked == [1]
    assert list(np.round(res.x)) == [0.0, 1.0] and res.fun == -2.0


def _counting_milps(monkeypatch) -> dict:
    """{"dive": [its objective_bound per run], "mip": [...]}, filled as solve_milp runs."""
    real, runs = scipy.optimize.milp, {"dive": [], "mip": []}

    def milp(c, *, integrality, bounds, constraints, options):
        if np.any(integrality):  # the MIP's bounds are scalars, the dive's per variable
            runs["mip" if np.size(bounds.ub) == 1 else "dive"].append(
                options.get("objective_bound"))
        return real(c, integrality=integrality, bounds=bounds, constraints=constraints,
                    options=options)
    monkeypatch.setattr(scipy.optimize, "milp", milp)
    return runs


def test_a_dive_within_the_gap_is_taken_without_the_mip(monkeypatch):
    runs = _counting_milps(monkeypatch)
    # The relaxation: -2.5 (x0 = 0.5). The dive fixes x1 = 1 and finds x0 = 0: -2, within
    # a 30% gap of -2.5 (not within the default 0.1%, as the test above shows). The dive
    # asks for the cutoff (none here).
    asked = []
    res, _ = solve_milp(*_ilp(1.5), time_limit_s=10, gap=0.3, cutoff=lambda: asked.append(1))
    assert res.message == DIVE_MESSAGE and list(np.round(res.x)) == [0.0, 1.0]
    assert res.fun == -2.0 and asked == [1] and res.ending is SolveStatus.OPTIMAL
    assert runs == {"dive": [None], "mip": []}


def test_a_dive_looks_under_the_cutoff_and_the_mip_follows_when_it_finds_none(monkeypatch):
    """The dive's -2 does not beat a warm start's -2.2: HiGHS prunes it under that cutoff
    (rather than finding it and dropping it after), and the MIP runs under the same cutoff."""
    runs = _counting_milps(monkeypatch)
    asked = []

    def cutoff():
        asked.append(1)
        return -2.2
    res, _ = solve_milp(*_ilp(1.5), time_limit_s=10, gap=0.3, cutoff=cutoff)
    assert res.x is None and asked == [1]  # asked for once, for the dive and the MIP
    assert runs == {"dive": [-2.2], "mip": [-2.2]}


def test_above_the_size_limit_a_dive_outside_the_gap_is_the_answer_without_the_mip(monkeypatch):
    """The dive's -2 is 25% over the relaxation's -2.5; on an ILP with more nonzeros than
    ``Work.mip_max_nonzeros`` no MIP runs (nor is the cutoff asked for): the dive's plan is
    the answer, marked unproven, whatever the clock says."""
    real, mips, asked = scipy.optimize.milp, [], []

    def milp(c, *, integrality, bounds, constraints, options):
        if np.any(integrality) and np.size(bounds.ub) == 1:  # the MIP, not the dive
            mips.append(1)
        return real(c, integrality=integrality, bounds=bounds, constraints=constraints,
                    options=options)
    monkeypatch.setattr(scipy.optimize, "milp", milp)
    res, _ = solve_milp(*_ilp(1.5), time_limit_s=10, cutoff=lambda: asked.append(1),
                        work=Work(mip_max_nonzeros=1))
    assert res.message == LARGE_DIVE_MESSAGE and res.status == 1 and res.fun == -2.0
    assert res.ending is SolveStatus.DIVE
    assert list(np.round(res.x)) == [0.0, 1.0] and mips == [] and asked == []
    res, _ = solve_milp(*_ilp(1.5), time_limit_s=10, work=Work(mip_max_nonzeros=2))
    assert res.message != LARGE_DIVE_MESSAGE and mips == [1]   # 2 nonzeros: the MIP runs
    assert res.ending is SolveStatus.OPTIMAL
    # A given cutoff the dive's -2 does not beat: no plan, rather than one over it.
    res, _ = solve_milp(*_ilp(1.5), time_limit_s=10, cutoff=-2.2, work=Work(mip_max_nonzeros=1))
    assert res.x is None and res.message == LARGE_DIVE_MESSAGE and mips == [1]
    # The same with the dive's plan within the gap (30%): still no MIP at this size (it ran,
    # unbounded by any work limit at its root, until 2026-11-30).
    res, _ = solve_milp(*_ilp(1.5), time_limit_s=10, gap=0.3, cutoff=-2.2,
                        work=Work(mip_max_nonzeros=1))
    assert res.x is None and res.message == LARGE_DIVE_MESSAGE and mips == [1]
    assert res.ending is SolveStatus.DIVE


def test_no_plan_over_a_given_cutoff_is_returned():
    # Integral relaxation, optimum -2, asked to beat -3: no plan does.
    res, _ = solve_milp(*_ilp(1.0), time_limit_s=10, cutoff=-3.0)
    assert res.x is None and res.status == 2 and res.message == CUTOFF_MESSAGE
    # A dive's -2 does not beat -2.2 either, but proves nothing: the MIP runs and finds none.
    res, _ = solve_milp(*_ilp(1.5), time_limit_s=10, gap=0.3, cutoff=-2.2)
    assert res.x is None and res.message not in (DIVE_MESSAGE, CUTOFF_MESSAGE)


def test_a_dive_outside_the_gap_stays_the_answer_when_the_mip_finds_none_better(monkeypatch):
    """The dive's -2 is 25% over the relaxation's -2.5, outside the 0.1% gap: the MIP looks for
    a better plan, under the dive's objective and without sub-MIP heuristics. Here it finds
    none in its time (made so), and the dive's plan is the answer, not proven optimal."""
    real = scipy.optimize.milp
    bounds_of_mips = []

    def milp(c, *, integrality, bounds, constraints, options):
        if np.any(integrality) and np.size(bounds.ub) == 1:  # the MIP, not the dive
            bounds_of_mips.append(options.get("objective_bound"))
            assert options.items() >= PROVING_OPTIONS.items()  # no sub-MIP heuristics
            return scipy.optimize.OptimizeResult(x=None, fun=None, status=1,
                                                 message="Time limit reached")
        return real(c, integrality=integrality, bounds=bounds, constraints=constraints,
                    options=options)
    monkeypatch.setattr(scipy.optimize, "milp", milp)
    with pytest.warns(SolverFallbackWarning, match="safety-net time limit"):
        res, _ = solve_milp(*_ilp(1.5), time_limit_s=10)
    assert list(np.round(res.x)) == [0.0, 1.0] and res.fun == -2.0
    assert res.status == 1 and res.message == DIVE_UNPROVEN_MESSAGE
    assert res.ending is SolveStatus.TIME_LIMIT
    assert bounds_of_mips == [pytest.approx(-2.0, abs=1e-5)]  # the dive's objective


def test_no_dive_once_the_lp_took_the_whole_limit():
    """A solve stays within 1 + MIP_MIN_SHARE times its limit: a fractional relaxation that
    took the whole limit goes straight to the MIP, without a dive."""
    import time

    from autopar.passes.highs import _from_relaxation
    calls = []

    def run(integrality, options, bounds=None):
        calls.append(bounds)
        time.sleep(0.05)  # the LP takes the whole (0.01 s) limit
        return scipy.optimize.OptimizeResult(x=np.array([0.5, 1.0]), status=0, message="")
    res, dived = _from_relaxation(run, np.array([1, 1]), {"time_limit": 0.01, "disp": False},
                                  np.array([-1.0, -2.0]), 1e-3)
    assert res is None and dived is None and calls == [None]


def _transport_lp(costs):
    """A 12 x 12 transport LP (each row and column sums to 1) with these costs."""
    n = 12
    rows = [[1.0 if k // n == i else 0.0 for k in range(n * n)] for i in range(n)]
    rows += [[1.0 if k % n == j else 0.0 for k in range(n * n)] for j in range(n)]
    A = scipy.sparse.csr_matrix(np.array(rows))
    return costs, A, np.ones(2 * n), np.ones(2 * n)


def test_an_lp_of_the_same_constraints_starts_from_the_optimum_of_the_first(monkeypatch):
    """Within one solve (``highs.shared_bases``), the LP relaxation of an ILP whose constraints
    an earlier one had (the ILP around a plan, or with rings charged in full: other costs)
    starts from that one's optimal basis: fewer simplex iterations to the optimum scipy's milp
    finds from scratch. Outside, or where scipy has no HiGHS bindings, it starts from
    scratch."""
    from autopar.passes import highs
    rng = np.random.default_rng(0)
    first = rng.random(144)
    second = first.copy()   # some of its moves credited, as around a plan
    second[rng.choice(144, 6, replace=False)] *= 0.2
    options = {"time_limit": 10.0, "disp": False, "presolve": False, "threads": 1}

    def lp(costs):
        c, A, lb, ub = _transport_lp(costs)
        return highs._Runner(c, A, lb, ub, None)(np.zeros(144), options)
    with highs.shared_bases():
        lp(first)
        warm = lp(second)
    lp(first)
    cold = lp(second)   # outside: nothing kept from the solves before
    assert 0 < warm.nit < cold.nit
    c, A, lb, ub = _transport_lp(second)
    plain = scipy.optimize.milp(c, integrality=np.zeros(144), bounds=scipy.optimize.Bounds(0, 1),
                                constraints=scipy.optimize.LinearConstraint(A, lb, ub),
                                options={"presolve": False})
    np.testing.assert_allclose(warm.x, plain.x, atol=1e-9)
    np.testing.assert_allclose(cold.x, plain.x, atol=1e-9)
    monkeypatch.setattr(highs, "_bindings", lambda: None)
    with highs.shared_bases():
        fallback = lp(second)
    np.testing.assert_allclose(fallback.x, plain.x, atol=1e-9)
    monkeypatch.setattr(highs, "_bindings", lambda: object())   # bindings of another shape
    with highs.shared_bases():
        fallback = lp(second)
    np.testing.assert_allclose(fallback.x, plain.x, atol=1e-9)
