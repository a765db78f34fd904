"""The door of the public API: every argument of ``autopar.plan`` and ``autopar.parallelize``
checked, and normalized, before any work.

Each bad value is an :class:`autopar.errors.AutoparError` subclass whose message names the
argument in backticks and says how to fix it. Valid spellings are taken as they are written:
``memory_budget=np.int64(10**9)`` or ``"1e9"``, ``time_limit_s=np.float32(5)``.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
from collections.abc import Callable, Mapping

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from autopar._axis_roles import roles
from autopar._mesh import as_auto_mesh, axis_sizes, same_axes
from autopar._pipeline import Pipeline
from autopar._sizes import format_bytes, parse_bytes
from autopar.cost_model.hardware import HardwareProfile, LevelKind, get_profile
from autopar.errors import ArgumentError, MemoryBudgetWarning, ShardingHintError, warn
from autopar.passes.annotate import check_partition_spec
from autopar.passes.memory_budget import DEFAULT_MARGIN, default_memory_budget_bytes
from autopar.passes.remat import RematPolicy
from autopar.passes.sequence_parallel import checked_terms

#: ``plan()``'s options (besides ``fn`` and the example arguments), each with the check of its
#: value; ``parallelize`` passes on exactly these.
PLAN_OPTIONS = ("mesh", "hardware", "memory_budget", "in_shardings", "out_shardings", "search",
                "logical_axis_rules", "time_limit_s", "tie_state", "axis_level_overrides",
                "baseline_seeds", "remat", "check_memory", "verbose", "pipeline", "overlap",
                "batch_axes", "attention")


def _is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (numbers.Real, np.floating, np.integer)) and not isinstance(
        x, (bool, np.bool_))


def memory_budget_bytes(value) -> int | float | None:
    """``memory_budget`` as bytes: None, a positive number (any numpy scalar too), or a size
    such as ``"40GiB"`` or ``"1e9"``."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return parse_bytes(value)
        except ValueError as e:
            raise ArgumentError(f"`memory_budget`: {e}") from None
    if not _is_real(value) or not math.isfinite(float(value)) or float(value) < 1:
        raise ArgumentError(f"`memory_budget` must be a positive number of bytes per device "
                            f"(at least 1) or a size such as \"40GiB\", got {value!r}")
    return int(value) if isinstance(value, (numbers.Integral, np.integer)) else float(value)


def seconds(value, name: str = "time_limit_s") -> float:
    """A positive number of seconds (``inf``: no limit), as a float."""
    if isinstance(value, str):
        raise ArgumentError(f"`{name}` must be a number of seconds such as 60.0, not the "
                            f"string {value!r}")
    if not _is_real(value) or math.isnan(float(value)) or float(value) <= 0:
        raise ArgumentError(f"`{name}` must be a positive number of seconds such as 60.0, got "
                            f"{value!r}")
    return float(value)


def flag(value, name: str, allow_none: bool = False):
    """``value`` as a bool (None kept with ``allow_none``); ArgumentError naming ``name``
    for anything else."""
    if value is None and allow_none:
        return None
    if not isinstance(value, (bool, np.bool_)):
        accepted = "True, False or None" if allow_none else "True or False"
        raise ArgumentError(f"`{name}` must be {accepted}, got {value!r}")
    return bool(value)


def _remat(value):
    names = [p.value for p in RematPolicy]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if not isinstance(value, str) or value not in names:
        raise ArgumentError(f"`remat` must be True, False or a policy name ({', '.join(names)}), "
                            f"got {value!r}")
    return value


def _pipeline(value):
    if value is None or value == "auto" or isinstance(value, Pipeline):
        return value
    raise ArgumentError(f"`pipeline` must be None, \"auto\" or an `autopar.Pipeline(...)`, "
                        f"not {value!r}")


def _rules(value):
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not all(
            isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[0], str)
            for r in value):
        raise ArgumentError(f"`logical_axis_rules` must be a list of (logical name, mesh axis) "
                            f"pairs such as [('batch', 'data'), ('mlp', 'model')], got {value!r}")
    return value


def _overrides(value, mesh: Mesh):
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ArgumentError(f"`axis_level_overrides` must map mesh axis names to link levels, "
                            f"such as {{'data': 'dcn'}}, got {value!r}")
    unknown = sorted(set(value) - set(mesh.axis_names))
    if unknown:
        raise ArgumentError(f"`axis_level_overrides` names {unknown}, which the mesh lacks; "
                            f"its axes are {list(mesh.axis_names)}")
    return value


