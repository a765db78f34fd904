"""Helpers for code inside a pipeline's ``jax.shard_map`` (manual over the stage axis only):
varying values, float32 reductions, and the stage plan's specs over the other mesh axes."""

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


def inner(prep: Prepared, layer_axes: int = 1):
    """``(consts, mbs, xs) -> same``, held in the stage plan's specs (identity without one);
    ``layer_axes``: the leading axes of a stage's block of each stacked operand."""
    inner = prep.inner
    if inner is None:
        return lambda consts, mbs, xs: (consts, mbs, xs)
    padded = prep.full.positions is not None
    xs_specs = inner.xs + ((None,) if padded else ())   # a padded stack's flags: left as are
    return lambda consts, mbs, xs: (
        [constrain(c, sp) for c, sp in zip(consts, inner.consts, strict=True)],
        constrain(mbs, lead(inner.carry)),
        [constrain(x, lead(sp, layer_axes)) for x, sp in zip(xs, xs_specs, strict=True)])


def stage(prep: Prepared) -> Callable:
    """``stage(consts, x, xs) -> y``: a stage's layers, its activation held in the stage plan's
    spec."""
    stage = split.stage_fn(prep.micro)
    carry = None if prep.inner is None else prep.inner.carry

    def run(consts, x, xs):
        y = stage(consts, [constrain(x, carry)], xs)[0]
        return constrain(y, carry)

    return run


def layer(prep: Prepared) -> Callable:
    """``layer(consts, x, x_l) -> y``: one layer of the stack (``x_l``: its slice of xs), its
    activation held in the stage plan's spec."""
    layer = split.layer_fn(prep.micro)
    carry = None if prep.inner is None else prep.inner.carry
    return lambda consts, x, x_l: constrain(layer(consts, [constrain(x, carry)], x_l)[0], carry)


def region_results(prep: Prepared, end: dict, held: Callable, d_mbs):
    """A backward loop's results inside the region, summed over the stage axis and scaled by
    the loss weight: (loss, d_post, d_consts, d_mbs, d_xs)."""
    w, axis = prep.loss_weight, prep.axis
    d_consts, d_mbs, d_xs = held(psum(end["d_consts"], axis), psum(d_mbs, axis), end["d_xs"])
    return (psum(end["loss"], axis) * w, jax.tree.map(lambda a: a * w, psum(end["d_post"], axis)),
            d_consts, d_mbs, d_xs)


def run_region(body: Callable, prep: Prepared, mesh, flat, kinds, consts, carry, xs):
    """``body(consts, mbs, xs, float_ins, other_ins)`` in ``jax.shard_map`` manual over the
    stage axis, the carry split into microbatches: (loss, d_post, d_consts, d_carry, d_xs)."""
    axis, n_micro = prep.axis, prep.microbatches
    float_ins = [a for a, k in zip(flat, kinds, strict=True) if k == "float"]
    other_ins = [a for a, k in zip(flat, kinds, strict=True) if k == "other"]
    mbs = carry.reshape(n_micro, carry.shape[0] // n_micro, *carry.shape[1:])
    value, d_post, d_consts, d_mbs, d_xs = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(), P(axis), P(), P()),
        out_specs=(P(), P(), P(), P(), P(axis)), axis_names={axis},
    )(consts, mbs, xs, float_ins, other_ins)
    return value, d_post, d_consts, d_mbs.reshape(carry.shape), d_xs
