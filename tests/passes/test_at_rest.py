"""State at rest in its update's sharding (``passes.at_rest``): a parameter whose update is
sharded finer than the parameter is kept between steps in the update's sharding when the
makespan says so, the ILP's objective still prices the plan taken, and the plan computes what
one device computes."""

import dataclasses
import warnings

import jax
import numpy as np
import pytest

import autopar
import autopar.passes.at_rest
import autopar.passes.solve
from autopar.errors import SolverFallbackWarning
from autopar.models import bert, gpt

MESH = {"data": 4, "model": 2}


def _data_split(plan) -> set[str]:
    """The parameter paths (``[0]...``) whose input sharding splits them over ``data``."""
    specs = jax.tree_util.tree_leaves(plan.in_shardings)
    return {path for path, s in zip(plan.in_paths, specs)
            if path.startswith("[0]") and any("data" in (e if isinstance(e, tuple) else (e,))
                                              for e in s.spec if e is not None)}


def _moved_and_kept(fn, args, monkeypatch):
    """(the plan with state kept in its update's sharding, the plan without the move),
    checking what every move holds: without it, new parameters are gathered after the
    update, at the step's end; with it, some are kept split over ``data`` between steps, the
    estimated makespan is shorter, and the ILP's objective is that makespan. On the ``cpu``
    profile, whose collectives run in line, nothing moves."""
    moved = autopar.plan(fn, *args, mesh=MESH, hardware="h100", verbose=False)
    in_line = autopar.plan(fn, *args, mesh=MESH, hardware="cpu", verbose=False)
    assert in_line.stats["state_at_rest"] == 0
    with monkeypatch.context() as off:
        off.setattr(autopar.passes.at_rest, "MAX_TRIED", 0)
        kept = autopar.plan(fn, *args, mesh=MESH, hardware="h100", verbose=False)
    assert kept.stats["state_at_rest"] == 0
    assert moved.stats["state_at_rest"] > 0
    assert len(_data_split(moved) - _data_split(kept)) == moved.stats["state_at_rest"]
    assert moved.estimate.step_time_s < kept.estimate.step_time_s
    assert moved.stats["ilp_objective_s"] == pytest.approx(moved.estimate.step_time_s, rel=0.01)
    return moved, kept


def test_state_kept_at_rest_lowers_the_peak_and_fits_a_budget_without_a_refit(monkeypatch):
    """The 2-layer realistic GPT on (4, 2) (planning only): its optimizer update is sharded
    over ``data`` beyond the parameters, and kept so between steps the peak is lower. Under a
    budget between the two peaks, the ILP's plan so moved fits, and is taken without a
    refit."""
    fn, args = gpt.make_train_step(dataclasses.replace(gpt.REALISTIC, layers=2), abstract=True)
    moved, kept = _moved_and_kept(fn, args, monkeypatch)
    assert moved.estimate.peak_memory_bytes < kept.estimate.peak_memory_bytes
    budget = (moved.estimate.peak_memory_bytes + kept.estimate.peak_memory_bytes) / 2
    fitted = autopar.plan(fn, *args, mesh=MESH, hardware="h100", verbose=False,
                          memory_budget=budget, remat=False, check_memory=False)
    assert fitted.stats["memory_rows"] == 0
    assert fitted.stats["state_at_rest"] == moved.stats["state_at_rest"]
    assert fitted.estimate.step_time_s == moved.estimate.step_time_s


def test_state_kept_at_rest_that_raises_the_peak_is_not_moved_under_a_budget(monkeypatch):
    """A BERT at hidden 1024 and sequence 512 on (4, 2) (planning only): its MLP-out
    kernels' optimizer update is sharded over ``data`` beyond the parameters, and kept so
    between steps the peak is higher (the shards at rest live beside the copies gathered for
    the step). Under a budget between the two peaks, the move is not made and the plan
    fits."""
    cfg = dataclasses.replace(bert.TINY, hidden=1024, seq=512, vocab=4096)
    fn, args = bert.make_train_step(cfg, abstract=True)
    moved, kept = _moved_and_kept(fn, args, monkeypatch)
    assert moved.estimate.peak_memory_bytes > kept.estimate.peak_memory_bytes
    budget = (moved.estimate.peak_memory_bytes + kept.estimate.peak_memory_bytes) / 2
    fitted = autopar.plan(fn, *args, mesh=MESH, hardware="h100", verbose=False,
                          memory_budget=budget, remat=False, check_memory=False)
    assert fitted.stats["state_at_rest"] == 0
    assert fitted.estimate.peak_memory_bytes <= budget
    assert fitted.estimate.step_time_s == kept.estimate.step_time_s


def test_a_plan_with_state_moved_matches_one_device(monkeypatch):
    """Every candidate move taken (a makespan that prefers them, and every move counted as
    exposed), on a small GPT that runs: the step's loss and new parameters and optimizer state
    are one device's."""
    original = autopar.passes.solve.rest_in_update_sharding

    def every_move(graph, strats, groups, choice, makespan, hidden):
        before = list(choice)
        return original(graph, strats, groups, choice,
                        lambda c: -sum(a != b for a, b in zip(c, before)),
                        dataclasses.replace(hidden, reshards={}))

    monkeypatch.setattr(autopar.passes.solve, "rest_in_update_sharding", every_move)
    cfg = dataclasses.replace(gpt.TINY, hidden=256, seq=256, vocab=512)
    fn, args = gpt.make_train_step(cfg)
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverFallbackWarning)
        plan = autopar.plan(fn, *args, mesh=MESH, hardware="h100", verbose=False)
    assert plan.stats["state_at_rest"] > 0
    got = jax.tree_util.tree_leaves(plan.jit()(*args))
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)
