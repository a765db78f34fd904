"""The one error hierarchy of autopar.

Every error a user can cause is an :class:`AutoparError` subclass whose message names the
offending argument and says how to fix it. ``assert`` is kept for internal invariants.
"""

import contextlib
import os
import sys
import warnings

#: autopar's own folders (its package, and ``passes`` and ``cost_model`` where they are linked
#: in from the repository's top level), for :func:`warn`.
_OWN = tuple(os.path.realpath(os.path.join(os.path.dirname(__file__), d)) + os.sep
             for d in ("", "passes", "cost_model"))
_MODELS = os.path.realpath(os.path.join(os.path.dirname(__file__), "models")) + os.sep


def autopar_file(path: str, models: bool = True) -> bool:
    """Whether ``path`` is a file of autopar's code (of its bundled models too, unless
    ``models`` is False)."""
    path = os.path.realpath(path)
    return path.startswith(_OWN) and (models or not path.startswith(_MODELS))


def jax_file(path: str) -> bool:
    """Whether ``path`` is a file of jax's or jaxlib's (frames between the user's function
    and the code of autopar's it calls while jax traces it)."""
    return f"{os.sep}jax{os.sep}" in path or f"{os.sep}jaxlib{os.sep}" in path


def _skipped(frame) -> bool:
    """A frame of autopar's or of jax's, or of contextlib's (a context manager used as a
    decorator of autopar's functions, such as ``autopar.plan``'s progress clock)."""
    path = frame.f_code.co_filename
    return autopar_file(path) or jax_file(path) or path == contextlib.__file__


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first caller outside autopar and jax (the user's
    line), however deep in autopar it is raised."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and _skipped(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class AutoparError(Exception):
    """Base class of every error autopar raises for bad input or an impossible request."""


class MeshError(AutoparError):
    """The mesh does not match the devices present, or is malformed."""


class ArgumentError(AutoparError):
    """An example argument, hint or option is not of a form autopar accepts."""


class ShardingHintError(ArgumentError):
    """A sharding hint does not fit the arguments, the mesh or the shapes."""


class TracingError(ArgumentError):
    """The function failed to trace on its example arguments: it raised (wrong argument count,
    mismatched shapes), or returned something that is not a pytree of arrays. The message
    names the function and the error; the original exception is its ``__cause__``."""


class PipelineError(ArgumentError):
    """A pipeline (``autopar.Pipeline``, ``autopar.value_and_grad`` under a pipelined plan) was
    asked of a program, mesh or batch it cannot pipeline exactly; the message says what to
    change."""


class UnknownHardwareError(AutoparError):
    """A hardware profile name is not known."""


class ProfileError(AutoparError):
    """A hardware profile JSON is malformed, outdated, or does not fit the mesh."""


class InfeasiblePlanError(AutoparError):
    """No plan satisfies the constraints (for example the memory budget)."""


class OtherProcessError(AutoparError):
    """In a multi-process run, planning failed on another process; this one stops too rather
    than wait for it. ``process_index`` and ``message`` say which process and what it raised."""

    def __init__(self, message: str, process_index: int, cause: str):
        super().__init__(message)
        self.process_index = process_index
        self.message = cause


class PlanFormatError(AutoparError):
    """A saved plan is malformed or was written by an incompatible version."""


class CLIError(AutoparError):
    """A command-line input is wrong (missing file, missing target, bad flag)."""


class AutoparWarning(UserWarning):
    """Base class of every warning autopar gives: the plan is made, with a caveat it names."""


class HardwareWarning(AutoparWarning):
    """The devices are not those asked for: the accelerator has no built-in hardware profile
    (the nearest one is used), simulated CPU devices were asked for too late, or a loaded
    plan's devices are not in this process (it is read on its mesh's axes alone)."""


class ShardingConflictWarning(AutoparWarning):
    """Two sharding annotations (hints, ``with_sharding_constraint`` calls, flax metadata, or
    shardings propagated from them) want one value sharded two ways. The user's annotation
    wins over a propagated one, the value is resharded where they meet, and the warning names
    both sources."""


class PlanCacheWarning(AutoparWarning):
    """The on-disk plan cache (``cache_dir=``) did not serve this call; the step still runs.
    Filter this class to silence both kinds below."""


class StalePlanCacheWarning(PlanCacheWarning):
    """A plan cache entry was corrupted, stale or unreadable and was ignored: the function is
    planned afresh."""


class UnusableCacheDirWarning(PlanCacheWarning):
    """The ``cache_dir`` cannot be made, or an entry cannot be written in it: the plan is made
    but not cached, so a restart plans again. Give a folder the program can write to."""


class UnusedAnnotationWarning(AutoparWarning):
    """A sharding annotation on the arguments is not used as a hint: flax logical axis names
    with no ``logical_axis_rules`` to map them to mesh axes. The plan is made without it."""


class SolverFallbackWarning(AutoparWarning):
    """The ILP found no solution in its time limit (a greedy plan is used instead), or none
    better than its warm start (that plan is used)."""


class MemoryBudgetWarning(AutoparWarning):
    """No plan fits the default memory budget (the profile's HBM capacity minus a margin),
    and the plan returned ignores it; or the ``memory_budget`` given is over a device's
    memory, so a plan that fits it may not fit the device."""


class UnsupportedPrimitiveWarning(AutoparWarning):
    """A primitive has no sharding rule and is planned replicated."""


class RematWarning(AutoparWarning):
    """Rematerialization was asked for (``plan(remat="dots_saveable")``, say), but the program
    has no layer the pass can recompute; it is planned as it is."""


class AttentionWarning(AutoparWarning):
    """An attention strategy was asked for (``plan(attention="ring")``, say), but the program
    has no attention autopar recognizes; it is planned as it is, nothing split over the
    sequence."""


class ReplanWarning(AutoparWarning):
    """``autopar.parallelize`` planned and compiled a function again for the same arrays
    because a leaf that is not an array (a static value: a Python float, say) changed; the
    message names the leaf. Pass a value that changes every step as an array."""


class InvalidIRError(AssertionError):
    """Internal, not a user error: the Graph IR broke an invariant after the pass the message
    names (``autopar.passes.verify``, checked between passes when ``AUTOPAR_DEBUG=1``). A bug
    in autopar; report it with the program that triggers it."""
