"""Planning work run beside the main line, in a thread.

HiGHS releases the GIL while it solves (scipy's ``_highspy``), so Python work started just
before a solve runs while HiGHS does: the memory analyses the budget refit reads
(``passes.solve``). Outside the solves a thread shares the GIL with the planning process's own
Python work, so only work that is needed is started. A :class:`Deferred` never started runs
when its result is first asked for (the candidate plans, ``passes.candidates``). Nothing is
forked: a process with jax loaded keeps XLA's threads, and a forked child may inherit a lock
one of them holds.
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
    """``fn(*args, **kwargs)``, started in a background thread by :meth:`start`, or run here
    by :meth:`result` if it was never started. ``fn`` must only read what the planning
    process may still be reading or writing meanwhile (the graph, its strategies)."""

    def __init__(self, fn, *args, **kwargs):
        self._call = (fn, args, kwargs)
        self._future: Future | None = None
        self._lock = threading.Lock()  # one run here, when several threads ask for it

    def start(self) -> Deferred:
        with self._lock:
            if self._future is None:
                fn, args, kwargs = self._call
                self._future = in_background(fn, *args, **kwargs)
        return self

    def result(self):
        with self._lock:
            if self._future is None:
                self._future = self._here()
        return self._future.result()

    def _here(self) -> Future:
        """A future of the call run here and now."""
        fn, args, kwargs = self._call
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 (raised by result(), as a thread's is)
            future.set_exception(e)
        return future
