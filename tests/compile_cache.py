"""A persistent compilation cache for a test's subprocess (``tests/conftest.py`` gives each
test process one): a directory of its own, since jax locks the cache's files only with
``filelock``, which is not a dependency here."""

from __future__ import annotations

from pathlib import Path


def cache_env(directory: str | Path) -> dict[str, str]:
    """Environment variables that make a jax process cache every program it compiles in
    ``directory``."""
    return {"JAX_COMPILATION_CACHE_DIR": str(directory),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
