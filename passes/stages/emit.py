"""Emit a pipelined loss whose gradient runs the schedule.

:func:`pipelined` returns ``f(*flat_args) -> flat outputs`` computing what the traced loss
computes; differentiate it with ``jax.value_and_grad``. Inside, one ``jax.shard_map`` is manual
over the stage axis only (``axis_names={axis}``; other mesh axes stay automatic). Stage ``s``
holds layers ``[s*L/S, (s+1)*L/S)``: the stacked layer operands enter sharded ``P(axis)`` on
the layer axis, and their gradients leave the same way. Ticks run as a ``lax.scan``;
activations and cotangents move with ``lax.ppermute``.

- GPipe: only the layer stack is pipelined; ``pre`` and ``post`` run on the whole batch
  outside the region, and autodiff through the tick loop gives the backward.
- 1F1B and ZB-H1: one loop over the slots of the schedule's table (:func:`.schedules.table`).
  In each slot a stage runs one microbatch's F (its forward, storing each layer's vjp
  residuals; on the last stage also the loss and its cotangent), B (the input gradient, layer
  by layer from the stored residuals, keeping each layer's output cotangent) or W (the weight
  gradient from both), chosen by a ``lax.switch`` on the stage's op. The result is a
  ``jax.custom_vjp`` whose forward runs the whole schedule.

GPipe and the interleaved schedule mask idle ticks with ``jnp.where``. The tabled loop's
switch is device-varying, which is safe because nothing inside a branch communicates over the
stage axis and nothing differentiates through it (a device-varying ``cond`` under ``grad``
can hang: its psum of an invariant operand's cotangent lands in one branch). Invariant
operands are ``pcast`` to varying before per-device derivatives are taken, so each gradient
is summed once at the end.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from autopar.passes.stages import split
from autopar.passes.stages.prepare import Prepared
from autopar.passes.stages.schedules import Op, Schedule, table, ticks


def pipelined(prep: Prepared, mesh) -> Callable:
    """``f(*flat_args) -> list of flat outputs`` of the loss, its layer stack pipelined."""
    if prep.schedule is Schedule.GPIPE:
        return lambda *flat: _gpipe(prep, mesh, flat, _gpipe_stack)
    if prep.schedule is Schedule.INTERLEAVED:
        return lambda *flat: _gpipe(prep, mesh, flat, _circular_stack)
    return _one_f_one_b(prep, mesh)


def _varying(tree, axis):
    return jax.tree.map(lambda a: lax.pcast(a, axis, to="varying"), tree)


def _low(dtype) -> bool:
    """A float type whose all-reduce inside a partly manual shard_map crashes XLA:CPU
    ("Invalid binary instruction opcode copy", jax 0.10.2): reduce it in float32."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def _up(a):
    return a.astype(jnp.float32) if _low(a.dtype) else a


def _psum(tree, axis):
    return jax.tree.map(lambda a: lax.psum(_up(a), axis).astype(a.dtype), tree)


def _varying_as(tree, dtypes, axis):
    """``tree`` (passed in as :func:`_up` made it) varying over ``axis``, in ``dtypes``: the
    transpose of the pcast (a psum of cotangents) then runs in float32."""
    return jax.tree.map(lambda a, d: lax.pcast(a, axis, to="varying").astype(d), tree, dtypes)


def _constrain(a, spec):
    """``a`` held in ``spec``, a ``PartitionSpec`` over the automatic mesh axes (None: left to
    propagation)."""
    return a if spec is None else lax.with_sharding_constraint(a, spec)


def _lead(spec, n: int = 1):
    """``spec`` behind ``n`` unsharded leading axes (microbatches, or a stage's layers)."""
    return None if spec is None else P(*[None] * n, *spec)


def _inner(prep: Prepared, layer_axes: int = 1):
    """``(consts, mbs, xs) -> same``, held in the stage plan's specs (identity without one);
    ``layer_axes``: the leading axes of a stage's block of each stacked operand."""
    inner = prep.inner
    if inner is None:
        return lambda consts, mbs, xs: (consts, mbs, xs)
    return lambda consts, mbs, xs: (
        [_constrain(c, sp) for c, sp in zip(consts, inner.consts, strict=True)],
        _constrain(mbs, _lead(inner.carry)),
        [_constrain(x, _lead(sp, layer_axes)) for x, sp in zip(xs, inner.xs, strict=True)])


