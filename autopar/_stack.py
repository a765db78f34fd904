"""Planning on a roomy Python frame stack.

CPython (3.11 and later) keeps its frames in chunks of 16 KiB, and frees a chunk as soon as the
first frame in it returns. A deep call that goes back and forth across a chunk's end, as jax's
tracing of a model does, maps and unmaps a chunk on each crossing. Where the ends fall depends on
how deep the caller is, so the same trace could take up to 60% longer from one caller than from
another. :func:`with_roomy_stack` calls through a frame so large that CPython gives it a chunk of
:data:`CHUNK_BYTES` with about half of it free: the planning below it fits in that room, and no
chunk is made or freed while it runs. Where the interpreter does not allow the frame (another
implementation), the call runs as it is.
"""

from __future__ import annotations

import functools
import types

#: The chunk the large frame asks CPython for; its other half holds the planning's frames.
CHUNK_BYTES = 1 << 20
# CPython makes a chunk hold a frame and 1000 more pointers, doubling from 16 KiB: a frame of
# more than half the chunk, less that margin, gets a chunk of CHUNK_BYTES.
_PAD_SLOTS = (CHUNK_BYTES // 2) // 8 - 1000 + 64


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


def _padded(function: types.FunctionType) -> types.FunctionType:
    """``function`` with :data:`_PAD_SLOTS` more (unused) local variables; ``function`` itself
    when the interpreter's code objects do not take them."""
    code = function.__code__
    try:
        padded = code.replace(
            co_varnames=code.co_varnames + tuple(f"_slot{i}" for i in range(_PAD_SLOTS)),
            co_nlocals=code.co_nlocals + _PAD_SLOTS)
    except (TypeError, ValueError):
        return function
    return types.FunctionType(padded, function.__globals__, function.__name__)


_roomy_call = _padded(_call)


def with_roomy_stack(fn):
    """Decorator: run ``fn`` below a frame that gives it a large chunk of the frame stack."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return _roomy_call(fn, args, kwargs)
    return wrapper
