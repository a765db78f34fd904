"""Helpers for code inside a pipeline's ``jax.shard_map`` (manual over the stage axis only):
varying values, float32 reductions, the stage plan's specs over the other mesh axes, and the
head and loss a per-microbatch schedule runs there, in their own plan's specs."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from autopar.passes.stages import split
from autopar.passes.stages.prepare import Prepared


def varying(tree, axis):
    """``tree`` varying over ``axis`` (``lax.pcast``)."""
    return jax.tree.map(lambda a: lax.pcast(a, axis, to="varying"), tree)


def low(dtype) -> bool:
    """A float type whose all-reduce inside a partly manual shard_map crashes XLA:CPU
    ("Invalid binary instruction opcode copy", jax 0.10.2): reduce it in float32."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def up(a):
    """``a`` in float32 when :func:`low`."""
    return a.astype(jnp.float32) if low(a.dtype) else a


def psum(tree, axis):
    """``lax.psum`` over ``axis``, in float32 for :func:`low` types."""
    return jax.tree.map(lambda a: lax.psum(up(a), axis).astype(a.dtype), tree)


def varying_as(tree, dtypes, axis):
    """``tree`` (passed in as :func:`up` made it) varying over ``axis``, in ``dtypes``: the
    transpose of the pcast (a psum of cotangents) then runs in float32."""
    return jax.tree.map(lambda a, d: lax.pcast(a, axis, to="varying").astype(d), tree, dtypes)


def constrain(a, spec):
    """``a`` held in ``spec``, a ``PartitionSpec`` over the automatic mesh axes (None: left to
    propagation)."""
    return a if spec is None else lax.with_sharding_constraint(a, spec)


def lead(spec, n: int = 1):
    """``spec`` behind ``n`` unsharded leading axes (microbatches, or a stage's layers)."""
    return None if spec is None else P(*[None] * n, *spec)


def _operands(prep: Prepared, layer_axes: int) -> Callable:
    """``(consts, xs) -> same``, held in the stage plan's specs (identity without one)."""
    inner = prep.inner
    if inner is None:
        return lambda consts, xs: (consts, xs)
    padded = prep.full.positions is not None
    xs_specs = inner.xs + ((None,) if padded else ())   # a padded stack's flags: left as are
    return lambda consts, xs: (
        [constrain(c, sp) for c, sp in zip(consts, inner.consts, strict=True)],
        [constrain(x, lead(sp, layer_axes)) for x, sp in zip(xs, xs_specs, strict=True)])


def inner(prep: Prepared, layer_axes: int = 1):
    """``(consts, mbs, xs) -> same``, held in the stage plan's specs (identity without one);
    ``layer_axes``: the leading axes of a stage's block of each stacked operand."""
    operands = _operands(prep, layer_axes)
    carry = None if prep.inner is None else lead(prep.inner.carry)

    def held(consts, mbs, xs):
        consts, xs = operands(consts, xs)
        return consts, constrain(mbs, carry), xs

    return held


def stage(prep: Prepared, recompute: bool = False, chunked: bool = False) -> Callable:
    """``stage(consts, x, xs) -> y``: a stage's layers, its activation and operands held in
    the stage plan's specs, so under autodiff their cotangents are held in them too (a
    stage's weight gradients accumulate split, not whole). ``recompute``: under autodiff keep
    only the inputs and run the layers again in the backward (``jax.checkpoint``).
    ``chunked`` (the interleaved schedule): ``stage(consts, x, xs, r)`` runs chunk ``r`` of
    the stage's block of each stacked operand, laid out (v, 1, layers per chunk, ...)."""
    stage = split.stage_fn(prep.micro)
    carry = None if prep.inner is None else prep.inner.carry
    operands = _operands(prep, 3 if chunked else 1)

    def layers(consts, x, xs, *chunk):
        # held inside the checkpoint, whole: its recompute in the backward (an autodiffed
        # region's backward region) holds them too, where the outer plan reads them
        consts, xs = operands(consts, xs)
        if chunked:
            xs = [lax.dynamic_index_in_dim(a[:, 0], chunk[0], 0, keepdims=False) for a in xs]
        return constrain(stage(consts, [x], xs)[0], carry)

    if recompute:
        layers = jax.checkpoint(layers)
    return lambda consts, x, xs, *chunk: layers(consts, constrain(x, carry), xs, *chunk)


def layer(prep: Prepared) -> Callable:
    """``layer(consts, x, x_l) -> y``: one layer of the stack (``x_l``: its slice of xs), its
    activation held in the stage plan's spec."""
    layer = split.layer_fn(prep.micro)
    carry = None if prep.inner is None else prep.inner.carry
    return lambda consts, x, x_l: constrain(layer(consts, [constrain(x, carry)], x_l)[0], carry)


