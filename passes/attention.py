"""Attention as two primitives the planner sees whole: ``attention_fwd_p`` and
``attention_bwd_p``, bound by :func:`attention` (a ``custom_vjp``).

A train step's jaxpr is differentiated before autopar sees it, so attention is one node in the
forward pass and one in the backward pass, whatever strategy the plan gives it. Layout:
``q [batch, seq_q, heads, head_dim]``, ``k``/``v [batch, seq_k, kv_heads, head_dim]`` (grouped
query attention when ``kv_heads`` divides ``heads``: query head ``h`` reads kv head
``h // (heads // kv_heads)``, as ``jnp.repeat`` groups them), ``kv_mask [batch, seq_k]`` (True:
the key may be attended), ``lse [batch, heads, seq_q]`` (float32 log-sum-exp of each row).

The kernels (:func:`local_forward`, :func:`local_backward`) run over blocks of keys with an
online softmax, the backward recomputing probabilities from ``lse`` (flash attention's
formulation), so no ``seq_q x seq_k`` tensor is kept. They take the global positions of their
rows, so the sequence-parallel regions (``passes.sequence_parallel``) call them on any chunk.
Unrewritten plans lower the primitives to the same kernels on whole tensors.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from autopar.errors import ArgumentError

#: Strategies :func:`attention` (``strategy=``) and ``autopar.plan(attention=...)`` may force.
STRATEGIES = ("ulysses", "ring", "heads", "batch", "replicated")
#: A strategy's spelling: kinds joined by "+", each with the mesh axes it runs over if named.
STRATEGY_SYNTAX = ('"ulysses", "ring", "heads", "batch" or "replicated"; with the mesh axes '
                   'named, as the report writes them: "ring(seq)", "ulysses(seq) + ring(data)"')


def parse_strategy(text: str, name: str = "strategy") -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``text`` (a forced attention strategy, the argument ``name``) as its terms: (kind, the
    mesh axes named for it, empty when none). ``"ring"``: a ring over an axis autopar
    chooses; ``"ring(seq)"``: over ``seq``; ``"ulysses(a,b) + ring(c)"``: both. ArgumentError
    where it does not read."""
    def bad(why: str) -> ArgumentError:
        return ArgumentError(f"`{name}={text!r}` is not an attention strategy ({why}); use "
                             f"{STRATEGY_SYNTAX}, or None (autopar chooses).")

    if not isinstance(text, str):
        raise bad(f"a {type(text).__name__}, not a string")
    terms, seen = [], set()
    for part in text.split("+"):
        match = re.fullmatch(r"\s*(\w+)\s*(?:\(([^()]*)\))?\s*", part)
        if match is None or match[1] not in STRATEGIES:
            raise bad(f"`{part.strip()}` names no strategy")
        kind = match[1]
        axes = tuple(a.strip() for a in match[2].split(",")) if match[2] is not None else ()
        if match[2] is not None and not all(axes):
            raise bad(f"`{part.strip()}` names an empty axis")
        if kind == "ring" and len(axes) > 1:
            raise bad("a ring runs over one mesh axis")
        if kind == "replicated" and (axes or text.count("+")):
            raise bad("`replicated` takes no axes and no other kind")
        if kind in seen or seen & set(axes):
            raise bad(f"`{part.strip()}` repeats a kind or an axis")
        seen |= {kind, *axes}
        terms.append((kind, axes))
    return tuple(terms)


#: At most this many keys per block of the kernels' online softmax.
BLOCK_K = 8192
#: At most this many float32 scores per block (batch x heads x block x block): 512 MiB.
SCORE_BLOCK_ELEMENTS = 2 ** 27


