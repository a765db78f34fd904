"""Differences between the jax versions autopar supports (0.10.2 to 0.12), in one place."""

from __future__ import annotations


def backends_initialized() -> bool:
    """Whether jax has created its device clients, after which `XLA_FLAGS` and the platform
    choice no longer take effect."""
    from jax._src import xla_bridge
    probe = getattr(xla_bridge, "backends_are_initialized", None)
    return probe() if probe is not None else bool(getattr(xla_bridge, "_backends", None))
