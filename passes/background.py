"""Python work done while HiGHS solves.

HiGHS releases the GIL while it solves (scipy's ``_highspy``; measured on this machine: a
3.1 s solve in one thread and 0.21 s of pure Python in another took 3.1 s together, the Python
part 0.24 s). So work the solve does not need is started in a background thread just before
the solve, and uses the second core while the solve runs: the propagated plans' step times and
the memory analyses the budget refit reads (on the unrolled 96-layer GPT about 1.4 s of Python
that used to follow the solve's 2 s). Only the solve runs with the GIL released, so this helps
only work that is started right before one.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future


def in_background(fn, *args, **kwargs) -> Future:
    """Start ``fn(*args, **kwargs)`` in a daemon thread (an interrupted planning process does
    not wait for it at exit); its result, or the exception it raised, comes through the
    returned future's ``result()``."""
    future: Future = Future()
    future.set_running_or_notify_cancel()

    def run():
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=run, name=f"autopar-{fn.__name__}", daemon=True).start()
    return future


class Deferred:
    """``fn(*args, **kwargs)``, started in the background by :meth:`start` (right before a
    solve), or run here by :meth:`result` if it was never started."""

    def __init__(self, fn, *args, **kwargs):
        self._call = (fn, args, kwargs)
        self._future: Future | None = None

    def start(self) -> None:
        if self._future is None:
            fn, args, kwargs = self._call
            self._future = in_background(fn, *args, **kwargs)

    def result(self):
        if self._future is None:
            fn, args, kwargs = self._call
            return fn(*args, **kwargs)
        return self._future.result()