def _same_mesh(a: Mesh, b: Mesh) -> bool:
    return (tuple(a.axis_names) == tuple(b.axis_names) and a.devices.shape == b.devices.shape
            and [d.id for d in a.devices.flat] == [d.id for d in b.devices.flat])


def _translated(hint: NamedSharding, mesh: Mesh, where: str) -> PartitionSpec:
    """The PartitionSpec that places data on ``mesh`` exactly as ``hint`` (on its own mesh)
    does; ShardingHintError when there is none to be had by reading its spec on ``mesh``."""
    check_partition_spec(hint.spec, where)
    if isinstance(hint.mesh, AbstractMesh):   # no devices to compare: the axes must match
        if same_axes(hint.mesh, mesh):
            return hint.spec
        raise ShardingHintError(
            f"hint for `{where}` is a NamedSharding on a mesh without devices "
            f"({axis_sizes(hint.mesh)}) whose axes are not the plan's ({axis_sizes(mesh)}): "
            "pass its PartitionSpec (`sharding.spec`) or a sharding on the plan's mesh")
    if _same_mesh(hint.mesh, mesh):
        return hint.spec
    ndim = max(len(hint.spec), 1)
    try:
        same = hint.is_equivalent_to(NamedSharding(mesh, hint.spec), ndim)
    except (ValueError, TypeError, KeyError):
        same = False
    if same:
        return hint.spec
    theirs = dict(zip(hint.mesh.axis_names, hint.mesh.devices.shape))
    ours = dict(zip(mesh.axis_names, mesh.devices.shape))
    raise ShardingHintError(
        f"hint for `{where}` is a NamedSharding on another mesh ({theirs}, devices "
        f"{[d.id for d in hint.mesh.devices.flat]}) than the plan's ({ours}, devices "
        f"{[d.id for d in mesh.devices.flat]}), where its spec {hint.spec} places the data "
        "differently. Give a NamedSharding on the plan's mesh, or a PartitionSpec (read on the "
        "plan's mesh)")


def hints(tree, mesh: Mesh, what: str):
    """``tree`` (``in_shardings`` or ``out_shardings``) with each NamedSharding on another
    mesh translated to the PartitionSpec it means on ``mesh`` (or refused), and each spec's
    entries checked."""
    if tree is None:
        return None
    is_hint = lambda x: x is None or isinstance(x, (PartitionSpec, NamedSharding))  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_hint)
    out = []
    for path, leaf in leaves:
        where = f"{what}{jax.tree_util.keystr(path)}"
        if isinstance(leaf, NamedSharding):
            leaf = _translated(leaf, mesh, where)
        elif isinstance(leaf, PartitionSpec):
            check_partition_spec(leaf, where)
        elif leaf is not None:
            raise ShardingHintError(f"hint for `{where}` is of type {type(leaf).__name__} ({leaf!r}): "
                                    "give a PartitionSpec, a NamedSharding or None")
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def options(values: dict) -> dict:
    """``values`` (some of :data:`PLAN_OPTIONS`, ``mesh`` among them) checked and
    normalized."""
    unknown = sorted(set(values) - set(PLAN_OPTIONS))
    if unknown:
        raise ArgumentError(f"unknown option(s) {', '.join(f'`{k}`' for k in unknown)}: "
                            f"`parallelize` passes these on to autopar.plan: "
                            f"{', '.join(PLAN_OPTIONS)}")
    mesh = as_auto_mesh(values["mesh"])
    out = dict(values)
    checks: dict[str, Callable] = {
        "hardware": lambda v: (get_profile(v), v)[1],
        "memory_budget": memory_budget_bytes,
        "time_limit_s": seconds,
        "search": lambda v: flag(v, "search"),
        "tie_state": lambda v: flag(v, "tie_state"),
        "baseline_seeds": lambda v: flag(v, "baseline_seeds"),
        "check_memory": lambda v: flag(v, "check_memory", allow_none=True),
        "verbose": lambda v: flag(v, "verbose", allow_none=True),
        "overlap": lambda v: flag(v, "overlap"),
        "remat": _remat,
        "pipeline": _pipeline,
        "logical_axis_rules": _rules,
        "axis_level_overrides": lambda v: _overrides(v, mesh),
        "batch_axes": lambda v: v if v is None else (roles(mesh.axis_names, v), v)[1],
        # its axes checked before planning: a step with no attention autopar sees is refused
        # alike
        "attention": lambda v: (checked_terms(v, mesh.axis_names), v)[1],
        "in_shardings": lambda v: hints(v, mesh, "in_shardings"),
        "out_shardings": lambda v: hints(v, mesh, "out_shardings"),
    }
    for name, check in checks.items():
        if name in values:
            out[name] = check(values[name])
    if out.get("memory_budget") is not None:
        budget_within_the_device(out["memory_budget"], get_profile(out.get("hardware")))
    return out


