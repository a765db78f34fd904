"""Differences between the jax versions autopar supports (0.10.2 to 0.12), in one place."""

from __future__ import annotations


def backends_initialized() -> bool:
    """Whether jax has created its device clients, after which `XLA_FLAGS` and the platform
    choice no longer take effect."""
    from jax._src import xla_bridge
    probe = getattr(xla_bridge, "backends_are_initialized", None)
    return probe() if probe is not None else bool(getattr(xla_bridge, "_backends", None))


def trace_context_state(name: str, doc: str):
    """A context manager factory ``state(value)`` whose value is part of jax's trace cache key
    (so jit and make_jaxpr trace again when it changes); a no-op where jax lacks the hook."""
    import contextlib

    from jax._src import config as jax_config
    make = getattr(jax_config, "string_or_object_state", None)
    if make is None:
        return lambda value: contextlib.nullcontext()
    try:
        return make(name, None, doc, include_in_trace_context=True)
    except TypeError:  # the keyword changed
        return lambda value: contextlib.nullcontext()
