"""Progress lines on stderr, ``[autopar   1.2s] msg``, on one clock per planning call or CLI
command (nested plans, as an exportable plan's, keep the outer clock)."""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time

#: When the outermost planning call (or CLI command) started: progress lines inside it share
#: its clock (:func:`progress_clock`).
_CLOCK: contextvars.ContextVar = contextvars.ContextVar("autopar_progress_clock", default=None)


@contextlib.contextmanager
def progress_clock():
    """Progress lines inside count seconds from here, unless an outer clock already runs (an
    exportable plan's inner plans, a CLI command's plan)."""
    token = _CLOCK.set(_CLOCK.get() if _CLOCK.get() is not None else time.perf_counter())
    try:
        yield
    finally:
        _CLOCK.reset(token)


def clock_start() -> float | None:
    """When the running clock started (``time.perf_counter``), or None outside one."""
    return _CLOCK.get()


def progress_line(msg: str, seconds: float | None = None) -> None:
    """One progress line on stderr, ``[autopar   1.2s] msg``, at ``seconds`` (default: the
    running clock's, or 0)."""
    if seconds is None:
        start = clock_start()
        seconds = 0.0 if start is None else time.perf_counter() - start
    print(f"[autopar {seconds:6.1f}s] {msg}", file=sys.stderr, flush=True)