def budget_within_the_device(budget: float, profile: HardwareProfile) -> None:
    """A MemoryBudgetWarning when ``budget`` (bytes) is over one device's memory on
    ``profile``: a plan that fits it may not fit the device. Not for simulated CPU devices,
    whose memory is a guessed share of the host's."""
    capacity = profile.hbm_capacity_bytes
    simulated = bool(profile.levels) and profile.levels[0].kind is LevelKind.HOST
    if simulated or budget <= capacity:
        return
    warn(f"autopar: the `memory_budget` of {format_bytes(budget)} is over {profile.name}'s "
         f"memory ({format_bytes(capacity)} a device): a plan that fits it may not fit on the "
         f"device. Pass at most the device's memory, or leave the budget out (default "
         f"{format_bytes(default_memory_budget_bytes(profile))}: the memory less "
         f"{DEFAULT_MARGIN:.0%}).", MemoryBudgetWarning)


def example_arguments(fn, example_args: tuple) -> None:
    """ArgumentError unless ``fn`` is callable and is given at least one array argument."""
    if not callable(fn):
        raise ArgumentError(f"`fn` must be a function to plan, got {type(fn).__name__} "
                            f"{fn!r}: call autopar.plan(fn, *example_args, mesh=...)")
    if not jax.tree_util.tree_leaves(example_args):
        raise ArgumentError(
            "`example_args` is empty: autopar plans how a function's array arguments are "
            "sharded, so pass them: autopar.plan(fn, *example_args, mesh=...), arrays or "
            "jax.ShapeDtypeStruct (a function of no arguments has nothing to shard: give it "
            "its arrays as arguments)")


def _argnums(value, name: str) -> tuple[int, ...]:
    items = (value,) if _is_int(value) or isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        items = (value,)
    if not all(_is_int(i) and i >= 0 for i in items):
        raise ArgumentError(f"`{name}` must be a non-negative int or a sequence of them (argument "
                            f"positions, as in jax.jit), got {value!r}")
    return tuple(int(i) for i in items)


def _argnames(value, name: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        items = (value,)
    if not all(isinstance(i, str) for i in items):
        raise ArgumentError(f"`{name}` must be a name or a sequence of names of `fn`'s keyword "
                            f"arguments, got {value!r}")
    return items


def _parameters(fn) -> tuple[int | None, set[str] | None]:
    """(how many positional parameters ``fn`` takes, or None for any number; the names it
    takes by keyword, or None for any)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return None, None
    kinds = {p.kind for p in params}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return (None if inspect.Parameter.VAR_POSITIONAL in kinds else len(positional),
            None if inspect.Parameter.VAR_KEYWORD in kinds else names)


def parallelize_arguments(fn, static_argnums, static_argnames, donate_argnums, cache_dir
                          ) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]:
    """(static_argnums, static_argnames, donate_argnums) of ``parallelize``, checked against
    ``fn``'s signature; ``cache_dir`` must be a path or None."""
    if not callable(fn):
        raise ArgumentError(f"`fn` must be a function to parallelize, got {type(fn).__name__}")
    static = _argnums(static_argnums, "static_argnums")
    donate = _argnums(donate_argnums, "donate_argnums")
    names = _argnames(static_argnames, "static_argnames")
    count, keywords = _parameters(fn)
    for what, nums in (("static_argnums", static), ("donate_argnums", donate)):
        over = [i for i in nums if count is not None and i >= count]
        if over:
            raise ArgumentError(f"`{what}` names argument position(s) {over}, but `fn` takes "
                                f"{count} positional argument(s): count from 0")
    missing = [n for n in names if keywords is not None and n not in keywords]
    if missing:
        raise ArgumentError(f"`static_argnames` names {missing}, which `fn` does not take; "
                            f"its parameters are {sorted(keywords or ())}")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise ArgumentError(f"`cache_dir` must be a folder path (str or os.PathLike) or None, "
                            f"got {type(cache_dir).__name__}")
    return static, names, donate
