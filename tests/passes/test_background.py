"""passes.background: work started before a solve runs in another thread, and its result or
error reaches whoever waits for it; work never started runs when its result is asked for."""

import threading

import pytest

from passes.background import Deferred


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