def block_size(n: int, rows: int = 1) -> int:
    """Keys per block for ``n`` keys and ``rows`` (batch x heads) score rows of each: the
    largest divisor of ``n`` whose square block of scores stays within
    :data:`SCORE_BLOCK_ELEMENTS`, at most :data:`BLOCK_K` (fewer heads, larger blocks: fewer
    loop steps for the same work)."""
    target = min(BLOCK_K, max(1, math.isqrt(SCORE_BLOCK_ELEMENTS // max(rows, 1))))
    if n <= target:
        return n
    return max(d for d in range(1, target + 1) if n % d == 0)


# ----------------------------------------------------------------------------- kernels

def _scores(q, k, kv_mask, q_pos, k_pos, causal: bool, scale: float):
    """Masked scores ``[b, kv_heads, groups, q, k]`` in float32 (-inf where masked)."""
    b, sq, h, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, sq, kh, h // kh, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    valid = kv_mask[:, None, None, None, :]
    if causal:
        valid = valid & (q_pos[:, None] >= k_pos[None, :])[None, None, None]
    return jnp.where(valid, s, -jnp.inf)


def forward_block(q, k, v, kv_mask, q_pos, k_pos, *, causal: bool, scale: float):
    """(o float32 ``[b, q, h, d]``, lse ``[b, h, q]``) of ``q`` over one block of keys; a row
    with no valid key has o = 0 and lse = -inf."""
    b, sq, h, d = q.shape
    kh = k.shape[2]
    s = _scores(q, k, kv_mask, q_pos, k_pos, causal, scale)
    m = s.max(-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    total = p.sum(-1)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
    o = o / jnp.where(total > 0, total, 1.0).transpose(0, 3, 1, 2)[..., None]
    lse = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return o.reshape(b, sq, h, d), lse.reshape(b, h, sq)


def merge(o, lse, o_b, lse_b):
    """Two partial softmax results over disjoint key sets merged into one."""
    new = jnp.logaddexp(lse, lse_b)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - safe), 0.0)
    w_b = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)
    t = lambda x: x.transpose(0, 2, 1)[..., None]  # noqa: E731  [b, h, q] -> [b, q, h, 1]
    return o * t(w) + o_b * t(w_b), new


def _blocks(x, n: int, axis: int = 1):
    """``x`` with ``axis`` cut into ``n`` blocks, the block index first."""
    shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _pairs(n: int):
    """(query block, key block) of the lower triangle, row by row."""
    rows, cols = zip(*[(i, j) for i in range(n) for j in range(i + 1)])
    return jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32)


def _cut(x, i, b: int, axis: int = 1):
    return lax.dynamic_slice_in_dim(x, i * b, b, axis)


def _put(x, blk, i, b: int, axis: int = 1):
    return lax.dynamic_update_slice_in_dim(x, blk, i * b, axis)


