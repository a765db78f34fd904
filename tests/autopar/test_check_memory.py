"""autopar._check_memory: a plan that fits the budget as predicted but compiles over it is
planned again with its prediction aimed where it would compile under the budget."""

from types import SimpleNamespace

import pytest

from autopar import _check_memory
from autopar.errors import InfeasiblePlanError

MIB = 2**20


def _plan(predicted_mib: float):
    return SimpleNamespace(estimate=SimpleNamespace(peak_memory_bytes=predicted_mib * MIB),
                           stats={})


def test_a_plan_predicted_well_under_the_budget_is_replanned_under_its_prediction(monkeypatch):
    # As compiled, every plan holds 1.2x its prediction (the scanned GPT of test_memory_budget:
    # 10.1 MiB predicted, 12.2 compiled, against 12.05).
    monkeypatch.setattr(_check_memory, "compiled_peak",
                        lambda plan: plan.estimate.peak_memory_bytes * 1.2)
    targets = []

    def replan(target):
        targets.append(target)
        return _plan(target / MIB)  # the planner fills the budget it is given

    plan = _check_memory.check_compiled_memory(_plan(10.1), 12.05 * MIB, replan, lambda msg: None)
    # Aimed at the prediction that compiles under the budget: 12.05 / 1.2, less the margin.
    assert targets == [pytest.approx(12.05 / 1.2 * (1 - _check_memory.CHECK_MEMORY_MARGIN) * MIB)]
    assert plan.stats["memory_checks"][-1]["compiled_bytes"] <= 12.05 * MIB


def test_plans_that_keep_compiling_over_raise_with_every_round(monkeypatch):
    monkeypatch.setattr(_check_memory, "compiled_peak", lambda plan: 13 * MIB)
    with pytest.raises(InfeasiblePlanError, match="compiled 13.0 MiB") as info:
        _check_memory.check_compiled_memory(_plan(10.1), 12.05 * MIB,
                                            lambda target: _plan(target / MIB),
                                            lambda msg: None)
    assert len(info.value.memory_checks) == _check_memory.CHECK_MEMORY_ROUNDS + 1


@pytest.mark.parametrize("predicted_mib", [10.1, 14.0])
def test_the_error_says_the_plans_fit_as_predicted_only_where_they_did(monkeypatch,
                                                                       predicted_mib):
    monkeypatch.setattr(_check_memory, "compiled_peak", lambda plan: 15 * MIB)
    with pytest.raises(InfeasiblePlanError) as info:
        _check_memory.check_compiled_memory(_plan(predicted_mib), 12.05 * MIB,
                                            lambda target: _plan(predicted_mib),
                                            lambda msg: None)
    assert ("though they fit it as autopar predicts" in str(info.value)) == (predicted_mib < 12)