def _stage(prep: Prepared) -> Callable:
    stage = split.stage_fn(prep.micro)
    carry = None if prep.inner is None else prep.inner.carry

    def run(consts, x, xs):
        y = stage(consts, [_constrain(x, carry)], xs)[0]
        return _constrain(y, carry)

    return run


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
    stage = _stage(prep)
    shift = [(j, j + 1) for j in range(n_stages - 1)]

    dtypes = ([c.dtype for c in consts], carry.dtype)

    held = _inner(prep)

    def body(consts, mbs, xs):
        s = lax.axis_index(axis)
        consts, mbs, xs = held(consts, mbs, xs)
        consts, mbs = _varying_as((consts, mbs), dtypes, axis)

        def tick(state, t):
            x = jnp.where(s == 0, mbs[jnp.clip(t, 0, n_micro - 1)], state)
            y = stage(consts, x, xs)
            return lax.ppermute(y, axis, shift), y

        start = _varying(jnp.zeros(mbs.shape[1:], mbs.dtype), axis)
        n_ticks = ticks(Schedule.GPIPE, n_stages, n_micro)
        _, ys = lax.scan(tick, start, jnp.arange(n_ticks))
        done = ys[n_stages - 1:]                 # the last stage's outputs, microbatch order
        return _psum(jnp.where(s == n_stages - 1, done, jnp.zeros_like(done)), axis)

    mbs = carry.reshape(n_micro, carry.shape[0] // n_micro, *carry.shape[1:])
    out = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(axis)), out_specs=P(),
                        axis_names={axis})(jax.tree.map(_up, consts), _up(mbs), xs)
    return out.reshape(carry.shape)


def _circular_stack(prep: Prepared, mesh, consts, carry, xs):
    """The interleaved schedule (MaxText's circular pipeline): with v virtual stages the layers
    form S*v chunks, chunk c = r*S + s on stage s; a microbatch goes round the ring v times
    (stage S-1 wraps to 0), waiting at stage 0 in a buffer of M slots between rounds. Needs
    M >= S. The backward is autodiff through the tick loop, as for GPipe."""
    axis, n_stages, n_micro, v = prep.axis, prep.stages, prep.microbatches, prep.virtual_stages
    stage = _stage(prep)
    ring = [(j, (j + 1) % n_stages) for j in range(n_stages)]
    dtypes = ([c.dtype for c in consts], carry.dtype)
    held = _inner(prep, layer_axes=3)

    def body(consts, mbs, xs):
        s = lax.axis_index(axis)
        consts, mbs, xs = held(consts, mbs, xs)
        consts, mbs = _varying_as((consts, mbs), dtypes, axis)
        chunks = [a[:, 0] for a in xs]                    # (v, layers per chunk, ...)

        def tick(c, t):
            state, circ, outs = c
            k = t - s                                     # this stage's work item
            i, r = k % n_micro, jnp.clip(k // n_micro, 0, v - 1)
            x = jnp.where(s == 0, jnp.where(r == 0, mbs[i], circ[i]), state)
            y = stage(consts, x, [lax.dynamic_index_in_dim(a, r, 0, keepdims=False)
                                  for a in chunks])
            done = (k >= 0) & (k < n_micro * v) & (s == n_stages - 1) & (r == v - 1)
            outs = lax.dynamic_update_index_in_dim(outs, jnp.where(done, y, outs[i]), i, 0)
            y_next = lax.ppermute(y, axis, ring)
            circ = lax.dynamic_update_index_in_dim(circ, y_next, (t + 1 - n_stages) % n_micro, 0)
            return (y_next, circ, outs), None

        act = _varying(jnp.zeros(mbs.shape[1:], mbs.dtype), axis)
        buf = _varying(jnp.zeros(mbs.shape, mbs.dtype), axis)
        n_ticks = ticks(Schedule.INTERLEAVED, n_stages, n_micro, v)
        (_, _, outs), _ = lax.scan(tick, (act, buf, buf), jnp.arange(n_ticks))
        return _psum(jnp.where(s == n_stages - 1, outs, jnp.zeros_like(outs)), axis)

    mbs = carry.reshape(n_micro, carry.shape[0] // n_micro, *carry.shape[1:])
    per = prep.full.layers // (n_stages * v)
    chunked = [a.reshape(v, n_stages, per, *a.shape[1:]) for a in xs]
    out = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(None, axis)), out_specs=P(),
                        axis_names={axis})(jax.tree.map(_up, consts), _up(mbs), chunked)
    return out.reshape(carry.shape)