def triangular_forward(q, k, v, kv_mask, q_pos, k_pos, *, scale: float):
    """:func:`local_forward` of causal attention whose key block ``j`` lies wholly after query
    block ``i`` when ``j > i`` (positions increase along the rows, as in a contiguous or a
    striped sequence): only the lower triangle of block pairs is computed."""
    b = block_size(k.shape[1], q.shape[0] * q.shape[2])
    bsz, sq, h, d = q.shape
    init = (jnp.zeros((bsz, sq, h, d), jnp.float32), jnp.full((bsz, h, sq), -jnp.inf))

    def step(carry, pair):
        o, lse = carry
        i, j = pair
        o_b, lse_b = forward_block(_cut(q, i, b), _cut(k, j, b), _cut(v, j, b),
                                   _cut(kv_mask, j, b), _cut(q_pos, i, b, 0),
                                   _cut(k_pos, j, b, 0), causal=True, scale=scale)
        o_i, lse_i = merge(_cut(o, i, b), _cut(lse, i, b, 2), o_b, lse_b)
        return (_put(o, o_i, i, b), _put(lse, lse_i, i, b, 2)), None

    (o, lse), _ = lax.scan(step, init, _pairs(sq // b))
    return o, lse


def triangular_backward(q, k, v, kv_mask, q_pos, k_pos, lse, do, delta, *, scale: float):
    """:func:`local_backward` over the lower triangle of block pairs (see
    :func:`triangular_forward`)."""
    b = block_size(k.shape[1], q.shape[0] * q.shape[2])
    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731

    def step(carry, pair):
        dq, dk, dv = carry
        i, j = pair
        dq_b, dk_b, dv_b = backward_block(
            _cut(q, i, b), _cut(k, j, b), _cut(v, j, b), _cut(kv_mask, j, b),
            _cut(q_pos, i, b, 0), _cut(k_pos, j, b, 0), _cut(lse, i, b, 2), _cut(do, i, b),
            _cut(delta, i, b, 2), causal=True, scale=scale)
        return (_put(dq, _cut(dq, i, b) + dq_b, i, b), _put(dk, _cut(dk, j, b) + dk_b, j, b),
                _put(dv, _cut(dv, j, b) + dv_b, j, b)), None

    (dq, dk, dv), _ = lax.scan(step, (zeros(q), zeros(k), zeros(v)), _pairs(q.shape[1] // b))
    return dq, dk, dv


def local_forward(q, k, v, kv_mask, q_pos, k_pos, *, causal: bool, scale: float,
                  triangular: bool = False):
    """(o float32, lse) of ``q`` over all of ``k``/``v``, one block of keys at a time;
    ``triangular``: causal, with positions increasing alike along q and k
    (:func:`triangular_forward`)."""
    n = k.shape[1] // block_size(k.shape[1], q.shape[0] * q.shape[2])
    if triangular and causal and n > 1 and q.shape[1] == k.shape[1]:
        return triangular_forward(q, k, v, kv_mask, q_pos, k_pos, scale=scale)
    if n == 1:
        return forward_block(q, k, v, kv_mask, q_pos, k_pos, causal=causal, scale=scale)
    b, sq, h, d = q.shape
    init = (jnp.zeros((b, sq, h, d), jnp.float32), jnp.full((b, h, sq), -jnp.inf, jnp.float32))

    def step(carry, blk):
        kb, vb, mb, pb = blk
        o_b, lse_b = forward_block(q, kb, vb, mb, q_pos, pb, causal=causal, scale=scale)
        return merge(*carry, o_b, lse_b), None

    (o, lse), _ = lax.scan(step, init, (_blocks(k, n), _blocks(v, n), _blocks(kv_mask, n),
                                        _blocks(k_pos, n, 0)))
    return o, lse


def backward_block(q, k, v, kv_mask, q_pos, k_pos, lse, do, delta, *, causal: bool,
                   scale: float):
    """(dq, dk, dv) in float32 of one block of keys, given the whole rows' ``lse`` and
    ``delta = sum(do * o, -1)`` ``[b, h, q]``."""
    b, sq, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    s = _scores(q, k, kv_mask, q_pos, k_pos, causal, scale)
    lse_g = lse.reshape(b, kh, g, sq)[..., None]
    p = jnp.where(jnp.isfinite(s), jnp.exp(s - jnp.where(jnp.isfinite(lse_g), lse_g, 0.0)), 0.0)
    dog = do.reshape(b, sq, kh, g, d)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do.dtype), dog,
                    preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, v, preferred_element_type=jnp.float32)
    ds = (p * (dp - delta.reshape(b, kh, g, sq)[..., None]) * scale).astype(q.dtype)
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, q.reshape(b, sq, kh, g, d),
                    preferred_element_type=jnp.float32)
    return dq.reshape(b, sq, h, d), dk, dv


def row_delta(o, do):
    """``sum(do * o, -1)`` as ``[b, h, q]`` float32."""
    return jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), o.astype(jnp.float32))


