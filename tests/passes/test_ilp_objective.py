"""The ILP's objective is the estimate: for the plan the ILP returns, its objective
(``plan.stats["ilp_objective_s"]``) equals the estimate's step time of that plan, the makespan
of its simulated timeline where collectives overlap compute (``plan.estimate.step_time_s``),
on every sharding-benchmark workload (realistic widths, compiled from ShapeDtypeStructs;
planning only), and the ILP's own plan is the one taken."""

import pytest

import autopar
from benchmarks.sharding import mesh_axes
from benchmarks.workloads import WORKLOADS, abstract_train_step

MESHES = {"8": (8,), "2x4": (2, 4), "4x2": (4, 2), "2x2x2": (2, 2, 2)}


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("model", sorted(WORKLOADS))
def test_ilp_objective_is_the_estimated_step_time(model, mesh):
    fn, args = abstract_train_step(model)
    plan = autopar.plan(fn, *args, mesh=mesh_axes(MESHES[mesh]), hardware="h100",
                        verbose=False)
    stats = plan.stats
    assert stats["source"] == "ilp"
    assert stats["ilp_objective_s"] == pytest.approx(plan.estimate.step_time_s, rel=0.01)
    assert stats["candidates_step_s"][stats["ilp_plan"]] == plan.estimate.step_time_s
    # The makespan is what the objective prices: below the serial time by what overlaps.
    assert plan.estimate.step_time_s < stats["ilp_plan_serial_s"]
