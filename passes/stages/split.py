"""Split a traced loss around its layer stack: ``pre`` (before the stack: embedding), the
per-layer ``body``, and ``post`` (after it: head and loss).

The layer stack is the top-level ``scan`` whose scanned operands (``xs``) depend on the
differentiated parameters, stacked on a leading layer axis (``nn.scan``, ``nnx.scan`` and a
``lax.scan`` over stacked params all trace to one). With several, the one scanning the most
bytes. Its single carry is the activation, batch axis first; its other operands must not
depend on the batch.

All three pieces are plain functions of flat values that replay the traced equations, so the
emitter can run, trace or differentiate them like any jax code.

A stack whose layers the stages do not divide is padded (:func:`padded`): each stage's block
of the stacked operands ends in copies of a layer, and a flag stacked beside them
(``pre`` appends it to the scanned operands) makes a padded layer pass its carry through.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from autopar._compat import scan_counts
from autopar.errors import PipelineError

MSG_NO_STACK = (
    "the loss has no scanned layer stack to cut into pipeline stages: no top-level `scan` "
    "runs over parameters stacked on a leading layer axis. Scan your layers with `nn.scan` "
    "(flax linen), `nnx.scan` (flax nnx) or `jax.lax.scan` over stacked parameters, or plan "
    "with `pipeline=None`."
)


@dataclass(frozen=True)
class Stack:
    """The layer stack of one traced loss: the scan equation and where it sits."""

    jaxpr: jcore.ClosedJaxpr
    index: int
    #: padded (:func:`padded`): the layer each stacked position holds, -1 for a pad
    positions: tuple[int, ...] | None = None

    @property
    def eqn(self) -> jcore.JaxprEqn:
        return self.jaxpr.jaxpr.eqns[self.index]

    @property
    def num_consts(self) -> int:
        return scan_counts(self.eqn.params)[0]

    @property
    def num_carry(self) -> int:
        return scan_counts(self.eqn.params)[1]

    @property
    def layers(self) -> int:
        return self.eqn.params["length"]

    @property
    def stacked(self) -> int:
        """Stacked positions the emitted stack runs: the layers, pads included."""
        return self.layers if self.positions is None else len(self.positions)

    @property
    def carry_shape(self) -> tuple[int, ...]:
        return tuple(self.eqn.invars[self.num_consts].aval.shape)


def chunk_ranges(layers: int, chunks: int) -> tuple[tuple[int, int], ...]:
    """``[first, stop)`` of each of ``chunks`` contiguous runs of ``layers``, the first
    ``layers % chunks`` one layer longer."""
    assert 0 < chunks <= layers, (chunks, layers)
    per, extra = divmod(layers, chunks)
    starts = [c * per + min(c, extra) for c in range(chunks + 1)]
    return tuple(zip(starts[:-1], starts[1:]))


def padded(stack: Stack, chunks: int) -> Stack:
    """``stack`` cut into ``chunks`` balanced runs (:func:`chunk_ranges`), each stacked in
    ``ceil(layers / chunks)`` positions; unchanged when ``chunks`` divides the layers."""
    if stack.layers % chunks == 0:
        return stack
    width = -(-stack.layers // chunks)
    positions = []
    for first, stop in chunk_ranges(stack.layers, chunks):
        positions += list(range(first, stop)) + [-1] * (width - (stop - first))
    return replace(stack, positions=tuple(positions))


def find_stack(closed: jcore.ClosedJaxpr, is_param: list[bool]) -> Stack:
    """The layer stack of ``closed`` (inputs flagged ``is_param`` are the parameters)."""
    jaxpr = closed.jaxpr
    from_params = {v for v, p in zip(jaxpr.invars, is_param, strict=True) if p}
    best, best_bytes = None, -1
    for i, eqn in enumerate(jaxpr.eqns):
        uses = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        if any(v in from_params for v in uses):
            from_params.update(eqn.outvars)
        if eqn.primitive.name != "scan":
            continue
        first_x = scan_counts(eqn.params)[0] + scan_counts(eqn.params)[1]
        xs = [v for v in eqn.invars[first_x:] if not isinstance(v, jcore.Literal)]
        if not any(v in from_params for v in xs) or eqn.params["reverse"]:
            continue
        size = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in xs)
        if size > best_bytes:
            best, best_bytes = i, size
    if best is None:
        raise PipelineError(MSG_NO_STACK)
    return Stack(jaxpr=closed, index=best)


def _read(env, var):
    return var.val if isinstance(var, jcore.Literal) else env[var]


#: Call primitives replayed inline (their body), so that operands' varying axes can differ.
_INLINE = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}


def _replay(eqns, env) -> None:
    """Evaluate ``eqns`` into ``env``. Inside ``shard_map`` an operand less varying than the
    others is ``pcast`` to varying first, as jax's own tracing does."""
    for eqn in eqns:
        args = _match_varying([_read(env, v) for v in eqn.invars])
        if eqn.primitive.name in _INLINE:
            sub = eqn.params[_INLINE[eqn.primitive.name]]
            inner = dict(zip(sub.jaxpr.constvars, sub.consts, strict=True))
            inner.update(zip(sub.jaxpr.invars, args, strict=True))
            _replay(sub.jaxpr.eqns, inner)
            outs = [_read(inner, v) for v in sub.jaxpr.outvars]
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            outs = eqn.primitive.bind(*args, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for var, value in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, jcore.DropVar):
                env[var] = value


def _vma(x) -> frozenset:
    return jax.typeof(x).mat.varying


def _match_varying(args: list) -> list:
    union = frozenset().union(*(_vma(a) for a in args))
    if not union:
        return args
    return [a if _vma(a) == union else lax.pcast(a, tuple(sorted(union - _vma(a))), to="varying")
            for a in args]