def local_backward(q, k, v, kv_mask, q_pos, k_pos, lse, do, delta, *, causal: bool,
                   scale: float, triangular: bool = False):
    """(dq, dk, dv) in float32 over all of ``k``/``v``, one block of keys at a time."""
    n = k.shape[1] // block_size(k.shape[1], q.shape[0] * q.shape[2])
    if triangular and causal and n > 1 and q.shape[1] == k.shape[1]:
        return triangular_backward(q, k, v, kv_mask, q_pos, k_pos, lse, do, delta, scale=scale)
    kw = dict(causal=causal, scale=scale)
    if n == 1:
        return backward_block(q, k, v, kv_mask, q_pos, k_pos, lse, do, delta, **kw)

    def step(dq, blk):
        kb, vb, mb, pb = blk
        dq_b, dk_b, dv_b = backward_block(q, kb, vb, mb, q_pos, pb, lse, do, delta, **kw)
        return dq + dq_b, (dk_b, dv_b)

    dq, (dk, dv) = lax.scan(step, jnp.zeros(q.shape, jnp.float32),
                            (_blocks(k, n), _blocks(v, n), _blocks(kv_mask, n),
                             _blocks(k_pos, n, 0)))
    unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(k.shape)  # noqa: E731
    return dq, unblock(dk), unblock(dv)


# ----------------------------------------------------------------------------- primitives

def _reference_fwd(q, k, v, kv_mask, *, causal, scale, strategy):
    del strategy
    pos_q, pos_k = jnp.arange(q.shape[1]), jnp.arange(k.shape[1])
    o, lse = local_forward(q, k, v, kv_mask, pos_q, pos_k, causal=causal, scale=scale,
                           triangular=True)
    return [o.astype(q.dtype), lse]


def _reference_bwd(q, k, v, kv_mask, o, lse, do, *, causal, scale, strategy):
    del strategy
    pos_q, pos_k = jnp.arange(q.shape[1]), jnp.arange(k.shape[1])
    dq, dk, dv = local_backward(q, k, v, kv_mask, pos_q, pos_k, lse, do, row_delta(o, do),
                                causal=causal, scale=scale, triangular=True)
    return [dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)]


def _fwd_abstract(q, k, v, kv_mask, **_):
    b, s, h, _d = q.shape
    return [jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray((b, h, s), jnp.float32)]


def _bwd_abstract(q, k, v, kv_mask, o, lse, do, **_):
    return [jax.core.ShapedArray(x.shape, x.dtype) for x in (q, k, v)]


def _primitive(name: str, impl, abstract) -> Primitive:
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(impl)
    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
    batching.primitive_batchers[prim] = functools.partial(_batched, prim)
    return prim


