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


def test_planning_forks_nothing_and_its_candidates_run_in_a_thread(monkeypatch):
    """The pipeline's candidate plans (passes.candidates.prepare) are made in a background
    thread, never a forked process (a child of a process with XLA's threads may inherit a
    held lock); the plan is the one made with every candidate computed when it is asked for."""
    import autopar
    from autopar.models import gpt
    from autopar.passes import candidates

    def no_fork():
        raise AssertionError("planning forked a process")

    monkeypatch.setattr(os, "fork", no_fork)
    threads = []
    made_by = candidates._propagate_and_time

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return made_by(*args)

    monkeypatch.setattr(candidates, "_propagate_and_time", recorded)
    fn, args = gpt.make_train_step(gpt.TINY)
    plans = []
    for started in (True, False):
        if not started:
            monkeypatch.setattr(Deferred, "start", lambda self: self)
        plan = autopar.plan(fn, *args, mesh={"data": 2, "model": 4})
        plans.append((plan._details[2], plan.stats["candidates_step_s"]))
    here = threading.current_thread().name
    assert threads[0] != here and threads[0].startswith("autopar-") and threads[1] == here
    assert plans[0] == plans[1] and len(plans[0][1]) > 2


def test_the_candidates_start_once_the_ilp_is_built(monkeypatch):
    """The candidate plans are propagated while HiGHS solves, not while the graph is clustered
    and the ILP built, where their thread would take the GIL from that work."""
    import autopar
    from autopar.models import mlp
    from autopar.passes import candidates
    from autopar.passes.ilp import IlpBuilder

    events = []
    build, made_by = IlpBuilder.build, candidates._propagate_and_time

    def built(self):
        out = build(self)
        events.append("built")
        return out

    def propagated(*args):
        events.append("candidates")
        return made_by(*args)

    monkeypatch.setattr(IlpBuilder, "build", built)
    monkeypatch.setattr(candidates, "_propagate_and_time", propagated)
    fn, args = mlp.make_train_step(mlp.TINY)
    autopar.plan(fn, *args, mesh={"data": 2, "model": 4})
    assert "candidates" in events and events[0] == "built"