def _post_specs(prep: Prepared, kinds) -> tuple[list, list]:
    """The head and loss plan's specs of the flat inputs the region takes whole (not per
    example), as ``(float_ins, other_ins)`` lists (None: left to propagation)."""
    specs = [None] * len(kinds) if prep.post is None else prep.post.ins
    whole = [None if p else sp for sp, p in zip(specs, prep.per_example, strict=True)]
    return ([sp for sp, k in zip(whole, kinds, strict=True) if k == "float"],
            [sp for sp, k in zip(whole, kinds, strict=True) if k == "other"])


def post_held(prep: Prepared, kinds) -> Callable:
    """``(float_ins, other_ins) -> same``, held in the head and loss plan's specs (a
    per-example input is held at each microbatch's slice instead:
    :func:`micro_loss_and_grads`)."""
    floats, others = _post_specs(prep, kinds)
    return lambda float_ins, other_ins: (
        [constrain(a, sp) for a, sp in zip(float_ins, floats, strict=True)],
        [constrain(a, sp) for a, sp in zip(other_ins, others, strict=True)])


def micro_loss_and_grads(prep: Prepared, kinds, rows: int, other_ins) -> Callable:
    """``loss_and_grads(y, float_ins, i) -> (loss, (dy, d_float_ins))``: the code after the
    stack on microbatch ``i`` (``rows`` examples) as a float32 scalar, and its gradient, each
    input and its cotangent held in the head and loss plan's specs. ``kinds``: per flat
    input, "float" or "other" (passed in ``float_ins`` or ``other_ins``) or None (not
    read)."""
    post = split.post_fn(prep.micro)
    n_ys = len(prep.micro.eqn.outvars) - 1
    specs = [None] * len(kinds) if prep.post is None else prep.post.ins
    y_spec = None if prep.post is None else prep.post.y
    floats = _post_specs(prep, kinds)[0]

    def loss(y, float_ins, i):
        its = {"float": iter(float_ins), "other": iter(other_ins), None: iter(())}
        ins = [next(its[k], None) for k in kinds]
        ins = [constrain(lax.dynamic_slice_in_dim(a, i * rows, rows, 0), sp)
               if p and a is not None else a
               for a, p, sp in zip(ins, prep.per_example, specs, strict=True)]
        return post(ins, [constrain(y, y_spec)] + [None] * n_ys)[0].astype(jnp.float32)

    def loss_and_grads(y, float_ins, i):
        value, (dy, d_floats) = jax.value_and_grad(loss, argnums=(0, 1))(y, float_ins, i)
        return value, (constrain(dy, y_spec),
                       [constrain(d, sp) for d, sp in zip(d_floats, floats, strict=True)])

    return loss_and_grads


def region_results(prep: Prepared, end: dict, held: Callable, d_mbs, kinds):
    """A backward loop's results inside the region, summed over the stage axis and scaled by
    the loss weight, each held as the stage's or the head's plan holds it: (loss, d_post,
    d_consts, d_mbs, d_xs)."""
    w, axis = prep.loss_weight, prep.axis
    d_consts, d_mbs, d_xs = held(psum(end["d_consts"], axis), psum(d_mbs, axis), end["d_xs"])
    d_post = psum(jax.tree.map(lambda a: a * w, end["d_post"]), axis)
    d_post = [constrain(d, sp) for d, sp in zip(d_post, _post_specs(prep, kinds)[0], strict=True)]
    return psum(end["loss"], axis) * w, d_post, d_consts, d_mbs, d_xs


def run_region(body: Callable, prep: Prepared, mesh, flat, kinds, consts, carry, xs):
    """``body(consts, mbs, xs, float_ins, other_ins)`` in ``jax.shard_map`` manual over the
    stage axis, the carry split into microbatches: (loss, d_post, d_consts, d_carry, d_xs)."""
    axis, n_micro = prep.axis, prep.microbatches
    float_ins = [a for a, k in zip(flat, kinds, strict=True) if k == "float"]
    other_ins = [a for a, k in zip(flat, kinds, strict=True) if k == "other"]
    mbs = carry.reshape(n_micro, carry.shape[0] // n_micro, *carry.shape[1:])
    hold = post_held(prep, kinds)

    def held_body(consts, mbs, xs, float_ins, other_ins):
        return body(consts, mbs, xs, *hold(float_ins, other_ins))

    value, d_post, d_consts, d_mbs, d_xs = jax.shard_map(
        held_body, mesh=mesh, in_specs=(P(), P(), P(axis), P(), P()),
        out_specs=(P(), P(), P(), P(), P(axis)), axis_names={axis},
    )(consts, mbs, xs, float_ins, other_ins)
    return value, d_post, d_consts, d_mbs.reshape(carry.shape), d_xs