def _batched(prim: Primitive, args, dims, **params):
    """Under ``jax.vmap``: the mapped axis folded into every operand's and result's batch
    (their first axis)."""
    n = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    flat = []
    for x, d in zip(args, dims):
        x = jnp.broadcast_to(x, (n, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
        flat.append(x.reshape(n * x.shape[1], *x.shape[2:]))
    outs = prim.bind(*flat, **params)
    return [o.reshape(n, -1, *o.shape[1:]) for o in outs], [0] * len(outs)


#: ``(q, k, v, kv_mask; causal, scale, strategy) -> (o, lse)``.
attention_fwd_p = _primitive("autopar_attention_fwd", _reference_fwd, _fwd_abstract)
#: ``(q, k, v, kv_mask, o, lse, do; causal, scale, strategy) -> (dq, dk, dv)``.
attention_bwd_p = _primitive("autopar_attention_bwd", _reference_bwd, _bwd_abstract)
ATTENTION_PRIMITIVES = (attention_fwd_p, attention_bwd_p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, kv_mask, causal, scale, strategy):
    return attention_fwd_p.bind(q, k, v, kv_mask, causal=causal, scale=scale,
                                strategy=strategy)[0]


def _attention_fwd(q, k, v, kv_mask, causal, scale, strategy):
    o, lse = attention_fwd_p.bind(q, k, v, kv_mask, causal=causal, scale=scale,
                                  strategy=strategy)
    return o, (q, k, v, kv_mask, o, lse)


def _attention_bwd(causal, scale, strategy, res, do):
    q, k, v, kv_mask, o, lse = res
    dq, dk, dv = attention_bwd_p.bind(q, k, v, kv_mask, o, lse, do, causal=causal, scale=scale,
                                      strategy=strategy)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, kv_mask=None, *, causal: bool = False, scale: float | None = None,
              strategy: str | None = None):
    """Dot-product attention that autopar plans whole (sequence parallel where it pays).

    Arguments:
        q: ``[batch, seq, heads, head_dim]``.
        k, v: ``[batch, seq_k, kv_heads, head_dim]``; ``kv_heads`` divides ``heads`` (grouped
            query attention).
        kv_mask: optional bool ``[batch, seq_k]``, False for padding keys. A query row
            with no key to attend (all padding, or before the first valid key when causal)
            comes out as zeros.
        causal: query ``i`` attends keys ``j <= i`` (``q`` and ``k`` of one length).
        scale: the scores' factor (default ``1 / sqrt(head_dim)``).
        strategy: force how autopar splits it: ``"ulysses"``, ``"ring"``, ``"heads"``,
            ``"batch"`` or ``"replicated"``, or with the mesh axes named, ``"ring(seq)"``,
            ``"ulysses(seq) + ring(data)"`` (None: the planner chooses; see
            ``docs/context_parallel.md``).

    Returns:
        ``[batch, seq, heads, head_dim]`` in ``q``'s dtype.

    Example::

        o = autopar.attention(q, k, v, causal=True)
    """
    _check(q, k, v, kv_mask, causal, strategy)
    if kv_mask is None:
        kv_mask = jnp.ones(k.shape[:2], jnp.bool_)
    return _attention(q, k, v, kv_mask, bool(causal), _scale(q, scale), strategy)


def _scale(q, scale) -> float:
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    try:
        return float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise ArgumentError(
            f"`autopar.attention`: `scale` must be a Python number (a static part of the op), "
            f"got {type(scale).__name__}; scale `q` by a traced factor instead.") from None


def _check(q, k, v, kv_mask, causal, strategy) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ArgumentError(
            f"`autopar.attention` takes `q` [batch, seq, heads, head_dim] and `k`, `v` of one "
            f"shape [batch, seq_k, kv_heads, head_dim]; got q {q.shape}, k {k.shape}, "
            f"v {v.shape}. Reshape the projections to that layout.")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ArgumentError(
            f"`autopar.attention`: `k` {k.shape} must share `q` {q.shape}'s batch and head_dim, "
            "and its kv_heads must divide q's heads.")
    if 0 in q.shape or 0 in k.shape:
        raise ArgumentError(f"`autopar.attention`: q {q.shape} or k {k.shape} has an empty "
                            "dimension; attention needs at least one query and one key.")
    if not all(jnp.issubdtype(x.dtype, jnp.floating) for x in (q, k, v)):
        raise ArgumentError(f"`autopar.attention` takes floating q, k, v; got {q.dtype}, "
                            f"{k.dtype}, {v.dtype}. Cast them (to the compute dtype) first.")
    if causal and q.shape[1] != k.shape[1]:
        raise ArgumentError(
            f"`autopar.attention(causal=True)` needs as many queries as keys, got {q.shape[1]} "
            f"and {k.shape[1]}: which key a query may reach is then ambiguous (first or last "
            "positions aligned). Pass causal=False, with padding in `kv_mask`, or call it on "
            "equal lengths.")
    if kv_mask is not None and (tuple(kv_mask.shape) != tuple(k.shape[:2])
                                or kv_mask.dtype != jnp.bool_):
        raise ArgumentError(
            f"`kv_mask` must be bool [batch, seq_k] = {tuple(k.shape[:2])}, True where a key "
            f"may be attended; got {kv_mask.dtype}{list(kv_mask.shape)}. From an additive mask "
            "(0 to keep, a large negative number to drop), pass `mask == 0`; from a 1/0 mask, "
            "`mask > 0`.")
    if strategy is not None:
        parse_strategy(strategy)


def reference(q, k, v, kv_mask=None, *, causal: bool = False, scale: float | None = None):
    """Plain attention in jnp (the whole score matrix): what :func:`attention` computes."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    valid = jnp.ones(s.shape[-2:], bool)
    if causal:
        valid = jnp.tril(valid)
    valid = valid[None, None]
    if kv_mask is not None:
        valid = valid & kv_mask[:, None, None, :]
    s = jnp.where(valid, s, -np.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)