def _is_float(a) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def _no_grad(a):
    return np.zeros(np.shape(a), jax.dtypes.float0)


def _one_f_one_b(prep: Prepared, mesh) -> Callable:
    @jax.custom_vjp
    def loss(*flat):
        return [_one_f_one_b_run(prep, mesh, flat)[0]]

    def fwd(*flat):
        value, grads = _one_f_one_b_run(prep, mesh, flat)
        return [value], grads

    def bwd(grads, cts):
        (ct,) = cts
        return tuple(g if g.dtype == jax.dtypes.float0 else g * ct.astype(g.dtype) for g in grads)

    loss.defvjp(fwd, bwd)
    return loss


def _one_f_one_b_run(prep: Prepared, mesh, flat):
    """(loss, gradient of every flat input; float0 for non-float ones)."""
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
    value, d_post, d_consts, d_carry, d_xs = _one_f_one_b_stack(prep, mesh, flat, kinds,
                                                                consts, carry, xs)
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
    return value, tuple(grads)


def _one_f_one_b_stack(prep: Prepared, mesh, flat, kinds, consts, carry, xs):
    """The tabled schedule's loop (:func:`.schedules.table`): (loss, d_post, d_consts, d_carry,
    d_xs)."""
    axis, n_micro = prep.axis, prep.microbatches
    rows = carry.shape[0] // n_micro
    float_ins = [a for a, k in zip(flat, kinds, strict=True) if k == "float"]
    other_ins = [a for a, k in zip(flat, kinds, strict=True) if k == "other"]
    tab = table(prep.schedule, prep.stages, n_micro)
    held = _inner(prep)

    def body(consts, mbs, xs, float_ins, other_ins):
        consts, mbs, xs = held(consts, mbs, xs)
        consts, float_ins = _varying((consts, float_ins), axis)
        end = _run_table(prep, tab, kinds, rows, (consts, mbs, xs, float_ins, other_ins))
        w = prep.loss_weight
        total = lambda t: _psum(t, axis)  # noqa: E731
        first = lax.axis_index(axis) == 0
        d_mbs = jnp.where(first, end["d_mbs"], jnp.zeros_like(end["d_mbs"]))
        d_consts, d_mbs, d_xs = held(total(end["d_consts"]), total(d_mbs), end["d_xs"])
        return (total(end["loss"]) * w, jax.tree.map(lambda a: a * w, total(end["d_post"])),
                d_consts, d_mbs, d_xs)

    mbs = carry.reshape(n_micro, rows, *carry.shape[1:])
    out = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(), P(axis), P(), P()),
        out_specs=(P(), P(), P(), P(), P(axis)), axis_names={axis},
    )(consts, mbs, xs, float_ins, other_ins)
    value, d_post, d_consts, d_mbs, d_xs = out
    return value, d_post, d_consts, d_mbs.reshape(carry.shape), d_xs


def _layer_fn(prep: Prepared) -> Callable:
    """``layer(consts, x, x_l) -> y``: one layer of the stack (``x_l``: its slice of xs), its
    activation held in the stage plan's spec."""
    layer = split.layer_fn(prep.micro)
    carry = None if prep.inner is None else prep.inner.carry
    return lambda consts, x, x_l: _constrain(layer(consts, [_constrain(x, carry)], x_l)[0], carry)