def _start(stack: Stack, flat_ins) -> dict:
    jaxpr = stack.jaxpr.jaxpr
    env = dict(zip(jaxpr.constvars, stack.jaxpr.consts, strict=True))
    env.update(zip(jaxpr.invars, flat_ins, strict=True))
    return env


def pre_fn(stack: Stack) -> Callable:
    """``pre(*flat_ins) -> [scan operands]``: everything the stack's scan reads."""

    def pre(*flat_ins):
        env = _start(stack, flat_ins)
        _replay(stack.jaxpr.jaxpr.eqns[: stack.index], env)
        ops = [_read(env, v) for v in stack.eqn.invars]
        if stack.positions is None:
            return ops
        first_x = stack.num_consts + stack.num_carry
        # a pad holds a copy of the layer before it (real values: no NaN in its masked work)
        take = np.maximum.accumulate(np.array(stack.positions))
        live = np.array(stack.positions) >= 0
        return [*ops[:first_x], *(jnp.take(x, take, axis=0) for x in ops[first_x:]),
                jnp.asarray(live, jnp.float32)]

    return pre


def _live(eqns, outvars) -> tuple[list, set]:
    """The equations ``outvars`` need, in order, and every variable they read."""
    needed = {v for v in outvars if not isinstance(v, jcore.Literal)}
    live = []
    for eqn in reversed(eqns):
        if any(v in needed for v in eqn.outvars) or eqn.effects:
            live.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    return live[::-1], needed


def post_fn(stack: Stack) -> Callable:
    """``post(flat_ins, scan_outs) -> [outputs]``; recomputes only what it needs from before
    the stack, and reads only the inputs :func:`post_reads` flags (pass None for the rest)."""
    jaxpr = stack.jaxpr.jaxpr
    eqns = jaxpr.eqns[: stack.index] + jaxpr.eqns[stack.index + 1:]
    live, _ = _live(eqns, jaxpr.outvars)

    def post(flat_ins, scan_outs):
        env = _start(stack, flat_ins)
        for var, value in zip(stack.eqn.outvars, scan_outs, strict=True):
            if not isinstance(var, jcore.DropVar):
                env[var] = value
        _replay(live, env)
        return [_read(env, v) for v in jaxpr.outvars]

    return post


def post_reads(stack: Stack) -> tuple[list[bool], list[bool]]:
    """Which flat inputs and which scan outputs the code after the stack reads."""
    jaxpr = stack.jaxpr.jaxpr
    eqns = jaxpr.eqns[: stack.index] + jaxpr.eqns[stack.index + 1:]
    _, needed = _live(eqns, jaxpr.outvars)
    return ([v in needed for v in jaxpr.invars],
            [not isinstance(v, jcore.DropVar) and v in needed for v in stack.eqn.outvars])


def layer_fn(stack: Stack) -> Callable:
    """``layer(consts, carry, x) -> carry``: the stack's body, once (``x``: one layer's slice
    of each stacked operand; padded, its flag last: a pad returns ``carry``)."""
    body = stack.eqn.params["jaxpr"]
    n_carry = stack.num_carry

    def layer(consts, carry, x):
        env = dict(zip(body.jaxpr.constvars, body.consts, strict=True))
        env.update(zip(body.jaxpr.invars, [*consts, *carry, *x], strict=True))
        _replay(body.jaxpr.eqns, env)
        return [_read(env, v) for v in body.jaxpr.outvars][:n_carry]

    if stack.positions is None:
        return layer

    def masked(consts, carry, x):
        *x, live = x
        out = layer(consts, carry, x)
        return [jnp.where(live > 0, o, c) for o, c in zip(out, carry, strict=True)]

    return masked


def narrowed_xs(stack: Stack) -> list:
    """Per stacked operand, the dtype the layer body reads it in when its one use is a convert
    to a narrower float (a float32 weight read as bfloat16), else None: a stage can convert
    its share once instead of once per microbatch."""
    body = stack.eqn.params["jaxpr"].jaxpr
    xs = body.invars[stack.num_consts + stack.num_carry:]
    uses: dict = {v: [] for v in xs}
    for eqn in body.eqns:
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal) and v in uses:
                uses[v].append(eqn)
    narrowed = []
    for v in xs:
        (eqn, *more) = uses[v] or [None]
        new = None if eqn is None else eqn.params.get("new_dtype")
        narrow = (eqn is not None and not more and eqn.primitive is lax.convert_element_type_p
                  and v not in body.outvars and new is not None
                  and jnp.issubdtype(new, jnp.floating) and jnp.issubdtype(v.aval.dtype, jnp.floating)
                  and np.dtype(new).itemsize < v.aval.dtype.itemsize)
        narrowed.append(np.dtype(new) if narrow else None)
    return narrowed + ([None] if stack.positions is not None else [])


def stage_fn(stack: Stack) -> Callable:
    """``stage(consts, carry, xs) -> carry``: the stack's body scanned over the layers of
    ``xs`` (any leading length: a stage's share of the layers)."""
    layer = layer_fn(stack)

    def stage(consts, carry, xs):
        out, _ = lax.scan(lambda c, x: (layer(consts, c, x), None), list(carry), list(xs))
        return out

    return stage


def ys_used(stack: Stack) -> bool:
    """Whether anything after the stack reads its stacked per-layer outputs."""
    return any(post_reads(stack)[1][stack.num_carry:])


def trace(fun: Callable, flat_args) -> jcore.ClosedJaxpr:
    """``jax.make_jaxpr`` of ``fun`` over flat (possibly abstract) arguments."""
    specs = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in flat_args]
    return jax.make_jaxpr(fun)(*specs)
