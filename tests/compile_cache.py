"""A persistent compilation cache for one test process or subprocess: a directory of its
own, since jax locks the cache's files only with ``filelock``, which is not a dependency here."""

from __future__ import annotations

from pathlib import Path


def cache_settings(directory: str | Path) -> dict[str, object]:
    """jax config options that cache every program a process compiles in ``directory``."""
    return {"jax_compilation_cache_dir": str(directory),
            "jax_persistent_cache_min_compile_time_secs": 0,
            "jax_persistent_cache_min_entry_size_bytes": -1}


def cache_env(directory: str | Path) -> dict[str, str]:
    """:func:`cache_settings` as the environment variables a jax subprocess reads."""
    return {name.upper(): str(value) for name, value in cache_settings(directory).items()}
