"""The ILP starts from the propagated plans: their best objective is HiGHS's cutoff, and when
the solver finds nothing better in its time limit, that plan is the solution."""

import numpy as np
import pytest

from autopar.models import gpt
from autopar.passes.cluster import cluster
from autopar.passes.candidates import propagated_plans
from autopar.errors import SolverFallbackWarning
from autopar.passes.ilp import IlpBuilder
from autopar.passes.solution import SolveStatus
from autopar.passes.solve import solve
from autopar.cost_model.spec import Spec
from tests.passes.test_propagate import _setup


def _candidates():
    """The TINY GPT step on (2, 4), its ILP groups, and the plan propagated from the batch
    split over `data` (data parallelism)."""
    fn, args = gpt.make_train_step(gpt.TINY, abstract=True)
    _, graph, strats, mesh, _ = _setup(fn, args)
    groups = cluster(graph, strats, mesh)
    batch = {n: Spec((("data",),) + ((),) * (graph.values[graph.nodes[n].outs[0]].rank - 1))
             for n in graph.input_nodes[-2:]}
    return graph, strats, mesh, groups, propagated_plans(graph, strats, mesh, {}, (),
                                                         {"x": batch})


def test_a_propagated_plan_is_a_point_of_the_ilp():
    graph, strats, mesh, groups, plans = _candidates()
    builder = IlpBuilder(graph, strats, groups, mesh).build()
    c, A, lb, ub, _ = builder.matrices()
    x = builder.point(plans["propagated (x)"])
    assert x is not None
    assert np.all(A @ x >= lb - 1e-9) and np.all(A @ x <= ub + 1e-9)  # feasible
    best = solve(graph, strats, groups, mesh)
    assert best.objective_us <= c @ x + 1e-6


# The time limit (1e-6 s) is the safety net firing, which warns too.
@pytest.mark.filterwarnings("ignore:autopar. HiGHS reached:autopar.errors.SolverFallbackWarning")
def test_nothing_better_in_time_keeps_the_warm_start():
    graph, strats, mesh, groups, plans = _candidates()
    start = plans["propagated (x)"]
    with pytest.warns(SolverFallbackWarning, match="no plan better than the propagated"):
        tiny = solve(graph, strats, groups, mesh, time_limit_s=1e-6, warm=[start])
    assert tiny.status is SolveStatus.WARM_START
    assert np.isfinite(tiny.objective_us)
    full = solve(graph, strats, groups, mesh, warm=[start])
    assert full.status is SolveStatus.OPTIMAL and full.objective_us <= tiny.objective_us + 1e-6
