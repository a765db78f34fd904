"""``estimate.hidden_comm`` and the ILP built around a plan: the waits of a plan's timeline are
blamed on its collectives so that the hidden parts add up to its serial time less its makespan,
and the ILP around a plan prices that plan at its makespan."""

import numpy as np
import pytest

from autopar.passes import estimate
from autopar.passes.candidates import propagated_plans
from autopar.passes.cluster import cluster
from autopar.passes.ilp import IlpBuilder
from autopar.passes.solve import solve
from autopar.cost_model.spec import Spec
from benchmarks.workloads import abstract_train_step
from tests.passes.test_propagate import _setup


@pytest.fixture(scope="module")
def plans():
    """The GPT step of the sharding benchmark (realistic widths, abstract) on (2, 4), its ILP
    groups, and plans of several kinds: the ILP's, and those propagated from the batch over
    `data` and from each input split the most."""
    fn, args = abstract_train_step("gpt")
    _, graph, strats, mesh, _ = _setup(fn, args)
    groups = cluster(graph, strats, mesh)
    batch = {n: Spec((("data",),) + ((),) * (graph.values[graph.nodes[n].outs[0]].rank - 1))
             for n in graph.input_nodes[-2:]}
    most = {n: max((s.out_specs[0] for s in strats[n]), key=lambda sp: len(sp.axes))
            for n in graph.input_nodes}
    found = propagated_plans(graph, strats, mesh, {}, (), {"dp": batch, "fsdp": most})
    found["ilp"] = solve(graph, strats, groups, mesh).choice
    return graph, strats, mesh, groups, found


def _priced(graph, strats, mesh, choice):
    comms = estimate.plan_collectives(graph, strats, choice, mesh)
    serial = sum(c.time_s * c.trips for c in comms)
    makespan, exposed = estimate.plan_makespan(graph, strats, choice, mesh)
    return serial, makespan, exposed


def test_hidden_parts_add_up_to_what_overlaps(plans):
    graph, strats, mesh, _, found = plans
    overlapping = 0
    for name, choice in found.items():
        serial, _, exposed = _priced(graph, strats, mesh, choice)
        hidden = estimate.hidden_comm(graph, strats, choice, mesh)
        parts = [*hidden.reductions.values(), *hidden.latencies.values(),
                 *hidden.reshards.values()]
        assert all(p >= -1e-15 for p in parts), name
        assert sum(parts) == pytest.approx(serial - exposed, rel=1e-9, abs=1e-15), name
        for key, part in hidden.reshards.items():
            assert part <= hidden.reshard_totals[key] * (1 + 1e-9)
        overlapping += sum(parts) > 0.01 * serial
    assert overlapping, "some plan hides some of its communication"


def test_the_ilp_around_a_plan_prices_its_makespan(plans):
    """Wherever the ILP prices a plan's serial time exactly, the ILP around that plan prices
    its makespan exactly."""
    graph, strats, mesh, groups, found = plans
    exact = 0
    for name, choice in found.items():
        serial, makespan, _ = _priced(graph, strats, mesh, choice)
        compute = sum(strats[n.id][choice[n.id]].compute_s * n.trip_count for n in graph.nodes)
        full = IlpBuilder(graph, strats, groups, mesh).build()
        around = IlpBuilder(graph, strats, groups, mesh, like=full,
                            hidden=estimate.hidden_comm(graph, strats, choice, mesh)).build()
        x = full.point(choice)
        if x is None or full.matrices()[0] @ x / 1e6 != pytest.approx(compute + serial,
                                                                       rel=1e-4):
            continue
        assert around.matrices()[0] @ around.point(choice) / 1e6 == pytest.approx(
            makespan, rel=1e-4), name
        exact += makespan < (compute + serial) * 0.99
    assert exact, "some plan the ILP prices exactly overlaps some of its communication"


def test_the_solve_prices_its_plans_makespan(plans):
    graph, strats, mesh, groups, _ = plans
    solution = solve(graph, strats, groups, mesh)
    _, makespan, _ = _priced(graph, strats, mesh, solution.choice)
    assert solution.objective_us / 1e6 == pytest.approx(makespan, rel=0.01)


def test_kept_makespans_are_the_plans_own(plans):
    graph, strats, mesh, _, found = plans
    for name, choice in found.items():
        direct = estimate._simulate(graph, strats, choice, mesh,
                                    estimate._collectives(graph, strats, choice, mesh))
        end, busy, _ = direct
        assert estimate.plan_makespan(graph, strats, choice, mesh) == (end, end - busy), name
    copied = [list(s) for s in strats]   # same contents, another owner: not served the kept
    choice = found["ilp"]
    kept = estimate._kept_simulation(graph, strats, choice, mesh)
    assert estimate._kept_simulation(graph, copied, choice, mesh) is not kept
    assert estimate._kept_simulation(graph, strats, choice, mesh) is kept


def test_the_ilp_around_a_plan_has_the_constraints_of_the_first(plans):
    """Around a plan only the costs change (less what it hides), not the variables or rows,
    even where a move is hidden whole: so the LP around it starts from the first LP's optimal
    basis (``passes.highs``)."""
    graph, strats, mesh, groups, found = plans
    full = IlpBuilder(graph, strats, groups, mesh).build()
    c, A, lb, ub, integer = full.matrices()
    changed = 0
    for name, choice in found.items():
        around = IlpBuilder(graph, strats, groups, mesh, like=full,
                            hidden=estimate.hidden_comm(graph, strats, choice, mesh)).build()
        c2, A2, lb2, ub2, integer2 = around.matrices()
        assert A2.shape == A.shape and (A2 != A).nnz == 0, name
        assert np.array_equal(lb2, lb) and np.array_equal(ub2, ub), name
        assert np.array_equal(integer2, integer), name
        changed += not np.array_equal(c2, c)
    assert changed, "some plan hides something, which the costs around it credit"
