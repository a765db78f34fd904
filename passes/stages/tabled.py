"""The tabled schedules' loop (ZB-H1): one ``lax.scan`` over the slots of
:func:`.schedules.table`.

In each slot a stage runs one microbatch's F (its forward through the stage's layers, storing
each layer's vjp residuals; on the last stage also the loss and its cotangent), B (the input
gradient, layer by layer from the stored residuals, keeping each layer's output cotangent), W
(the weight gradient from both), or idles, by a ``lax.switch`` on the stage's op. The switch is
device-varying, which is safe here: nothing inside a branch communicates over the stage axis,
and nothing differentiates through it (a device-varying ``cond`` under ``grad`` can hang: its
psum of an invariant operand's cotangent lands in one branch). After every slot activations
move one stage on and cotangents one stage back (``ppermute``) into buffers sized by the table.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import partial_eval as pe

from autopar.passes.stages import manual
from autopar.passes.stages.prepare import Prepared
from autopar.passes.stages.schedules import Op, table


def tabled_stack(prep: Prepared, mesh, flat, kinds, consts, carry, xs):
    """The tabled schedule's loop (:func:`.schedules.table`): (loss, d_post, d_consts, d_carry,
    d_xs, aux)."""
    axis, n_micro = prep.axis, prep.microbatches
    rows = carry.shape[0] // n_micro
    tab = table(prep.schedule, prep.stages, n_micro)
    held = manual.inner(prep)

    def body(consts, mbs, xs, float_ins, other_ins):
        consts, mbs, xs = held(consts, mbs, xs)
        consts, float_ins = manual.varying((consts, float_ins), axis)
        end = _run_table(prep, tab, kinds, rows, (consts, mbs, xs, float_ins, other_ins))
        first = lax.axis_index(axis) == 0
        d_mbs = jnp.where(first, end["d_mbs"], jnp.zeros_like(end["d_mbs"]))
        return manual.region_results(prep, end, held, d_mbs, kinds)

    return manual.run_region(body, prep, mesh, flat, kinds, consts, carry, xs)


class _Residuals:
    """One layer's vjp residuals less the operands it reads as they are (the consts and its
    weights, held anyway) and those made from them alone (a weight cast to the compute type,
    made again by B and W): what F stores per layer and microbatch, and how B and W rebuild
    the layer's pullback from them. The recipe and tree are taken in the first trace of the
    layer's vjp and reused by later traces of the same layer."""

    def __init__(self, layer: Callable):
        self.layer = layer
        self.tree = None
        self.recipe: list[tuple[_Leaf, int]] = []   # (where from, index) per pullback leaf
        self.again: _Again | None = None

    def forward(self, consts, x, x_l):
        """(y, stored residual leaves)."""
        y, pull = jax.vjp(self.layer, consts, x, x_l)
        leaves, tree = jax.tree.flatten(pull)
        ins = jax.tree.leaves((consts, x_l))
        if self.again is None:
            self.again = _Again.of(self.layer, consts, x, x_l, leaves, ins)
        recipe, stored = [], []
        for n, leaf in enumerate(leaves):
            j = next((k for k, a in enumerate(ins) if leaf is a), None)
            if j is not None:
                recipe.append((_Leaf.OPERAND, j))
            elif n in self.again.leaves:
                recipe.append((_Leaf.AGAIN, self.again.leaves.index(n)))
            else:
                recipe.append((_Leaf.STORED, len(stored)))
                stored.append(leaf)
        if self.tree is None:
            self.tree, self.recipe = tree, recipe
        assert recipe == self.recipe, "a layer's residuals differ between traces"
        return y, stored

    def pullback(self, consts, x_l, stored) -> Callable:
        ins = jax.tree.leaves((consts, x_l))
        source = {_Leaf.OPERAND: ins, _Leaf.STORED: stored, _Leaf.AGAIN: self.again.make(ins)}
        return jax.tree.unflatten(self.tree, [source[kind][j] for kind, j in self.recipe])


class _Leaf(enum.Enum):
    OPERAND = "an operand of the layer"
    STORED = "stored by F"
    AGAIN = "made again from the weights"


