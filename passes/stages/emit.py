"""Emit a pipelined loss whose gradient runs the schedule.

:func:`pipelined` returns ``f(*flat_args) -> flat outputs`` computing what the traced loss
computes; differentiate it with ``jax.value_and_grad``. Inside, one ``jax.shard_map`` is manual
over the stage axis only (``axis_names={axis}``; other mesh axes stay automatic). Stage ``s``
holds layers ``[s*L/S, (s+1)*L/S)`` (balanced and padded where S does not divide L:
:func:`.split.padded`): the stacked layer operands enter sharded ``P(axis)`` on the layer
axis, and their gradients leave the same way. Ticks run in ``lax.scan`` loops; activations
and cotangents move with ``lax.ppermute``.

- GPipe: only the layer stack is pipelined; ``pre`` and ``post`` run on the whole batch
  outside the region, and autodiff through the tick loop gives the backward.
- 1F1B: lockstep ticks; at tick t stage s runs the forward of microbatch t - s and the
  backward (``jax.vjp``, recomputing the stage from a stashed input) of microbatch
  t - 2(S-1) + s. The last stage computes each microbatch's loss and its cotangent in the same
  tick. Each phase (:func:`phases`: warmup forwards, steady, cooldown backwards) is its own
  loop, so no tick computes a slot no stage needs and no tick branches. The result is
  a ``jax.custom_vjp`` whose forward runs the whole schedule.
- ZB-H1: the same ``custom_vjp``, its region the tabled loop of :mod:`.tabled`.

A value made from the batch that the layers read (a padding mask) enters split into
microbatches as the carry is, and each tick's layers read their microbatch's rows of it
(``manual.batched``, ``manual.at``).

Idle slots are masked with ``jnp.where``, never skipped with a device-varying ``lax.cond``
(which can hang under grad). Invariant operands are ``pcast`` to varying before per-device
derivatives are taken, so each gradient is masked per device and summed once at the end.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from autopar.passes.stages import manual, split, tabled
from autopar.passes.stages.prepare import Prepared
from autopar.passes.stages.schedules import Schedule, phases, stash_slots, ticks


def pipelined(prep: Prepared, mesh) -> Callable:
    """``f(*flat_args) -> list of flat outputs`` of the loss, its layer stack pipelined."""
    if prep.schedule is Schedule.GPIPE:
        return lambda *flat: _gpipe(prep, mesh, flat, _gpipe_stack)
    if prep.schedule is Schedule.INTERLEAVED:
        return lambda *flat: _gpipe(prep, mesh, flat, _circular_stack)
    stack = tabled.tabled_stack if prep.schedule is Schedule.ZB_H1 else _one_f_one_b_stack
    return _per_microbatch(prep, mesh, stack)


def _operands(prep: Prepared, ops):
    n = prep.full.num_consts
    return list(ops[:n]), ops[n], list(ops[n + 1:])


def _gpipe(prep: Prepared, mesh, flat, stack):
    consts, carry, xs = _operands(prep, split.pre_fn(prep.full)(*flat))
    n_ys = len(prep.full.eqn.outvars) - 1
    out = stack(prep, mesh, consts, carry, xs)
    return split.post_fn(prep.full)(flat, [out] + [None] * n_ys)


def _gpipe_stack(prep: Prepared, mesh, consts, carry, xs):
    axis, n_stages, n_micro = prep.axis, prep.stages, prep.microbatches
    stage = manual.stage(prep, recompute=True)
    shift = [(j, j + 1) for j in range(n_stages - 1)]

    dtypes = ([c.dtype for c in consts], carry.dtype)

    held = manual.inner(prep)

    def body(consts, mbs, xs):
        s = lax.axis_index(axis)
        consts, mbs, xs = held(consts, mbs, xs)
        consts, mbs = manual.varying_as((consts, mbs), dtypes, axis)

        def tick(state, t):
            x = jnp.where(s == 0, mbs[jnp.clip(t, 0, n_micro - 1)], state)
            y = stage(manual.at(prep, consts, jnp.clip(t - s, 0, n_micro - 1)), x, xs)
            return lax.ppermute(y, axis, shift), y

        start = manual.varying(jnp.zeros(mbs.shape[1:], mbs.dtype), axis)
        n_ticks = ticks(Schedule.GPIPE, n_stages, n_micro)
        _, ys = lax.scan(tick, start, jnp.arange(n_ticks))
        done = ys[n_stages - 1:]                 # the last stage's outputs, microbatch order
        return manual.psum(jnp.where(s == n_stages - 1, done, jnp.zeros_like(done)), axis)

    mbs = manual.microbatches(prep, carry)
    out = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(axis)), out_specs=P(),
                        axis_names={axis})(jax.tree.map(manual.up, manual.batched(prep, consts)),
                                           manual.up(mbs), xs)
    return out.reshape(carry.shape)


def _circular_stack(prep: Prepared, mesh, consts, carry, xs):
    """The interleaved schedule (MaxText's circular pipeline): with v virtual stages the layers
    form S*v chunks, chunk c = r*S + s on stage s; a microbatch goes round the ring v times
    (stage S-1 wraps to 0), waiting at stage 0 in a buffer of M slots between rounds. Needs
    M >= S. The backward is autodiff through the tick loop, as for GPipe."""
    axis, n_stages, n_micro, v = prep.axis, prep.stages, prep.microbatches, prep.virtual_stages
    stage = manual.stage(prep, recompute=True, chunked=True)
    ring = [(j, (j + 1) % n_stages) for j in range(n_stages)]
    dtypes = ([c.dtype for c in consts], carry.dtype)
    held = manual.inner(prep, layer_axes=3)

    def body(consts, mbs, xs):
        s = lax.axis_index(axis)
        consts, mbs, xs = held(consts, mbs, xs)
        consts, mbs = manual.varying_as((consts, mbs), dtypes, axis)

        def tick(c, t):
            state, circ, outs = c
            k = t - s                                     # this stage's work item
            i, r = k % n_micro, jnp.clip(k // n_micro, 0, v - 1)
            x = jnp.where(s == 0, jnp.where(r == 0, mbs[i], circ[i]), state)
            y = stage(manual.at(prep, consts, i), x, xs, r)
            done = (k >= 0) & (k < n_micro * v) & (s == n_stages - 1) & (r == v - 1)
            outs = lax.dynamic_update_index_in_dim(outs, jnp.where(done, y, outs[i]), i, 0)
            y_next = lax.ppermute(y, axis, ring)
            circ = lax.dynamic_update_index_in_dim(circ, y_next, (t + 1 - n_stages) % n_micro, 0)
            return (y_next, circ, outs), None

        act = manual.varying(jnp.zeros(mbs.shape[1:], mbs.dtype), axis)
        buf = manual.varying(jnp.zeros(mbs.shape, mbs.dtype), axis)
        n_ticks = ticks(Schedule.INTERLEAVED, n_stages, n_micro, v)
        (_, _, outs), _ = lax.scan(tick, (act, buf, buf), jnp.arange(n_ticks))
        return manual.psum(jnp.where(s == n_stages - 1, outs, jnp.zeros_like(outs)), axis)

    mbs = manual.microbatches(prep, carry)
    per = prep.full.stacked // (n_stages * v)
    chunked = [a.reshape(v, n_stages, per, *a.shape[1:]) for a in xs]
    out = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(None, axis)), out_specs=P(),
                        axis_names={axis})(jax.tree.map(manual.up, manual.batched(prep, consts)),
                                           manual.up(mbs), chunked)
    return out.reshape(carry.shape)


def _is_float(a) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def _no_grad(a):
    return np.zeros(np.shape(a), jax.dtypes.float0)


def _per_microbatch(prep: Prepared, mesh, stack: Callable) -> Callable:
    """The loss of a schedule that differentiates each microbatch itself (1F1B, ZB-H1):
    ``stack`` runs the region; a ``jax.custom_vjp`` whose forward runs the whole schedule."""
    @jax.custom_vjp
    def loss(*flat):
        value, aux, _ = _per_microbatch_run(prep, mesh, flat, stack)
        return [value, *aux]

    def fwd(*flat):
        value, aux, grads = _per_microbatch_run(prep, mesh, flat, stack)
        return [value, *aux], grads

    def bwd(grads, cts):   # the auxiliary outputs (has_aux) are not differentiated
        ct = cts[0]
        return tuple(g if g.dtype == jax.dtypes.float0 else g * ct.astype(g.dtype) for g in grads)

    loss.defvjp(fwd, bwd)
    return loss


def _per_microbatch_run(prep: Prepared, mesh, flat, stack: Callable):
    """(loss, its auxiliary outputs, gradient of every flat input; float0 for non-float
    ones)."""
    is_f = [_is_float(a) for a in flat]
    floats = [a for a, f in zip(flat, is_f, strict=True) if f]

    def pre_of_floats(*fl):
        it = iter(fl)
        return split.pre_fn(prep.full)(*[next(it) if f else a for a, f in zip(flat, is_f)])

    ops, pre_vjp = jax.vjp(pre_of_floats, *floats)
    consts, carry, xs = _operands(prep, ops)
    # the loss after the layers reads only some inputs: only those enter the pipeline region
    reads = split.post_reads(prep.micro)[0]
    kinds = [None if not r else "float" if f else "other" for r, f in zip(reads, is_f)]
    value, d_post, d_consts, d_carry, d_xs, aux = stack(prep, mesh, flat, kinds, consts, carry,
                                                        xs)
    d_ops = [d if _is_float(o) else _no_grad(o)
             for o, d in zip(ops, d_consts + [d_carry] + d_xs, strict=True)]
    d_pre = iter(pre_vjp(d_ops))
    d_post = iter(d_post)
    grads = []
    for a, kind in zip(flat, kinds, strict=True):
        if not _is_float(a):
            grads.append(_no_grad(a))
        else:
            grads.append(next(d_pre) + next(d_post) if kind == "float" else next(d_pre))
    # summed in float32 over the microbatches; returned in the loss's own type
    value = value.astype(prep.full.jaxpr.out_avals[0].dtype)
    return value, aux, tuple(grads)


def _one_f_one_b_stack(prep: Prepared, mesh, flat, kinds, consts, carry, xs):
    axis, n_micro = prep.axis, prep.microbatches
    rows = carry.shape[0] // n_micro
    tick = _one_f_one_b_tick(prep, kinds, rows)

    held = manual.inner(prep)

    def body(consts, mbs, xs, float_ins, other_ins):
        consts, mbs, xs = held(consts, mbs, xs)
        consts, float_ins = manual.varying((consts, float_ins), axis)
        act = manual.varying(jnp.zeros(mbs.shape[1:], mbs.dtype), axis)
        zeros = lambda t: jax.tree.map(jnp.zeros_like, t)  # noqa: E731
        start = dict(fwd=act, bwd=act,
                     stash=manual.varying(jnp.zeros((stash_slots(prep.stages), *act.shape), act.dtype),
                                    axis),
                     d_xs=zeros(xs), d_consts=zeros(consts), d_post=zeros(float_ins),
                     d_mbs=manual.varying(jnp.zeros_like(mbs), axis),
                     loss=manual.varying(jnp.zeros((), jnp.float32), axis),
                     aux=manual.aux_start(prep, axis))
        # the layers read these operands only narrowed: narrow them once, not per microbatch
        # (their gradients still accumulate in the operands' own dtype, in d_xs)
        narrowed = [x if d is None else x.astype(d)
                    for x, d in zip(xs, split.narrowed_xs(prep.micro), strict=True)]
        fixed = (consts, mbs, narrowed, float_ins, other_ins)
        end = start
        for first, stop, forward, backward in phases(prep.stages, n_micro):
            if stop > first:  # one loop per phase: its ticks run no branch
                one = functools.partial(tick, fixed, forward=forward, backward=backward)
                end = _tick_loop(one, end, first, stop)
        return manual.region_results(prep, end, held, end["d_mbs"], kinds)

    value, d_post, d_consts, d_carry, d_xs, aux = manual.run_region(
        body, prep, mesh, flat, kinds, manual.batched(prep, consts), carry, xs)
    return value, d_post, manual.unbatched(prep, d_consts), d_carry, d_xs, aux


def _tick_loop(one: Callable, carry, first: int, stop: int):
    """``carry`` after ``one(carry, t)`` for t in [first, stop), as one ``while`` loop. XLA
    inlines a loop of one trip, and an inlined backward does not share the other loops'
    buffers (docs/pipeline.md): that loop's bound is hidden behind an optimization barrier, so
    XLA keeps it as a loop of unknown trip count."""
    if stop - first > 1:
        return lax.scan(lambda c, t: (one(c, t), None), carry, jnp.arange(first, stop))[0]
    hidden = lax.optimization_barrier(jnp.int32(stop))
    return lax.fori_loop(jnp.int32(first), hidden, lambda t, c: one(c, t), carry)


def _pullback(stage: Callable, consts, x, xs, ct):
    """``stage``'s cotangents at ``ct`` for (consts, x, xs): zeros of their own type for
    the operands that are not floats (integer masks, positions), which take none."""
    is_c, is_x = [_is_float(a) for a in consts], [_is_float(a) for a in xs]

    def merged(new, old, flags):
        it = iter(new)
        return [next(it) if f else a for a, f in zip(old, flags, strict=True)]

    def of_floats(fc, x, fx):
        return stage(merged(fc, consts, is_c), x, merged(fx, xs, is_x))

    _, pull = jax.vjp(of_floats, [a for a, f in zip(consts, is_c) if f], x,
                      [a for a, f in zip(xs, is_x) if f])
    d_fc, dx, d_fx = pull(ct)
    return (merged(d_fc, [jnp.zeros_like(a) for a in consts], is_c), dx,
            merged(d_fx, [jnp.zeros_like(a) for a in xs], is_x))


def _one_f_one_b_tick(prep: Prepared, kinds, rows: int) -> Callable:
    axis, n_stages, n_micro = prep.axis, prep.stages, prep.microbatches
    n_slots = stash_slots(n_stages)
    stage = manual.stage(prep)
    fwd_pairs = [(j, j + 1) for j in range(n_stages - 1)]
    bwd_pairs = [(j + 1, j) for j in range(n_stages - 1)]

    batch_flags = manual.batch_flags(prep)

    def masked_add(acc, new, keep):   # an operand that is not a float takes no gradient
        return jax.tree.map(lambda a, b: a + jnp.where(keep, b, jnp.zeros_like(b))
                            if _is_float(a) else a, acc, new)

    def tick(fixed, c, t, *, forward: bool, backward: bool):
        """One tick; ``forward``/``backward``: whether any stage has that slot's work in this
        phase (warmup: forward only, steady: both, cooldown: backward only)."""
        consts, mbs, xs, float_ins, other_ins = fixed
        s = lax.axis_index(axis)
        last = s == n_stages - 1
        out = dict(c)
        if forward:  # microbatch t - s
            i_f = t - s
            ok_f = (i_f >= 0) & (i_f < n_micro)
            j_f = jnp.clip(i_f, 0, n_micro - 1)
            x = jnp.where(s == 0, mbs[j_f], c["fwd"])
            y = stage(manual.at(prep, consts, j_f), x, xs)
            slot = i_f % n_slots
            out["stash"] = lax.dynamic_update_index_in_dim(
                c["stash"], jnp.where(ok_f, x, c["stash"][slot]), slot, 0)
            out["fwd"] = lax.ppermute(y, axis, fwd_pairs)
        ct = c["bwd"]
        if forward and backward:  # the last stage's loss: only in the steady phase
            (loss, aux), (dy, d_post) = manual.micro_loss_and_grads(
                prep, kinds, rows, other_ins)(y, float_ins, j_f)
            take = ok_f & last
            out["d_post"] = masked_add(c["d_post"], d_post, take)
            out["loss"] = c["loss"] + jnp.where(take, loss, 0.0)
            out["aux"] = manual.aux_add(prep, c["aux"], aux, j_f, take)
            ct = jnp.where(last, (dy * prep.loss_weight).astype(ct.dtype), ct)
        if backward:  # microbatch t - 2(S-1) + s (the same one on the last stage)
            i_b = t - 2 * (n_stages - 1) + s
            ok_b = (i_b >= 0) & (i_b < n_micro)
            j_b = jnp.clip(i_b, 0, n_micro - 1)
            d_consts, dx, d_xs = _pullback(stage, manual.at(prep, consts, j_b),
                                           out["stash"][i_b % n_slots], xs, ct)
            out["d_mbs"] = lax.dynamic_update_index_in_dim(
                c["d_mbs"], jnp.where(ok_b & (s == 0), dx, c["d_mbs"][j_b]), j_b, 0)
            out["bwd"] = lax.ppermute(dx, axis, bwd_pairs)
            out["d_xs"] = masked_add(c["d_xs"], d_xs, ok_b)
            # a float const that holds the batch: this microbatch's rows of its gradient
            out["d_consts"] = [
                lax.dynamic_update_index_in_dim(a, jnp.where(ok_b, d, a[j_b]), j_b, 0)
                if b and _is_float(a) else masked_add(a, d, ok_b)
                for a, d, b in zip(c["d_consts"], d_consts, batch_flags, strict=True)]
        return out

    return tick
