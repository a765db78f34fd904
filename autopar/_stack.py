"""Planning on a roomy Python frame stack: :func:`with_roomy_stack` (on ``plan``, ``compare``
and ``validate``) runs a function below a frame so large that CPython gives it a chunk of
:data:`CHUNK_BYTES` of its frame stack, about half of it free for the frames below. Where the
interpreter does not allow such a frame, the function runs as it is.

Why: CPython frees a 16 KiB chunk of frames as soon as its first frame returns, so jax's tracing,
recursing back and forth across a chunk's end, mapped and unmapped one on each crossing, slower
or not by where the caller's depth put that end (docs/benchmarks.md, "Planning time").
"""

from __future__ import annotations

import functools
import types

#: The chunk the large frame asks CPython for; its other half holds the planning's frames.
CHUNK_BYTES = 1 << 20
# CPython sizes a new chunk by doubling from 16 KiB until it holds the frame (and a margin):
# a frame of a little more than half of CHUNK_BYTES gets a chunk of CHUNK_BYTES.
_PAD_SLOTS = CHUNK_BYTES // 2 // 8 + 512


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
    except Exception:  # noqa: BLE001 (any interpreter that refuses it: run unpadded)
        return function
    return types.FunctionType(padded, function.__globals__, function.__name__)


_roomy_call = _padded(_call)


def with_roomy_stack(fn):
    """Decorator: run ``fn`` below a frame that gives it a large chunk of the frame stack."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return _roomy_call(fn, args, kwargs)
    return wrapper