class _Residuals:
    """One layer's vjp residuals less the operands it reads as they are (the consts and its
    weights, held anyway): what F stores per layer and microbatch, and how B and W rebuild the
    layer's pullback from them. The recipe and tree are taken in the first trace of the
    layer's vjp and reused by later traces of the same layer."""

    def __init__(self, layer: Callable):
        self.layer = layer
        self.tree = None
        self.recipe: list[tuple[bool, int]] = []   # (stored?, index) per pullback leaf

    def forward(self, consts, x, x_l):
        """(y, stored residual leaves)."""
        y, pull = jax.vjp(self.layer, consts, x, x_l)
        leaves, tree = jax.tree.flatten(pull)
        ins = jax.tree.leaves((consts, x_l))
        recipe, stored = [], []
        for leaf in leaves:
            j = next((k for k, a in enumerate(ins) if leaf is a), None)
            recipe.append((j is None, len(stored) if j is None else j))
            if j is None:
                stored.append(leaf)
        if self.tree is None:
            self.tree, self.recipe = tree, recipe
        assert recipe == self.recipe, "a layer's residuals differ between traces"
        return y, stored

    def pullback(self, consts, x_l, stored) -> Callable:
        ins = jax.tree.leaves((consts, x_l))
        return jax.tree.unflatten(self.tree, [stored[j] if kept else ins[j]
                                              for kept, j in self.recipe])


