"""Planning with Python's cyclic garbage collector paused.

Planning a deep model makes millions of small objects that live until the plan is made (jaxpr
equations, graph nodes and values, strategies, memo entries). Each time enough of them pile up,
the collector walks every object the process holds, and that work grows with the model: on a
96-layer GPT train step (``benchmarks/planning_time.py``) it was a third of the planning time
(25 s with it, 17 s without; the peak resident memory was the same, 0.88 GB). Reference
counting still frees everything that is not in a cycle; the cycles made while planning are
collected once the collector runs again after it.
"""

from __future__ import annotations

import contextlib
import functools
import gc


@contextlib.contextmanager
def paused_gc():
    """Pause the cyclic collector for the block; restore it as it was (also on an error)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def with_gc_paused(fn):
    """Decorator: run ``fn`` under :func:`paused_gc`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with paused_gc():
            return fn(*args, **kwargs)
    return wrapper
