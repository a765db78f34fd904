"""autopar.passes.background: work started before a solve runs in another thread, and work started
in a child process runs there; its result or error reaches whoever waits for it; work never
started, or whose child died, runs when its result is asked for."""

import os
import threading

import pytest

from autopar.passes.background import Deferred, can_fork


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


def _pid_and(x):
    return os.getpid(), x


def _fail_in_child():
    raise KeyError("seed")


def _die_unless_in(pid):
    if os.getpid() != pid:
        os._exit(3)
    return "here"


@pytest.mark.skipif(not can_fork(), reason="fork is used on Linux only (see can_fork)")
def test_process_work_runs_in_a_child_and_its_result_or_error_comes_back():
    job = Deferred(_pid_and, [1, 2], process=True).start()
    pid, value = job.result()
    assert pid != os.getpid() and value == [1, 2]
    with pytest.raises(KeyError, match="seed"):
        Deferred(_fail_in_child, process=True).start().result()


@pytest.mark.skipif(not can_fork(), reason="fork is used on Linux only (see can_fork)")
def test_work_of_a_child_that_died_runs_here():
    job = Deferred(_die_unless_in, os.getpid(), process=True).start()
    assert job.result() == "here"


def test_process_work_runs_here_where_forking_is_off(monkeypatch):
    monkeypatch.setenv("AUTOPAR_NO_FORK", "1")
    assert not can_fork()
    assert Deferred(_pid_and, 5, process=True).start().result() == (os.getpid(), 5)


def test_a_plan_is_the_same_with_its_candidates_made_in_a_child_or_here(monkeypatch):
    """The pipeline's candidate plans (passes.candidates.start) come from a child process
    where it can fork, from the planning process where it cannot: the same plans either way."""
    import autopar
    from autopar.models import gpt

    fn, args = gpt.make_train_step(gpt.TINY)
    plans = []
    for no_fork in ("", "1"):
        monkeypatch.setenv("AUTOPAR_NO_FORK", no_fork)
        plan = autopar.plan(fn, *args, mesh={"data": 2, "model": 4})
        plans.append((plan._details[2], plan.stats["candidates_step_s"]))
    assert plans[0] == plans[1] and len(plans[0][1]) > 2
