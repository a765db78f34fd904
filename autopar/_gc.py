"""Planning with Python's cyclic garbage collector paused.

Planning a deep model makes millions of small objects that live until the plan is made (jaxpr
equations, graph nodes and values, strategies, memo entries). Each time enough of them pile up,
the collector walks every object the process holds, and that work grows with the model: on a
96-layer GPT train step (``benchmarks/planning_time.py``) it was a third of the planning time
(25 s with it, 17 s without; the peak resident memory was the same, 0.88 GB). Reference
counting still frees everything that is not in a cycle; the cycles made while planning are
collected once the collector runs again after it.

The objects made while it was paused are handed to the oldest generation when it resumes
(``gc.freeze`` then ``gc.unfreeze``, which moves them without a scan). Left in the youngest,
the first allocation after the pause starts a collection that walks all of them: on the
96-layer GPT it added 0.45 s to the planning time. In the oldest generation they are walked at
the collector's next full collection, as the objects that survive a program's start are.
Where the program froze objects itself (more frozen than when autopar was imported: Python
3.12 starts with some of its own), they are left frozen, and the hand-over is skipped.
"""

from __future__ import annotations

import contextlib
import functools
import gc

# Objects frozen before autopar was imported: the interpreter's own (Python 3.12 freezes some
# at start) or a program's, which the hand-over moves to the oldest generation with the rest.
_FROZEN_AT_IMPORT = gc.get_freeze_count()


@contextlib.contextmanager
def paused_gc():
    """Pause the cyclic collector for the block; restore it as it was (also on an error)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            # (see the module docstring) Not "==": the hand-over unfreezes the interpreter's
            # own frozen objects too, and frozen objects that are freed leave the count.
            if gc.get_freeze_count() <= _FROZEN_AT_IMPORT:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def with_gc_paused(fn):
    """Decorator: run ``fn`` under :func:`paused_gc`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with paused_gc():
            return fn(*args, **kwargs)
    return wrapper
