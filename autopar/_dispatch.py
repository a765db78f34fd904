"""How ``autopar.parallelize`` calls a planned program: the signature a plan is kept for, which
argument leaves are static, and a call path that costs no more than ``jax.jit``'s own
dispatch when nothing changed since the last call."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from autopar._axis_roles import state_ties
from autopar._cache import dtype_name
from autopar._layers import flat_donation
from autopar._plan import Plan, in_sharding
from autopar.errors import ArgumentError
from autopar.passes.ir import canonical_dtype

#: With ``verbose=None``, "compiling" shows once the first call of a plan has compiled this long.
COMPILE_QUIET_S = 2.0

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)


def is_static_leaf(x) -> bool:
    """Whether an argument leaf is a Python value rather than an array, and so part of the
    signature, as ``equinox.filter_jit`` treats it: floats, bools, callables, strings, any
    object. Python ints stay dynamic (a counter such as flax's ``TrainState.step`` starts as
    one and comes back from the step as an array)."""
    if isinstance(x, _ARRAY_TYPES):
        return False
    return not (isinstance(x, int) and not isinstance(x, bool))


@dataclass(frozen=True)
class Split:
    """The flat leaves of a call's non-static arguments, parted into arrays and static values.

    ``static`` is ((leaf index, value), ...); ``arrays`` is every other leaf (Python ints made
    numpy arrays), in order."""
    tree: Any
    static: tuple
    arrays: list

    @classmethod
    def of(cls, leaves: list, tree) -> Split:
        static = tuple((i, x) for i, x in enumerate(leaves) if is_static_leaf(x))
        if not static:
            return cls(tree, (), [_as_array(x) for x in leaves])
        idx = {i for i, _ in static}
        return cls(tree, static, [_as_array(x) for i, x in enumerate(leaves) if i not in idx])

    def dynamic_tree(self):
        """The arguments with each static leaf replaced by None (what is planned)."""
        out = list(self.arrays)
        for i, _ in self.static:
            out.insert(i, None)
        return jax.tree_util.tree_unflatten(self.tree, out)

    def same_static(self, leaves: list) -> bool:
        """Whether ``leaves`` (a call's, of the same tree) hold the same static values."""
        return all(not isinstance(leaves[i], _ARRAY_TYPES) and (leaves[i] is v or leaves[i] == v)
                   for i, v in self.static)

    def arrays_of(self, leaves: list) -> list:
        """The array leaves of ``leaves`` (a call's, of the same tree and static values)."""
        if not self.static:
            return leaves
        idx = {i for i, _ in self.static}
        return [x for i, x in enumerate(leaves) if i not in idx]

    def merge(self, arrays: Sequence) -> list:
        """The full flat leaves: ``arrays`` (traced or real) with the static values put back."""
        out = list(arrays)
        for i, x in self.static:
            out.insert(i, x)
        return out


def _as_array(x):
    """``x`` as an array: a Python int (a dynamic leaf) as jax would take it, in its default
    integer type; one out of that type's range is refused, as ``jax.jit`` refuses it, rather
    than wrapped."""
    if hasattr(x, "shape"):
        return x
    if isinstance(x, int) and not isinstance(x, bool):
        dtype = jax.dtypes.canonicalize_dtype(np.int64)
        info = np.iinfo(dtype)
        if not info.min <= x <= info.max:
            raise ArgumentError(
                f"a Python int argument, {x}, does not fit {dtype.name} (jax's default "
                f"integer, from {info.min} to {info.max}): pass it as an array of a wider "
                "type (with jax_enable_x64 on), or mark the argument static.")
        return np.asarray(x, dtype)
    return np.asarray(x)


def signature(split: Split) -> tuple:
    """What a plan of ``parallelize`` is kept for: the tree, (shape, dtype name) per array
    leaf, and the static leaves (their positions and values). A jax array's dtype is
    already canonical; other leaves' are canonicalized as jax will."""
    dtypes = [x.dtype if isinstance(x, jax.Array) else jax.dtypes.result_type(x)
              for x in split.arrays]
    return (split.tree, split.static,
            tuple((tuple(np.shape(x)), dtype_name(d)) for x, d in zip(split.arrays, dtypes)))


def as_planned(leaves: list, flat_shardings: list, host_ok: frozenset = frozenset()) -> list:
    """``leaves`` with those not yet in their planned shardings put there, by one
    ``jax.device_put``: host arrays on the first call, arrays placed otherwise. Leaves already
    placed (the previous step's results, each call after the first) are passed as they are,
    and so are host arrays at ``host_ok`` (a batch from a host loader: ``jax.jit`` moves it,
    keyed as it will be on every call)."""
    todo = [i for i, (x, s) in enumerate(zip(leaves, flat_shardings))
            if not (isinstance(x, jax.Array) and in_sharding(x, s))
            and not (i in host_ok and isinstance(x, np.ndarray))]
    if todo:
        leaves = list(leaves)
        placed = jax.device_put([leaves[i] for i in todo], [flat_shardings[i] for i in todo])
        for i, x in zip(todo, placed):
            leaves[i] = x
    return leaves


class SignatureChanged(Exception):
    """Raised while tracing a :class:`Program` for arguments of other shapes or dtypes than
    it was planned for: the caller plans again instead."""


class Program:
    """A plan's program, jitted once over its flat array leaves. Calling it with leaves of
    the planned shapes costs what ``jax.jit``'s dispatch costs; leaves of other shapes raise
    :class:`SignatureChanged` (checked only when jax traces again, so never on the fast path),
    and leaves in other shardings raise jax's ValueError (then :meth:`place` them)."""

    def __init__(self, plan: Plan, flat_fn: Callable):
        self.plan = plan
        self.flat_shardings = jax.tree_util.tree_leaves(plan.in_shardings)
        planned = tuple((tuple(a.shape), canonical_dtype(a.dtype)) for a in plan._arg_avals)

        @functools.wraps(flat_fn)  # the program's ops keep the step's name
        def guarded(*leaves):
            if tuple((tuple(x.shape), canonical_dtype(x.dtype)) for x in leaves) != planned:
                raise SignatureChanged()
            return flat_fn(*leaves)

        self._jitted = jax.jit(
            guarded, in_shardings=self.flat_shardings,
            out_shardings=jax.tree_util.tree_leaves(plan.out_shardings),
            donate_argnums=flat_donation(plan._in_tree, plan.donate_argnums),
            compiler_options=plan.compiler_options or None)
        self._abstract_mesh = plan.mesh.abstract_mesh
        self._out_tree = plan._out_tree
        self.compiled_once = False
        # Leaves no result replaces (the batch): a host array there stays one (as_planned).
        graph = plan._details[0]
        outs = [graph.values[graph.nodes[n].ins[0]] for n in graph.output_nodes]
        replaced = {i for _, i in state_ties(list(zip(plan.in_paths, plan._arg_avals)),
                                             list(zip(plan.out_paths, outs)))}
        self.host_ok = frozenset(range(len(plan.in_paths))) - replaced

    def fast(self, leaves: list):
        """Run on ``leaves`` of the planned tree, placed as the first call placed them
        (:func:`as_planned`): ``jax.jit`` keys a jax array not yet committed to its sharding
        (a fresh batch, optax's ``count`` from ``init``) and a Python number apart from the
        placed arrays of the first call, and would compile again. What ``jax.jit`` checks
        (shapes, dtypes) is checked by its own dispatch."""
        return self(as_planned([_as_array(x) for x in leaves], self.flat_shardings,
                               self.host_ok))

    def __call__(self, leaves: list):
        with jax.sharding.use_abstract_mesh(self._abstract_mesh):  # Auto axes, as planned
            out = self._jitted(*leaves)
        return jax.tree_util.tree_unflatten(self._out_tree, out)

    def first_call(self, leaves: list, verbose: bool | None):
        """The call that compiles, said on stderr (:func:`announce_compile`)."""
        with announce_compile(verbose):
            out = self(leaves)
        self.compiled_once = True
        return out


@contextmanager
def announce_compile(verbose: bool | None):
    """Says "compiling" on stderr while the block runs: at once with ``verbose=True``, after
    :data:`COMPILE_QUIET_S` seconds with None, never with False."""
    message = ("[autopar] compiling the planned program (first call of this signature; "
               "jax's persistent compilation cache, jax_compilation_cache_dir, keeps it "
               "across runs)")

    def say():
        print(message, file=sys.stderr, flush=True)

    if verbose is False:
        yield
        return
    if verbose:
        say()
        yield
        return
    timer = threading.Timer(COMPILE_QUIET_S, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
