"""autopar.passes.memory_budget.peaks_over: one row per stretch of nodes a plan is over the budget
at, at the stretch's peak, highest first."""

import types

import pytest

from autopar.passes import memory_budget

MESH = types.SimpleNamespace(axis_sizes={}, results_held=True)


@pytest.fixture
def timeline(monkeypatch):
    """Replaces the plan's memory timeline (10 bytes held; live bytes per node) and makes
    every node's uncovered bytes its id, so the test reads the nodes picked."""
    def use(live):
        monkeypatch.setattr(memory_budget, "plan_timeline", lambda *a, **k: (10, tuple(live)))
        monkeypatch.setattr(memory_budget, "_uncovered",
                            lambda g, s, c, m, totals: [-t for _, t in totals])
    return use


def test_one_row_per_stretch_at_its_peak_highest_first(timeline):
    timeline([0, 5, 3, 0, 8, 9, 2, 6])  # over 14 at node 1, at nodes 4-5, and at the last
    assert memory_budget.peaks_over(None, None, None, MESH, 14, most=4) == [
        (5, -5), (7, -7), (1, -1)]


def test_at_most_the_highest_stretches(timeline):
    timeline([0, 5, 3, 0, 8, 9, 2, 6])
    assert memory_budget.peaks_over(None, None, None, MESH, 14, most=2) == [(5, -5), (7, -7)]


def test_a_plan_under_the_budget_has_no_row(timeline):
    timeline([0, 4, 3])
    assert memory_budget.peaks_over(None, None, None, MESH, 14, most=4) == []