def _run_table(prep: Prepared, tab, kinds, rows: int, fixed) -> dict:
    """Run the table's slots in one ``lax.scan``. Each slot, every stage runs its op's branch
    (a ``lax.switch`` on the stage's op: device-varying, with no collective over the stage
    axis inside, so no device waits on another's branch), then activations move one stage on
    and cotangents one stage back (``ppermute``), each stored where its receiver will read it."""
    axis, n_stages, n_micro = prep.axis, prep.stages, prep.microbatches
    consts, mbs, xs, float_ins, other_ins = fixed
    s = lax.axis_index(axis)
    res = _Residuals(_layer_fn(prep))
    post = split.post_fn(prep.micro)
    n_ys = len(prep.micro.eqn.outvars) - 1
    ops = jnp.asarray(np.array(tab.ops, np.int32))
    micro = jnp.asarray(np.array(tab.micro, np.int32))
    # what arrives at stage s after slot t: stage s-1's F output, stage s+1's B output
    sent_f = np.pad(np.where(np.array(tab.ops) == Op.F, np.array(tab.micro), -1),
                    ((1, 0), (0, 0)), constant_values=-1)[:-1]
    sent_b = np.pad(np.where(np.array(tab.ops) == Op.B, np.array(tab.micro), -1),
                    ((0, 1), (0, 0)), constant_values=-1)[1:]
    sent_f, sent_b = jnp.asarray(sent_f.astype(np.int32)), jnp.asarray(sent_b.astype(np.int32))
    last = s == n_stages - 1

    def stack_forward(x):
        def one(h, x_l):
            return res.forward(consts, h, x_l)
        return lax.scan(one, x, xs)

    def micro_loss(y, float_ins, i):
        its = {"float": iter(float_ins), "other": iter(other_ins), None: iter(())}
        ins = [next(its[k], None) for k in kinds]
        ins = [lax.dynamic_slice_in_dim(a, i * rows, rows, 0) if p and a is not None else a
               for a, p in zip(ins, prep.per_example, strict=True)]
        return post(ins, [y] + [None] * n_ys)[0].astype(jnp.float32)

    def put(buf, value, i):
        return lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i % buf.shape[0], 0)

    def take(buf, i):
        return lax.dynamic_index_in_dim(buf, i % buf.shape[0], 0, keepdims=False)

    def add(acc, new):
        return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, new)

    def forward(x, i):
        """(y, its layers' residuals)."""
        return stack_forward(x)

    def backward(ct, stored):
        """(dx, each layer's output cotangent)."""
        def one(dy, a):
            x_l, r = a
            _, dx, _ = res.pullback(consts, x_l, r)(dy)
            return dx, dy
        return lax.scan(one, ct, (xs, stored), reverse=True)

    def weights(acc, stored, dys):
        """``acc`` (d_consts, d_xs) plus this microbatch's weight gradients."""
        def one(d_consts, a):
            x_l, r, dy = a
            dc, _, dx_l = res.pullback(consts, x_l, r)(dy)
            return add(d_consts, dc), dx_l
        d_consts, d_xs = lax.scan(one, acc[0], (xs, stored, dys))
        return d_consts, add(acc[1], d_xs)

    # Each branch maps (x, ct, stored, dys, sums) -> (sent, ct, stored, dys, sums): what the
    # stage sends this slot, and one microbatch's slot of each buffer, written back outside
    # (unchanged by the branches that do not touch it), so the big buffers never pass
    # through the switch.
    def b_idle(i, x, ct, stored, dys, sums):
        return x, ct, stored, dys, sums

    def b_forward(i, x, ct, stored, dys, sums):
        y, stored = forward(x, i)
        return y.astype(x.dtype), ct, stored, dys, sums

    def b_forward_last(i, x, ct, stored, dys, sums):   # also the loss and its cotangent
        y, stored = forward(x, i)
        loss, (dy, d_post) = jax.value_and_grad(micro_loss, argnums=(0, 1))(y, float_ins, i)
        acc, post_acc, loss_acc = sums
        return (y.astype(x.dtype), (dy * prep.loss_weight).astype(ct.dtype), stored, dys,
                (acc, add(post_acc, d_post), loss_acc + loss))

    def b_backward(i, x, ct, stored, dys, sums):
        dx, new_dys = backward(ct, stored)
        return dx.astype(x.dtype), ct, stored, new_dys.astype(dys.dtype), sums

    def b_weights(i, x, ct, stored, dys, sums):
        acc, post_acc, loss_acc = sums
        return x, ct, stored, dys, (weights(acc, stored, dys), post_acc, loss_acc)

    branches = [b_idle, b_forward, b_backward, b_weights, b_forward_last]  # Op, then last F
    start = _table_state(tab, stack_forward, fixed, axis)

    def slot(c, t):
        op, i = ops[s, t], jnp.maximum(micro[s, t], 0)
        x = jnp.where(s == 0, mbs[i], take(c["inbox_f"], i))
        sums = ((c["d_consts"], c["d_xs"]), c["d_post"], c["loss"])
        sent, ct, stored, dys, sums = lax.switch(
            jnp.where(last & (op == Op.F), len(Op), op), branches, i, x,
            take(c["inbox_b"], i), [take(b, i) for b in c["res"]], take(c["dys"], i), sums)
        (d_consts, d_xs), d_post, loss = sums
        d_mbs = lax.dynamic_update_index_in_dim(
            c["d_mbs"], jnp.where(op == Op.B, sent, c["d_mbs"][i]).astype(c["d_mbs"].dtype), i, 0)
        c = dict(c, inbox_b=put(c["inbox_b"], ct, i), dys=put(c["dys"], dys, i),
                 res=[put(b, r, i) for b, r in zip(c["res"], stored, strict=True)],
                 d_consts=d_consts, d_xs=d_xs, d_post=d_post, loss=loss, d_mbs=d_mbs)
        got_f = lax.ppermute(sent, axis, [(j, j + 1) for j in range(n_stages - 1)])
        got_b = lax.ppermute(sent, axis, [(j + 1, j) for j in range(n_stages - 1)])
        for name, got, j in (("inbox_f", got_f, sent_f[s, t]), ("inbox_b", got_b, sent_b[s, t])):
            k = jnp.maximum(j, 0)
            c[name] = put(c[name], jnp.where(j >= 0, got, take(c[name], k)), k)
        return c, None

    end, _ = lax.scan(slot, start, jnp.arange(tab.slots))
    return end


def _table_state(tab, stack_forward, fixed, axis) -> dict:
    """The tabled loop's carried state, zeros: its buffers (sized by the table), what each
    stage sends, and the sums it accumulates."""
    consts, mbs, xs, float_ins, _ = fixed
    act = jax.ShapeDtypeStruct(mbs.shape[1:], mbs.dtype)
    _, stored = jax.eval_shape(lambda a: stack_forward(_varying(a, axis)), act)
    layers = xs[0].shape[0]

    def zeros(n, shape, dtype):
        return _varying(jnp.zeros((*n, *shape), dtype), axis)

    return dict(
        inbox_f=zeros((tab.waiting_f,), act.shape, act.dtype),
        inbox_b=zeros((tab.waiting_b,), act.shape, act.dtype),
        res=[zeros((tab.held,), r.shape, r.dtype) for r in stored],
        dys=zeros((tab.pending_w, layers), act.shape, act.dtype),
        d_consts=jax.tree.map(jnp.zeros_like, consts), d_xs=jax.tree.map(jnp.zeros_like, xs),
        d_post=jax.tree.map(jnp.zeros_like, float_ins),
        loss=zeros((), (), jnp.float32), d_mbs=zeros((), mbs.shape, mbs.dtype))
