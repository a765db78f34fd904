"""Helpers for code inside a pipeline's ``jax.shard_map`` (manual over the stage axis only):
varying values, float32 reductions, the stage plan's specs over the other mesh axes, the
layers' operands made from the batch (split into microbatches as the carry is), and the head
and loss a per-microbatch schedule runs there, in their own plan's specs."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from autopar.passes.stages import split
from autopar.passes.stages.prepare import Aux, Prepared


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


def microbatches(prep: Prepared, a):
    """``a`` (the batch on its leading axis) split into microbatches, ``[M, rows, ...]``."""
    n = prep.microbatches
    return a.reshape(n, a.shape[0] // n, *a.shape[1:])


def batched(prep: Prepared, consts) -> list:
    """``consts`` with each that holds the batch (``prep.batch_consts``) split into
    :func:`microbatches`, as the carry is."""
    return [microbatches(prep, c) if b else c
            for c, b in zip(consts, batch_flags(prep), strict=True)]


def unbatched(prep: Prepared, consts) -> list:
    """:func:`batched`'s inverse (on the consts' gradients)."""
    return [c.reshape(-1, *c.shape[2:]) if b else c
            for c, b in zip(consts, batch_flags(prep), strict=True)]


def at(prep: Prepared, consts, i) -> list:
    """:func:`batched` consts as microbatch ``i`` reads them."""
    return [lax.dynamic_index_in_dim(c, i, 0, keepdims=False) if b else c
            for c, b in zip(consts, batch_flags(prep), strict=True)]


def batch_flags(prep: Prepared) -> tuple[bool, ...]:
    """Per constant operand of the stack, whether it holds the batch on its leading axis."""
    return prep.batch_consts or (False,) * prep.full.num_consts


def _operands(prep: Prepared, layer_axes: int, batched_consts: bool = False) -> Callable:
    """``(consts, xs) -> same``, held in the stage plan's specs (identity without one);
    ``batched_consts``: the consts that hold the batch come :func:`batched`."""
    inner = prep.inner
    if inner is None:
        return lambda consts, xs: (consts, xs)
    padded = prep.full.positions is not None
    xs_specs = inner.xs + ((None,) if padded else ())   # a padded stack's flags: left as are
    consts_specs = [lead(sp) if b and batched_consts else sp
                    for sp, b in zip(inner.consts, batch_flags(prep), strict=True)]
    return lambda consts, xs: (
        [constrain(c, sp) for c, sp in zip(consts, consts_specs, strict=True)],
        [constrain(x, lead(sp, layer_axes)) for x, sp in zip(xs, xs_specs, strict=True)])


def inner(prep: Prepared, layer_axes: int = 1):
    """``(consts, mbs, xs) -> same``, held in the stage plan's specs (identity without one);
    ``layer_axes``: the leading axes of a stage's block of each stacked operand. The consts
    that hold the batch come :func:`batched`."""
    operands = _operands(prep, layer_axes, batched_consts=True)
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
    """``loss_and_grads(y, float_ins, i) -> ((loss, aux), (dy, d_float_ins))``: the code
    after the stack on microbatch ``i`` (``rows`` examples) as a float32 scalar, its auxiliary
    outputs (``has_aux``; none without), and its gradient, each input and its cotangent held
    in the head and loss plan's specs. ``kinds``: per flat input, "float" or "other" (passed
    in ``float_ins`` or ``other_ins``) or None (not read)."""
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
        value, *aux = post(ins, [constrain(y, y_spec)] + [None] * n_ys)
        return value.astype(jnp.float32), aux

    def loss_and_grads(y, float_ins, i):
        (value, aux), (dy, d_floats) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            y, float_ins, i)
        return (value, aux), (constrain(dy, y_spec),
                              [constrain(d, sp) for d, sp in zip(d_floats, floats, strict=True)])

    return loss_and_grads


def _aux_avals(prep: Prepared) -> list:
    return [v.aval for v in prep.micro.jaxpr.jaxpr.outvars[1:]]


def aux_start(prep: Prepared, axis) -> list:
    """The accumulators of the loss's auxiliary outputs (:attr:`Prepared.aux`): a sum's (in
    float32 for a 16-bit float, as the loss's) or a batch-independent value's shape, or a
    per-example one's for every microbatch."""
    def start(a, mode):
        if mode is Aux.SUM:
            return jnp.zeros(a.shape, jnp.float32 if low(a.dtype) else a.dtype)
        return jnp.zeros(((prep.microbatches,) if mode is Aux.EXAMPLES else ()) + a.shape,
                         a.dtype)
    return [varying(start(a, mode), axis)
            for a, (mode, _) in zip(_aux_avals(prep), prep.aux, strict=True)]


def aux_add(prep: Prepared, acc: list, aux: list, i, take) -> list:
    """``acc`` with microbatch ``i``'s auxiliary outputs ``aux`` taken where ``take``."""
    out = []
    for a, new, (mode, _) in zip(acc, aux, prep.aux, strict=True):
        if mode is Aux.SUM:
            out.append(a + jnp.where(take, new, jnp.zeros_like(new)).astype(a.dtype))
        elif mode is Aux.EXAMPLES:
            out.append(lax.dynamic_update_index_in_dim(a, jnp.where(take, new, a[i]), i, 0))
        else:
            out.append(jnp.where(take, new, a))
    return out


def _aux_results(prep: Prepared, acc: list) -> list:
    """The auxiliary outputs, from the last stage's accumulators (zeros elsewhere)."""
    out = []
    for a, aval, (mode, weight) in zip(acc, _aux_avals(prep), prep.aux, strict=True):
        total = lax.psum(a.astype(jnp.int32) if a.dtype == jnp.bool_ else up(a), prep.axis)
        total = (total * weight if mode is Aux.SUM else total).astype(aval.dtype)
        out.append(total.reshape(-1, *a.shape[2:]) if mode is Aux.EXAMPLES else total)
    return out


def region_results(prep: Prepared, end: dict, held: Callable, d_mbs, kinds):
    """A backward loop's results inside the region, summed over the stage axis and scaled by
    the loss weight, each held as the stage's or the head's plan holds it: (loss, d_post,
    d_consts, d_mbs, d_xs, aux)."""
    w, axis = prep.loss_weight, prep.axis
    d_consts = [psum(d, axis) if jnp.issubdtype(d.dtype, jnp.inexact) else _none_taken(d)
                for d in end["d_consts"]]
    d_consts, d_mbs, d_xs = held(d_consts, psum(d_mbs, axis), end["d_xs"])
    d_post = psum(jax.tree.map(lambda a: a * w, end["d_post"]), axis)
    d_post = [constrain(d, sp) for d, sp in zip(d_post, _post_specs(prep, kinds)[0], strict=True)]
    return (psum(end["loss"], axis) * w, d_post, d_consts, d_mbs, d_xs,
            _aux_results(prep, end.get("aux", [])))


def _none_taken(d):
    """The gradient of an operand that takes none (an integer mask, a key), as the region
    returns it: zeros, the same on every stage."""
    if jax.dtypes.issubdtype(d.dtype, jax.dtypes.prng_key):
        data = jnp.zeros(jax.random.key_data(d).shape, jnp.uint32)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(d))
    return jnp.zeros(d.shape, d.dtype)


def run_region(body: Callable, prep: Prepared, mesh, flat, kinds, consts, carry, xs):
    """``body(consts, mbs, xs, float_ins, other_ins)`` in ``jax.shard_map`` manual over the
    stage axis, the carry split into microbatches: (loss, d_post, d_consts, d_carry, d_xs,
    aux)."""
    axis = prep.axis
    float_ins = [a for a, k in zip(flat, kinds, strict=True) if k == "float"]
    other_ins = [a for a, k in zip(flat, kinds, strict=True) if k == "other"]
    mbs = microbatches(prep, carry)
    hold = post_held(prep, kinds)

    def held_body(consts, mbs, xs, float_ins, other_ins):
        return body(consts, mbs, xs, *hold(float_ins, other_ins))

    value, d_post, d_consts, d_mbs, d_xs, aux = jax.shard_map(
        held_body, mesh=mesh, in_specs=(P(), P(), P(axis), P(), P()),
        out_specs=(P(), P(), P(), P(), P(axis), P()), axis_names={axis},
    )(consts, mbs, xs, float_ins, other_ins)
    return value, d_post, d_consts, d_mbs.reshape(carry.shape), d_xs, aux