@dataclass(frozen=True)
class _Again:
    """The residual leaves a layer makes from its consts and weights alone, not from its
    activation (a weight cast to the compute type): B and W make them again rather than F
    storing them per microbatch."""

    jaxpr: jcore.ClosedJaxpr  # (the operands it reads) -> those leaves
    reads: tuple[int, ...]    # the operands it reads: positions among the (consts, x_l) leaves
    leaves: tuple[int, ...]   # the leaves it makes: positions among the pullback's

    @staticmethod
    def of(layer: Callable, consts, x, x_l, leaves, ins) -> _Again:
        """Found in ``layer``'s vjp at (consts, x, x_l), whose pullback has ``leaves``;
        leaves that are operands themselves (among ``ins``, the (consts, x_l) leaves) are not
        made again."""
        def residuals(consts, x, x_l):
            return jax.tree.leaves(jax.vjp(layer, consts, x, x_l)[1])

        closed = jax.make_jaxpr(residuals)(consts, x, x_l)
        if any(isinstance(c, jax.core.Tracer) for c in closed.consts):
            return _Again(closed, (), ())   # it closes over traced values: store everything
        jaxpr = closed.jaxpr
        n_consts = len(jax.tree.leaves(consts))
        assert len(jax.tree.leaves(x)) == 1, "a layer's activation is one array"
        from_x = {jaxpr.invars[n_consts]}
        for eqn in jaxpr.eqns:
            if any(v in from_x for v in eqn.invars if isinstance(v, jcore.Var)):
                from_x.update(eqn.outvars)
        made = tuple(n for n, (v, leaf) in enumerate(zip(jaxpr.outvars, leaves, strict=True))
                     if isinstance(v, jcore.Var) and v not in from_x
                     and v not in jaxpr.invars and not any(leaf is a for a in ins))
        again, used = pe.dce_jaxpr(jaxpr, [n in made for n in range(len(jaxpr.outvars))])
        reads = tuple(k if k < n_consts else k - 1 for k, u in enumerate(used) if u)
        return _Again(jcore.ClosedJaxpr(again, closed.consts), reads, made)

    def make(self, ins: list) -> list:
        """The leaves, from the (consts, x_l) leaves ``ins``."""
        if not self.leaves:
            return []
        return jcore.jaxpr_as_fun(self.jaxpr)(*(ins[k] for k in self.reads))


def _run_table(prep: Prepared, tab, kinds, rows: int, fixed) -> dict:
    """Run the table's slots in one ``lax.scan``. Each slot, every stage runs its op's branch
    (a ``lax.switch`` on the stage's op: device-varying, with no collective over the stage
    axis inside, so no device waits on another's branch), then activations move one stage on
    and cotangents one stage back (``ppermute``), each stored where its receiver will read it."""
    axis, n_stages = prep.axis, prep.stages
    consts, mbs, xs, float_ins, other_ins = fixed
    s = lax.axis_index(axis)
    res = _Residuals(manual.layer(prep))
    loss_and_grads = manual.micro_loss_and_grads(prep, kinds, rows, other_ins)
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
        (loss, _), (dy, d_post) = loss_and_grads(y, float_ins, i)   # no has_aux here
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
    # The residual buffers start as zeros computed from one forward's residuals, so the
    # partitioner gives each the sharding its residual has (a fresh zeros array would be
    # replicated over the other mesh axes, and the residuals with it).
    _, stored = stack_forward(manual.varying(jnp.zeros(act.shape, act.dtype), axis))
    layers = xs[0].shape[0]

    def zeros(n, shape, dtype):
        return manual.varying(jnp.zeros((*n, *shape), dtype), axis)

    def like(r, n):
        return jnp.broadcast_to((r * jnp.zeros((), r.dtype))[None], (n, *r.shape))

    return dict(
        inbox_f=zeros((tab.waiting_f,), act.shape, act.dtype),
        inbox_b=zeros((tab.waiting_b,), act.shape, act.dtype),
        res=[like(r, tab.held) for r in stored],
        dys=zeros((tab.pending_w, layers), act.shape, act.dtype),
        d_consts=jax.tree.map(jnp.zeros_like, consts), d_xs=jax.tree.map(jnp.zeros_like, xs),
        d_post=jax.tree.map(jnp.zeros_like, float_ins),
        loss=zeros((), (), jnp.float32), d_mbs=zeros((), mbs.shape, mbs.dtype))
