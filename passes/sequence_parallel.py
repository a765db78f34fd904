"""Sequence-parallel attention: the strategies of ``passes.attention``'s primitives and the
``jax.shard_map`` regions that run the rewritten ones.

Each mesh axis takes one role for an attention node: replicate, split the batch, split the
heads (tensor parallel), or carry one of the two rewrites, each at most once (splitting the
query sequence alone, keys gathered, is left out: XLA partitions the kernels' block loop over
a split sequence by gathering in every step, 438 GB on the wire for the (2, 4) 32k Llama):

* **Ulysses** over axes ``u`` (one or more, as one group): operands arrive sequence-sharded;
  an all-to-all turns them head-sharded (the group must divide the kv heads), the whole
  sequence is attended, and an all-to-all turns the results back.
* **Ring** over axis ``r``: each device keeps its query rows; K, V and the mask rotate around
  the axis with ``ppermute``, merged by their log-sum-exp (online softmax). The backward
  rotates them again with their dK, dV accumulators, which arrive home after a full turn.

Both may share one node on two axes (Ulysses inside, ring across: LoongTrain's head x
context). A rewrite is one region, manual over its axes; other axes stay automatic. Every
strategy is priced by ``cost_model.attention.attention_cost``. Importing this module registers
the builder (``passes.strategies.STRATEGY_BUILDERS``) and emitters (``passes.emit.REWRITES``).
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from autopar.cost_model.attention import (AttentionShape, AttentionSplit, attention_cost,
                                          split_work_exact)
from autopar.cost_model.spec import Spec
from autopar.errors import ArgumentError
from autopar.passes import attention as attn
from autopar.passes.emit import REWRITES
from autopar.passes.ir import itemsize
from autopar.passes.strategies import (STRATEGY_BUILDERS, MeshContext, Rewrite, RewriteKind,
                                       Strategy)

# Roles of one mesh axis.
_R, _B, _H, _U, _G = "replicate", "batch", "heads", "ulysses", "ring"


def _shape(node, mesh: MeshContext) -> AttentionShape:
    (b, s, h, d), dtype = node.in_avals[0]
    return AttentionShape(batch=b, seq=s, heads=h, kv_heads=node.in_avals[1][0][2],
                          head_dim=d, itemsize=itemsize(dtype),
                          wire_itemsize=mesh.dtype_wire_itemsize(dtype),
                          backward=node.primitive is attn.attention_bwd_p,
                          causal=node.params["causal"])


def _split(roles: dict[str, str], sizes: dict[str, int]) -> AttentionSplit:
    def prod(role):
        return math.prod(sizes[a] for a, r in roles.items() if r == role)
    ulysses = tuple(a for a, r in roles.items() if r == _U)
    ring = [(a, sizes[a]) for a, r in roles.items() if r == _G]
    return AttentionSplit(batch=prod(_B), heads=prod(_H),
                          ulysses=(ulysses, prod(_U)) if ulysses else None,
                          ring=ring[0] if ring else None)


def _allowed(roles: tuple[str, ...]) -> bool:
    """One ring axis at most (Ulysses may group several); Ulysses splits the heads, so no
    heads axis."""
    return roles.count(_G) <= 1 and not (_U in roles and _H in roles)


_ROLE = {"ulysses": _U, "ring": _G, "heads": _H, "batch": _B}
#: A kind forced alone, without axes: the roles it allows.
_ALONE = {"ulysses": lambda roles: _U in roles, "ring": lambda roles: _G in roles,
          "heads": lambda roles: _H in roles and not set(roles) & {_U, _G},
          "batch": lambda roles: set(roles) <= {_B, _R} and _B in roles,
          "replicated": lambda roles: set(roles) == {_R}}


def _forced(by_axis: dict[str, str], forced) -> bool:
    """Whether the roles hold every term of ``forced`` (:func:`attention.parse_strategy`):
    with axes named, exactly those axes take the kind's role; a kind alone without axes
    allows what :data:`_ALONE` says, one of several is present."""
    roles = tuple(by_axis.values())
    for kind, axes in forced:
        if axes:
            if {a for a, r in by_axis.items() if r == _ROLE[kind]} != set(axes):
                return False
        elif not (_ALONE[kind](roles) if len(forced) == 1 else _ROLE[kind] in roles):
            return False
    return True


def _specs(roles: dict[str, str], backward: bool):
    """(in_specs, out_specs, the region's sequence axes) of the roles (axes in mesh order)."""
    def axes(*wanted):
        return tuple(a for a, r in roles.items() if r in wanted)
    b, h, seq = axes(_B), axes(_H), axes(_U, _G)
    q = Spec((b, seq, h, ()))
    kv = Spec((b, seq, h, ()))
    mask = Spec((b, seq))
    lse = Spec((b, h, seq))
    if backward:
        return (q, kv, kv, mask, q, lse, q), (q, kv, kv), seq
    return (q, kv, kv, mask), (q, lse), seq


def attention_strategies(node, graph, mesh: MeshContext) -> list[Strategy]:
    """Every role assignment of the mesh axes the shapes allow, priced; only those of the
    forced strategy (the node's ``strategy`` or the plan's ``attention``) when one is."""
    shape = _shape(node, mesh)
    forced = node.params.get("strategy") or mesh.attention
    per_call = bool(node.params.get("strategy"))
    terms = checked_terms(forced, mesh.axis_names, per_call)
    sizes = dict(mesh.axis_sizes)
    dtype = node.in_avals[0][1]
    out = []
    for roles in itertools.product((_R, _B, _H, _U, _G), repeat=len(mesh.axis_names)):
        by_axis = dict(zip(mesh.axis_names, roles))
        if not (_allowed(roles) and _forced(by_axis, terms)):
            continue
        split = _split(by_axis, sizes)
        if not split_work_exact(shape, split) or any(
                sizes[a] == 1 and r != _R for a, r in by_axis.items()):
            continue
        ins, outs, manual = _specs(by_axis, shape.backward)
        cost = attention_cost(shape, split, mesh.profile, mesh.levels, dtype,
                              _kernel_block(shape, split))
        rewrite = _rewrite(split, manual, tuple(a for a, r in by_axis.items() if r == _B),
                           tuple(a for a, r in by_axis.items() if r == _H))
        out.append(Strategy(ins, outs, cost.flops, cost.compute_s,
                            sum(c.time_s(mesh.levels) for c in cost.collectives),
                            cost.collectives, rewrite, cost.scratch_bytes))
    if not out:
        raise ArgumentError(_no_strategy_message(shape, forced, terms, sizes, per_call))
    return out


def checked_terms(forced: str | None, axis_names, per_call: bool = False) -> tuple:
    """``forced`` read (:func:`attention.parse_strategy`), its axes checked against the
    mesh's."""
    if forced is None:
        return ()
    name = "strategy" if per_call else "attention"
    terms = attn.parse_strategy(forced, name)
    unknown = [a for _, axes in terms for a in axes if a not in axis_names]
    if unknown:
        raise ArgumentError(f"`{name}={forced!r}` names mesh axis `{unknown[0]}`, which the mesh "
                            f"lacks (its axes: {', '.join(axis_names)}); name one of them.")
    return terms


def _kernel_block(shape: AttentionShape, split: AttentionSplit) -> int:
    """The keys per block the kernel picks: it sees its operands local over a region's manual
    axes only (whole over the others, as XLA partitions them), and whole without a region."""
    u = split.ulysses[1] if split.ulysses else 1
    if not (split.ulysses or split.ring):
        return attn.block_size(shape.seq, shape.batch * shape.heads)
    return attn.block_size(shape.seq // split.seq * u, shape.batch * shape.heads // u)


def _rewrite(split: AttentionSplit, manual: tuple[str, ...], batch: tuple[str, ...],
             heads: tuple[str, ...]) -> Rewrite | None:
    """The region of a sequence-parallel split over ``manual`` (the sequence axes), also
    manual over the ``batch`` and ``heads`` axes (left automatic, XLA gathers the heads)."""
    if not manual:
        return None
    kind = RewriteKind.RING_ATTENTION if split.ring else RewriteKind.ULYSSES_ATTENTION
    return Rewrite(kind, manual, (("ulysses", split.ulysses[0] if split.ulysses else None),
                                  ("ring", split.ring[0] if split.ring else None),
                                  ("batch", batch), ("heads", heads)))


def _no_strategy_message(shape: AttentionShape, forced: str, terms, sizes,
                         per_call: bool) -> str:
    """Why no strategy of the ``forced`` kind fits, and the fix for that reason: the
    sequence's length where an axis (one named, if any are) does not divide it, else the
    kind's own constraint (``per_call``: forced by ``autopar.attention(strategy=...)``, else
    by the plan's ``attention=``)."""
    asked = "strategy" if per_call else "attention"
    kind = terms[0][0] if len(terms) == 1 else None
    named = {a for _, axes in terms for a in axes}
    why, seq_short = [], False
    for axis, n in sizes.items():
        if named and axis not in named:
            continue
        if shape.seq % n:
            seq_short = True
            why.append(f"the sequence length {shape.seq} is not a multiple of mesh axis "
                       f"`{axis}` ({n})")
        elif kind in ("ulysses", "heads") and shape.kv_heads % n:
            why.append(f"mesh axis `{axis}` ({n}) does not divide the {shape.kv_heads} kv heads")
        elif kind == "batch" and shape.batch % n:
            why.append(f"mesh axis `{axis}` ({n}) does not divide the batch {shape.batch}")
    if seq_short:
        fix = "pad the sequence to a multiple of the axis size"
    else:
        fix = {"ulysses": f"use `{asked}=\"ring\"` (any axis that divides the sequence) or a "
                          "mesh axis that divides the kv heads",
               "heads": f"use a mesh axis that divides the kv heads, or `{asked}=\"ring\"`",
               "batch": f"use a batch the mesh axis divides, or `{asked}=\"ring\"`"}.get(
            kind, "choose another strategy")
    return (f"no `{forced}` attention strategy fits q [batch={shape.batch}, seq={shape.seq}, "
            f"heads={shape.heads}] with {shape.kv_heads} kv heads on mesh {sizes}: "
            f"{'; '.join(why) or 'no axis can take it'}. Fix: {fix}, or leave the strategy to "
            f"autopar (`{asked}=None`).")


STRATEGY_BUILDERS[attn.attention_fwd_p] = attention_strategies
STRATEGY_BUILDERS[attn.attention_bwd_p] = attention_strategies


# ----------------------------------------------------------------------------- regions

def positions(seq: int, seq_axes, sizes: dict, index: dict, gathered: tuple[str, ...] = ()):
    """Global positions of a device's rows: the sequence is cut into chunks over
    ``seq_axes`` (major to minor); the device holds the chunk at ``index`` (axis -> index),
    or, over the ``gathered`` axes, every chunk along them in order (the first major, as an
    all-to-all over them concatenates)."""
    c = seq // math.prod(sizes[a] for a in seq_axes)
    strides = {a: math.prod(sizes[b] for b in seq_axes[i + 1:]) for i, a in enumerate(seq_axes)}
    base = sum(index[a] * strides[a] for a in seq_axes if a not in gathered)
    chunks = jnp.reshape(base, (1,)).astype(jnp.int32)
    for a in gathered:
        chunks = (chunks[:, None]
                  + jnp.arange(sizes[a], dtype=jnp.int32)[None, :] * strides[a]).reshape(-1)
    return (chunks[:, None] * c + jnp.arange(c, dtype=jnp.int32)[None, :]).reshape(-1)


class _Region:
    """What one region's body needs: its axes and their sizes, the roles, the settings."""

    def __init__(self, mesh, rewrite: Rewrite, *, causal: bool, scale: float, seq: int):
        p = dict(rewrite.params)
        self.seq_axes = rewrite.axes
        # the region is manual over these too: each device runs its batch rows and heads
        self.batch_axes, self.head_axes = p.get("batch", ()), p.get("heads", ())
        u, self.r = p["ulysses"], p["ring"]
        self.u = None if u is None else (u,) if isinstance(u, str) else tuple(u)
        self.sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
        self.causal, self.scale, self.seq = causal, scale, seq
        self.mesh = mesh
        # A causal ring alone runs on a striped sequence (device d holds d, d+n, ...) so that
        # every step is a lower triangle: the same work on every device, half skipped.
        self.striped = causal and self.r is not None and self.u is None
        self.triangular = causal and not (self.u and self.r)

    def index(self):
        return {a: lax.axis_index(a) for a in self.seq_axes}

    def q_positions(self, index):
        return self.k_positions(index, 0)

    def k_positions(self, index, step):
        if self.r is not None:
            n = self.sizes[self.r]
            index = {**index, self.r: (index[self.r] - step) % n}
        if self.striped:
            n = self.sizes[self.r]
            return jnp.arange(self.seq // n, dtype=jnp.int32) * n + index[self.r]
        return positions(self.seq, self.seq_axes, self.sizes, index, self.u or ())

    def stripe(self, x, axis: int = 1):
        """A contiguous chunk of the sequence (dim ``axis``) -> this device's stripe."""
        if not self.striped:
            return x
        n, x = self.sizes[self.r], jnp.moveaxis(x, axis, 1)
        shape = x.shape
        x = jnp.swapaxes(x.reshape(shape[0], shape[1] // n, n, *shape[2:]), 1, 2)
        x = lax.all_to_all(x, self.r, split_axis=1, concat_axis=1, tiled=True)
        return jnp.moveaxis(x.reshape(shape), 1, axis)

    def unstripe(self, x, axis: int = 1):
        if not self.striped:
            return x
        n, x = self.sizes[self.r], jnp.moveaxis(x, axis, 1)
        shape = x.shape
        x = x.reshape(shape[0], n, shape[1] // n, *shape[2:])
        x = jnp.swapaxes(lax.all_to_all(x, self.r, split_axis=1, concat_axis=1, tiled=True), 1, 2)
        return jnp.moveaxis(x.reshape(shape), 1, axis)

    def to_heads(self, *xs):
        """Sequence-sharded over the Ulysses axis -> head-sharded (dim 2)."""
        if self.u is None:
            return xs
        return tuple(lax.all_to_all(x, self.u, split_axis=2, concat_axis=1, tiled=True)
                     for x in xs)

    def to_seq(self, *xs):
        if self.u is None:
            return xs
        return tuple(lax.all_to_all(x, self.u, split_axis=1, concat_axis=2, tiled=True)
                     for x in xs)

    def lse_to_heads(self, lse):
        if self.u is None:
            return lse
        return lax.all_to_all(lse, self.u, split_axis=1, concat_axis=2, tiled=True)

    def lse_to_seq(self, lse):
        if self.u is None:
            return lse
        return lax.all_to_all(lse, self.u, split_axis=2, concat_axis=1, tiled=True)

    def full_mask(self, mask):
        if self.u is None:
            return mask
        return lax.all_gather(mask, self.u, axis=1, tiled=True)

    def rotate(self, *xs):
        n = self.sizes[self.r]
        perm = [(j, (j + 1) % n) for j in range(n)]
        return tuple(lax.ppermute(x, self.r, perm) for x in xs)

    def specs(self, ranks_and_seq_dims):
        """A PartitionSpec per operand (rank, its sequence dim): the batch on dim 0, the
        sequence on its dim, the heads on dim 2 of a ``[b, s, h, d]`` and dim 1 of an lse."""
        def entry(axes):
            return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
        out = []
        for rank, s in ranks_and_seq_dims:
            dims = [None] * rank
            dims[0] = entry(self.batch_axes)
            dims[s] = entry(self.seq_axes)
            heads = {4: 2, 3: 1}.get(rank)
            if heads is not None:
                dims[heads] = entry(self.head_axes)
            out.append(PartitionSpec(*dims))
        return tuple(out)

    def region(self, body, ins, outs):
        manual = self.seq_axes + self.batch_axes + self.head_axes
        return jax.shard_map(body, mesh=self.mesh, in_specs=self.specs(ins),
                             out_specs=self.specs(outs), axis_names=frozenset(manual),
                             check_vma=False)


_Q_SPEC, _MASK_SPEC, _LSE_SPEC = (4, 1), (2, 1), (3, 2)


def region(mesh, rewrite: Rewrite, *, causal: bool, scale: float, seq: int) -> _Region:
    """The settings of one attention region on ``mesh``; ``seq``: the whole sequence."""
    return _Region(mesh, rewrite, causal=causal, scale=scale, seq=seq)


def forward_region(reg: _Region):
    """``(q, k, v, kv_mask) -> (o, lse)`` as one shard_map, all sequence-sharded."""
    kw = dict(causal=reg.causal, scale=reg.scale, triangular=reg.triangular)

    def body(q, k, v, mask):
        dtype = q.dtype
        q, k, v = (reg.stripe(x) for x in reg.to_heads(q, k, v))
        mask = reg.stripe(reg.full_mask(mask))
        index = reg.index()
        q_pos = reg.q_positions(index)
        o, lse = attn.local_forward(q, k, v, mask, q_pos, reg.k_positions(index, 0), **kw)
        if reg.r is not None:
            def step(t, carry):
                o, lse, k, v, mask = carry
                k, v, mask = reg.rotate(k, v, mask)
                o_b, lse_b = attn.local_forward(q, k, v, mask, q_pos, reg.k_positions(index, t),
                                                **kw)
                return (*attn.merge(o, lse, o_b, lse_b), k, v, mask)
            o, lse, *_ = lax.fori_loop(1, reg.sizes[reg.r], step, (o, lse, k, v, mask))
        (o,) = reg.to_seq(reg.unstripe(o.astype(dtype)))
        return o, reg.lse_to_seq(reg.unstripe(lse, 2))

    return reg.region(body, (_Q_SPEC, _Q_SPEC, _Q_SPEC, _MASK_SPEC), (_Q_SPEC, _LSE_SPEC))


def backward_region(reg: _Region):
    """``(q, k, v, kv_mask, o, lse, do) -> (dq, dk, dv)`` as one shard_map."""
    kw = dict(causal=reg.causal, scale=reg.scale, triangular=reg.triangular)

    def body(q, k, v, mask, o, lse, do):
        dtypes = (q.dtype, k.dtype, v.dtype)
        q, k, v, o, do = (reg.stripe(x) for x in reg.to_heads(q, k, v, o, do))
        lse, mask = reg.stripe(reg.lse_to_heads(lse), 2), reg.stripe(reg.full_mask(mask))
        delta = attn.row_delta(o, do)
        index = reg.index()
        q_pos = reg.q_positions(index)
        if reg.r is None:
            dq, dk, dv = attn.local_backward(q, k, v, mask, q_pos, reg.k_positions(index, 0),
                                             lse, do, delta, **kw)
        else:
            def step(t, carry):
                dq, k, v, mask, dk, dv = carry
                dq_b, dk_b, dv_b = attn.local_backward(
                    q, k, v, mask, q_pos, reg.k_positions(index, t), lse, do, delta, **kw)
                k, v, mask, dk, dv = reg.rotate(k, v, mask, dk + dk_b, dv + dv_b)
                return dq + dq_b, k, v, mask, dk, dv
            zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
            dq, _, _, _, dk, dv = lax.fori_loop(0, reg.sizes[reg.r], step,
                                                (zeros(q), k, v, mask, zeros(k), zeros(v)))
        return reg.to_seq(*(reg.unstripe(x.astype(t)) for x, t in zip((dq, dk, dv), dtypes)))

    return reg.region(body, (_Q_SPEC,) * 3 + (_MASK_SPEC, _Q_SPEC, _LSE_SPEC, _Q_SPEC),
                      (_Q_SPEC,) * 3)


def _emit(emitter, eqn, invals, rewrite: Rewrite) -> list:
    reg = region(emitter.mesh, rewrite, causal=eqn.params["causal"], scale=eqn.params["scale"],
                 seq=eqn.invars[0].aval.shape[1])
    make = backward_region if eqn.primitive is attn.attention_bwd_p else forward_region
    return list(make(reg)(*invals))


REWRITES[RewriteKind.ULYSSES_ATTENTION] = _emit
REWRITES[RewriteKind.RING_ATTENTION] = _emit


def attention_label(node, strategy: Strategy) -> str | None:
    """How ``strategy`` splits attention node ``node`` (``"forward: ring(x) + batch(y)"``),
    or None when ``node`` is no attention."""
    if node.primitive not in attn.ATTENTION_PRIMITIVES:
        return None
    q = strategy.in_specs[0]
    p = dict(strategy.rewrite.params) if strategy.rewrite is not None else {}
    manual = (p.get("ulysses"), p.get("ring"))
    parts = [f"{kind}({axis if isinstance(axis, str) else ','.join(axis)})"
             for kind, axis in zip(("ulysses", "ring"), manual) if axis]
    for kind, axes in (("heads", q.dims[2]), ("batch", q.dims[0])):
        if axes:
            parts.append(f"{kind}({','.join(axes)})")
    side = "backward" if node.primitive is attn.attention_bwd_p else "forward"
    return f"{side}: {' + '.join(parts) or 'replicated'}"


def attention_labels(graph, strats, choice) -> list[str]:
    """:func:`attention_label` of every attention node of a plan, in graph order."""
    labels = (attention_label(n, strats[n.id][choice[n.id]]) for n in graph.nodes)
    return [label for label in labels if label is not None]
