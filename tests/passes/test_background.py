"""autopar.passes.background: work started before a solve runs in another thread; its result or
error reaches whoever waits for it; work never started runs when its result is asked for."""

import os
import threading

import pytest

from autopar.passes.background import Deferred


def _where(x):
    return threading.current_thread().name, x


def test_started_work_runs_in_another_thread_and_unstarted_work_runs_here():
    started = Deferred(_where, 1)
    started.start()
    started.start()  # once only
    assert started.result() == ("autopar-_where", 1)
    assert Deferred(_where, 2).result() == (threading.current_thread().name, 2)


def test_an_error_in_the_background_is_raised_to_the_caller():
    def fail():
        raise ValueError("bad rows")
    job = Deferred(fail)
    job.start()
    with pytest.raises(ValueError, match="bad rows"):
        job.result()


def test_planning_forks_nothing_and_its_budget_rows_run_in_a_thread(monkeypatch):
    """The memory budget's rows (passes.memory_budget.BudgetRows) are made in a background
    thread while HiGHS solves, never in a forked process (a child of a process with XLA's
    threads may inherit a held lock); the plan is the one made with the rows made when they
    are asked for."""
    import autopar
    from autopar.models import gpt
    from autopar.passes import solve

    def no_fork():
        raise AssertionError("planning forked a process")

    monkeypatch.setattr(os, "fork", no_fork)
    threads = []
    rows_of = solve.BudgetRows

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return rows_of(*args)

    monkeypatch.setattr(solve, "BudgetRows", recorded)
    fn, args = gpt.make_train_step(gpt.TINY)
    plans = []
    for started in (True, False):
        if not started:
            monkeypatch.setattr(Deferred, "start", lambda self: self)
        plan = autopar.plan(fn, *args, mesh={"data": 2, "model": 4}, memory_budget=2**30)
        plans.append((plan._details[2], plan.stats["candidates_step_s"]))
    here = threading.current_thread().name
    assert threads[0] != here and threads[0].startswith("autopar-") and threads[1] == here
    assert plans[0] == plans[1]
