"""Differences between the jax versions autopar supports (0.10.2 to 0.12), in one place."""

from __future__ import annotations

import contextlib
import importlib
import itertools

# Primitives jax exports nowhere public, by attribute, with the modules that have held them.
_PRIVATE_PRIMITIVES = {
    "reshard_p": ("jax._src.pjit",),
    "random_wrap_p": ("jax._src.prng", "jax._src.random.prng"),
    "random_unwrap_p": ("jax._src.prng", "jax._src.random.prng"),
    "random_clone_p": ("jax._src.random.core", "jax._src.prng"),
    "custom_vjp_call_jaxpr_p": ("jax._src.custom_derivatives",),
    "shard_map_p": ("jax._src.shard_map", "jax.experimental.shard_map"),
}


def backends_initialized() -> bool:
    """Whether jax has created its device clients, after which `XLA_FLAGS` and the platform
    choice no longer take effect."""
    from jax._src import xla_bridge
    probe = getattr(xla_bridge, "backends_are_initialized", None)
    return probe() if probe is not None else bool(getattr(xla_bridge, "_backends", None))


def primitive(attr: str):
    """The jax ``Primitive`` named ``attr`` (``"add_p"``) in ``jax.lax``, in
    ``jax.extend.core.primitives`` or, for those with no public home, in jax's private module;
    None where this jax version has none (``one_minus_square_p`` and ``unstack_p`` are newer than
    some versions, ``custom_vjp_call_jaxpr_p`` older)."""
    import jax.lax
    from jax.extend.core import primitives
    for module in (jax.lax, primitives):
        if getattr(module, attr, None) is not None:
            return getattr(module, attr)
    for name in _PRIVATE_PRIMITIVES.get(attr, ()):
        try:
            found = getattr(importlib.import_module(name), attr, None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


def primitives(*attrs: str) -> tuple:
    """:func:`primitive` of each of ``attrs`` that this jax version has."""
    found = (primitive(attr) for attr in attrs)
    return tuple(p for p in found if p is not None)


def trace_context_state(name: str, doc: str):
    """A context manager factory ``state(value)`` whose value is part of jax's trace cache key
    (so jit and make_jaxpr trace again when it changes); a no-op where jax lacks the hook."""
    from jax._src import config as jax_config
    make = getattr(jax_config, "string_or_object_state", None)
    if make is None:
        return lambda value: contextlib.nullcontext()
    try:
        return make(name, None, doc, include_in_trace_context=True)
    except TypeError:  # the keyword changed
        return lambda value: contextlib.nullcontext()


def equation_context(eqn):
    """A context in which binding ``eqn``'s primitive again keeps its source: its name stack
    (``transpose(jvp(GPT))/block_0/qkv``) and traceback, as ``jax.core.eval_jaxpr`` keeps them,
    so the compiled program's op names and profiles read like the user's own jit's."""
    try:
        from jax._src import source_info_util as siu
        info = eqn.source_info
        return siu.user_context(info.traceback,
                                name_stack=siu.current_name_stack() + info.name_stack)
    except (ImportError, AttributeError, TypeError):   # a jax without them: names are lost
        return contextlib.nullcontext()


def scan_counts(params) -> tuple[int, int]:
    """(constants, carries) among a scan equation's operands (the rest are the scanned-over
    inputs): jax 0.10 names the counts, 0.12 lists each group's leaves (``ft_in``)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carries, _ = params["ft_in"].unpack()   # a jax flat tree of three groups
    return len(consts), len(carries)


def xla_cpu_dots_in_f32() -> bool:
    """Whether XLA:CPU computes every 16-bit float dot in float32, converting its operands to
    float32 copies (jaxlib 0.10); jaxlib 0.12's XLA:CPU does so only for dots with batch
    dimensions (attention's), and takes and returns bf16 in the others."""
    import jaxlib
    return _release(jaxlib.__version__) < (0, 12)


def _release(version: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; a suffix such as ``.dev20260101`` or ``rc1`` ends it."""
    parts = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        parts.append(int(digits))
        if digits != part:
            break
    return tuple(parts)
