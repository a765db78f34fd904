"""The ILP's objective is the estimate: for the plan the ILP returns, its objective
(``plan.stats["ilp_objective_s"]``) equals the estimate's step time of that plan, the makespan
of its simulated timeline where collectives overlap compute (``plan.estimate.step_time_s``),
on every sharding-benchmark workload (realistic widths, compiled from ShapeDtypeStructs;
planning only), and the ILP's own plan is the one taken but where :data:`SEED_WINS` says."""

import pytest

import autopar
from benchmarks.sharding import mesh_axes
from benchmarks.workloads import WORKLOADS, abstract_train_step

MESHES = {"8": (8,), "2x4": (2, 4), "4x2": (4, 2), "2x2x2": (2, 2, 2)}
#: Rows where a propagated seed's plan is predicted faster than the ILP's and is taken
#: (docs/benchmarks.md): the 3-D ResNet's data-parallel seed, predicted 1.8% faster.
SEED_WINS = {("resnet", "2x2x2")}


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("model", sorted(WORKLOADS))
def test_ilp_objective_is_the_estimated_step_time(model, mesh):
    fn, args = abstract_train_step(model)
    plan = autopar.plan(fn, *args, mesh=mesh_axes(MESHES[mesh]), hardware="h100",
                        verbose=False)
    stats = plan.stats
    own_s = stats["candidates_step_s"][stats["ilp_plan"]]   # the ILP's plan's makespan
    assert stats["ilp_objective_s"] == pytest.approx(own_s, rel=0.01)
    # The makespan is what the objective prices: below the serial time by what overlaps.
    assert own_s < stats["ilp_plan_serial_s"]
    if (model, mesh) in SEED_WINS:
        assert stats["source"] == "propagated" and plan.estimate.step_time_s < own_s
    else:
        assert stats["source"] == "ilp" and plan.estimate.step_time_s == own_s
