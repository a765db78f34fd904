"""Planning work run beside the main line: in a thread while HiGHS solves, or in a forked
process.

HiGHS releases the GIL while it solves (scipy's ``_highspy``; measured on this machine: a
3.1 s solve in one thread and 0.21 s of pure Python in another took 3.1 s together, the Python
part 0.24 s). So work the solve does not need, the memory analyses the budget refit reads, is
started in a background thread just before the solve and uses the second core while the solve
runs. Only the solve runs with the GIL released, so a thread helps only work that is started
right before one.

Pure Python work that would hold the GIL for seconds runs in a forked child process instead
(:func:`in_child_process`): the propagated candidate plans and their step times, 3.2 s on the
unrolled 96-layer GPT, while the planning process clusters the graph and solves the ILP
(``passes.pipeline``). The child inherits the graph by ``fork`` (copy-on-write, no
pickling) and sends back only its result. It never calls into XLA, so the threads XLA keeps
in the parent (the reason jax warns that fork may deadlock) hold nothing it needs; it leaves
by ``os._exit``, running no finalizer. Where ``fork`` is missing or unsafe (Windows, macOS) or
``AUTOPAR_NO_FORK`` is set, the work runs in the planning process when its result is asked
for, as it does when a child dies.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import warnings
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


def can_fork() -> bool:
    """Whether :func:`in_child_process` may fork: on Linux, unless ``AUTOPAR_NO_FORK`` is set."""
    return sys.platform.startswith("linux") and not os.environ.get("AUTOPAR_NO_FORK")


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class ChildDied(RuntimeError):
    """A child process of :func:`in_child_process` ended without sending a result."""


def in_child_process(fn, *args, **kwargs) -> Future:
    """Start ``fn(*args, **kwargs)`` in a forked child process (see the module docstring; only
    where :func:`can_fork`). Its result must pickle. The returned future holds the result,
    the exception ``fn`` raised, or :class:`ChildDied` when the child was killed; a daemon
    thread reads the child's answer and reaps it."""
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        # jax's warning (and CPython's, from 3.12) that fork and threads do not mix: see the
        # module docstring for why the child is safe.
        warnings.simplefilter("ignore")
        pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            try:
                answer = pickle.dumps((True, fn(*args, **kwargs)), pickle.HIGHEST_PROTOCOL)
            except BaseException as e:  # noqa: BLE001 (sent to whoever waits on it)
                try:
                    answer = pickle.dumps((False, e), pickle.HIGHEST_PROTOCOL)
                except Exception:  # noqa: BLE001 (an error that does not pickle, as text)
                    answer = pickle.dumps((False, RuntimeError(repr(e))))
            with os.fdopen(write_fd, "wb") as out:
                out.write(answer)
        finally:
            os._exit(0)
    os.close(write_fd)
    future: Future = Future()
    future.set_running_or_notify_cancel()

    def collect():
        with os.fdopen(read_fd, "rb") as answer:
            data = answer.read()
        _, status = os.waitpid(pid, 0)
        try:
            ok, value = pickle.loads(data)
        except Exception:  # noqa: BLE001 (nothing, or a cut-off answer: the child was killed)
            future.set_exception(ChildDied(
                f"autopar: the child process computing {fn.__name__} ended without a result "
                f"(wait status {status})"))
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    threading.Thread(target=collect, name=f"autopar-{fn.__name__}", daemon=True).start()
    return future


class Deferred:
    """``fn(*args, **kwargs)``, started in the background by :meth:`start`, or run here by
    :meth:`result` if it was never started. ``process``: start it in a forked child process
    (:func:`in_child_process`) rather than a thread; where that cannot be, :meth:`start` does
    nothing, and where the child died, :meth:`result` runs it here."""

    def __init__(self, fn, *args, process: bool = False, **kwargs):
        self._call = (fn, args, kwargs)
        self._process = process
        self._future: Future | None = None
        self._lock = threading.Lock()  # one run here, when several threads ask for it

    def start(self) -> Deferred:
        if self._future is None:
            fn, args, kwargs = self._call
            if not self._process:
                self._future = in_background(fn, *args, **kwargs)
            elif can_fork():
                self._future = in_child_process(fn, *args, **kwargs)
        return self

    def result(self):
        with self._lock:
            if self._future is None:
                self._future = self._here()
        try:
            return self._future.result()
        except ChildDied:
            with self._lock:
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
