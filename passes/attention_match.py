"""Recognize attention written in jnp and put :func:`passes.attention.attention` in its place.

Matched, in a forward jaxpr (calls inlined first, scan bodies searched too)::

    s = dot_general(q, k) [* scale]          q [b, sq, h, d], k [b, sk, h, d] -> [b, h, sq, sk]
    s = select_n(mask, fill, s)              optional: causal (tril of iotas) and/or a
                                             [b, sk] key mask, joined by `and`
    p = softmax(s, axis=-1) [astype]         max, sub, exp, sum, div (as jax.nn.softmax)
    o = dot_general(v, p) | (p, v); transpose -> [b, sq, h, d]

with grouped-query heads when ``k``/``v`` are ``jnp.repeat`` ed (a broadcast and reshape of
``[b, sk, kv_heads, d]``). Every value inside the pattern must be used only inside it, so a
differentiated jaxpr (whose backward reads the probabilities) never matches: the rewrite runs
where autopar controls differentiation (``autopar.value_and_grad``) or where there is none.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as P

from autopar._compat import scan_counts, trace_context_state
from autopar.passes.attention import attention

_INLINE = (P.jit_p, P.closed_call_p, P.call_p)
_ACTIVE = contextvars.ContextVar("autopar_attention_recognition", default=False)
#: Part of jax's trace cache key, so a step jitted before is traced again while recognizing.
_TRACE_KEY = trace_context_state(
    "autopar_attention_recognition",
    "Whether autopar recognizes attention in autopar.value_and_grad losses (set by autopar).")


def _planned(q, k, v, kv_mask, causal: bool, scale: float):
    return attention(q, k, v, kv_mask, causal=causal, scale=scale)


@contextlib.contextmanager
def recognizing(replacement=_planned):
    """Within this block, ``autopar.value_and_grad`` recognizes attention in its loss and
    computes it by ``replacement(q, k, v, kv_mask, causal, scale)`` (default:
    :func:`passes.attention.attention`, which autopar plans)."""
    token = _ACTIVE.set(replacement)
    try:
        with _TRACE_KEY(replacement):
            yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    return bool(_ACTIVE.get())


@dataclass(frozen=True)
class Match:
    """One attention found: its operands (atoms of the jaxpr), settings, and equations."""
    q: object
    k: object
    v: object
    kv_mask: object | None
    causal: bool
    scale: float
    fill: float                 # the masked scores' value (-inf: none masked, or -inf)
    end: int                    # the equation whose result is the attention's output
    eqns: frozenset[int]        # every equation of the pattern


class _View:
    def __init__(self, jaxpr):
        self.eqns = jaxpr.eqns
        self.prod = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
        self.uses = collections.Counter(
            a for e in jaxpr.eqns for a in e.invars if isinstance(a, jcore.Var))
        self.uses.update(a for a in jaxpr.outvars if isinstance(a, jcore.Var))
        self.taken: set[int] = set()

    def of(self, atom, *names):
        """The equation making ``atom`` if its primitive is one of ``names`` (recorded)."""
        if not isinstance(atom, jcore.Var) or atom not in self.prod:
            return None
        i = self.prod[atom]
        if self.eqns[i].primitive.name not in names:
            return None
        self.taken.add(i)
        return self.eqns[i]


def _literal(atom):
    return float(np.asarray(atom.val)) if isinstance(atom, jcore.Literal) else None


def _ungroup(view: _View, atom):
    """``k`` itself, or the ``[b, s, kv_heads, d]`` it was repeated from."""
    r = view.of(atom, "reshape")
    b = r and view.of(r.invars[0], "broadcast_in_dim")
    if b is not None and tuple(b.params["broadcast_dimensions"]) == (0, 1, 2, 4):
        return b.invars[0]
    if r is not None:
        view.taken.discard(view.prod[atom])
    return atom


def _causal_2d(view: _View, atom) -> bool:
    """Whether ``atom`` [sq, sk] is tril(ones): ``select_n(ge(iota0 [+0], iota1), F, T)``."""
    sel = view.of(atom, "select_n")
    cond = sel.invars[0] if sel is not None else atom
    if sel is not None and not all(_all_literal(view, a, v) for a, v in
                                   zip(sel.invars[1:], (False, True))):
        return False
    ge = view.of(cond, "ge")
    if ge is None:
        return False
    lhs = view.of(ge.invars[0], "add")
    row = lhs.invars[0] if lhs is not None and _literal(lhs.invars[1]) == 0 else ge.invars[0]
    a, b = view.of(row, "iota"), view.of(ge.invars[1], "iota")
    return (a is not None and b is not None and a.params["dimension"] == 0
            and b.params["dimension"] == 1)


def _all_literal(view: _View, atom, value) -> bool:
    if isinstance(atom, jcore.Literal):
        return bool(atom.val) == value
    b = view.of(atom, "broadcast_in_dim")
    return b is not None and isinstance(b.invars[0], jcore.Literal) and bool(b.invars[0].val) == value


def _constant(view: _View, atom) -> float | None:
    """The value of ``atom`` when it is a literal or a broadcast of one (the fill of masked
    scores), else None."""
    if isinstance(atom, jcore.Literal):
        return _literal(atom)
    b = view.of(atom, "broadcast_in_dim")
    return _literal(b.invars[0]) if b is not None else None


#: A fill of masked scores at or below this value gives them no weight beside a key that is
#: not masked (exp of it underflows float32), as the kernels do; a higher one is no mask.
MASKED_AT_MOST = -1e4


def _mask(view: _View, atom, rank: int):
    """(causal, kv_mask atom or None), or None when ``atom`` is no mask this knows."""
    terms, causal, kv_mask = [atom], False, None
    while terms:
        t = terms.pop()
        dims = tuple(range(rank))
        while (b := view.of(t, "broadcast_in_dim")) is not None and not isinstance(
                b.invars[0], jcore.Literal):
            dims = tuple(dims[d] for d in b.params["broadcast_dimensions"])
            t = b.invars[0]
        if (a := view.of(t, "and")) is not None and len(dims) == rank:
            terms += list(a.invars)
        elif _all_literal(view, t, True):
            continue
        elif dims == (rank - 2, rank - 1) and _causal_2d(view, t):
            causal = True
        elif dims == (0, rank - 1) and kv_mask is None and t.aval.dtype == np.bool_:
            kv_mask = t
        else:
            return None
    return causal, kv_mask


def _softmax_input(view: _View, atom):
    """The ``x`` of ``p = softmax(x, axis=-1)`` (through a convert), or None."""
    c = view.of(atom, "convert_element_type")
    div = view.of(c.invars[0] if c is not None else atom, "div")
    e = div and view.of(div.invars[0], "exp")
    b = div and view.of(div.invars[1], "broadcast_in_dim")
    total = b and view.of(b.invars[0], "reduce_sum")
    if e is None or total is None or total.invars[0] is not div.invars[0]:
        return None
    sub = view.of(e.invars[0], "sub")
    if sub is None:
        return None
    y = sub.invars[1]
    while (step := view.of(y, "broadcast_in_dim", "stop_gradient", "max")) is not None:
        y = step.invars[-1] if step.primitive.name == "max" else step.invars[0]
    m = view.of(y, "reduce_max")
    rank = len(sub.invars[0].aval.shape)
    if m is None or m.invars[0] is not sub.invars[0] or tuple(m.params["axes"]) != (rank - 1,):
        return None
    return sub.invars[0]


_PV = {((1,), (3,), (0, 2), (0, 1)): (0, (0, 3, 1, 2)),    # dot(v, p) -> [b, h, d, q]
       ((3,), (1,), (0, 1), (0, 2)): (1, (0, 2, 1, 3))}    # dot(p, v) -> [b, h, q, d]


def _match_at(view: _View, i: int) -> Match | None:
    end = view.eqns[i]
    dot = view.of(end.invars[0], "dot_general")
    if dot is None:
        return None
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    form = _PV.get((tuple(lc), tuple(rc), tuple(lb), tuple(rb)))
    if form is None or tuple(end.params["permutation"]) != form[1]:
        return None
    p_atom, v_atom = dot.invars[1 - form[0]], dot.invars[form[0]]
    x = _softmax_input(view, p_atom)
    if x is None:
        return None
    causal, kv_mask, s, fill = False, None, x, -np.inf
    if (sel := view.of(x, "select_n")) is not None:
        mask = _mask(view, sel.invars[0], len(x.aval.shape))
        fill = _constant(view, sel.invars[1])
        if mask is None or fill is None or not fill <= MASKED_AT_MOST:
            return None
        causal, kv_mask = mask
        s = sel.invars[2]
    scale = 1.0
    if (mul := view.of(s, "mul", "div")) is not None:
        lit = [_literal(a) for a in mul.invars]
        if lit[1] is None or lit[0] is not None:
            return None
        scale = lit[1] if mul.primitive.name == "mul" else 1.0 / lit[1]
        s = mul.invars[0]
    qk = view.of(s, "dot_general")
    if qk is None or qk.params["dimension_numbers"] != (((3,), (3,)), ((0, 2), (0, 2))):
        return None
    q, k, v = qk.invars[0], _ungroup(view, qk.invars[1]), _ungroup(view, v_atom)
    if k.aval.shape != v.aval.shape or len(q.aval.shape) != 4:
        return None
    return Match(q, k, v, kv_mask, causal, scale, fill, i, frozenset(view.taken | {i}))


def find(jaxpr) -> list[Match]:
    """The attentions of one jaxpr level (not inside its sub-jaxprs), each with every inner
    value used only inside it."""
    out = []
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive is not lax.transpose_p:
            continue
        view = _View(jaxpr)
        m = _match_at(view, i)
        if m is None:
            continue
        inner = [v for j in m.eqns if j != i for v in jaxpr.eqns[j].outvars]
        used_inside = collections.Counter(a for j in m.eqns for a in jaxpr.eqns[j].invars
                                          if isinstance(a, jcore.Var))
        if all(view.uses[v] == used_inside[v] for v in inner):
            out.append(m)
    return out


# ----------------------------------------------------------------------------- rewriting

def _needed(jaxpr, matches: dict[int, Match]) -> set[int]:
    """Equations the results need once each match's end reads only its operands."""
    prod = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    need = {i for i, e in enumerate(jaxpr.eqns) if e.effects}
    stack = [a for a in jaxpr.outvars if isinstance(a, jcore.Var)]
    stack += [a for i in need for a in jaxpr.eqns[i].invars if isinstance(a, jcore.Var)]
    while stack:
        i = prod.get(stack.pop())
        if i is None or i in need:
            continue
        need.add(i)
        m = matches.get(i)
        reads = [m.q, m.k, m.v, m.kv_mask] if m is not None else jaxpr.eqns[i].invars
        stack += [a for a in reads if isinstance(a, jcore.Var)]
    return need


def interpret(jaxpr, consts, args, rewrite: bool) -> list:
    """Evaluate ``jaxpr`` with calls inlined, scan and remat bodies interpreted alike, and,
    with ``rewrite``, each matched attention replaced by :func:`passes.attention.attention`."""
    matches = {m.end: m for m in find(jaxpr)} if rewrite else {}
    keep = _needed(jaxpr, matches) if matches else range(len(jaxpr.eqns))
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(a):
        return a.val if isinstance(a, jcore.Literal) else env[a]

    for i in sorted(keep):
        eqn = jaxpr.eqns[i]
        if i in matches:
            m = matches[i]
            kv_mask = None if m.kv_mask is None else read(m.kv_mask)
            out = (_ACTIVE.get() or _planned)(read(m.q), read(m.k), read(m.v), kv_mask,
                                               m.causal, m.scale)
            if kv_mask is not None:
                out = _fully_masked_rows(out, read(m.v), kv_mask, m.causal, m.fill)
            outs = [out.astype(eqn.outvars[0].aval.dtype)]
        else:
            outs = _equation(eqn, [read(a) for a in eqn.invars], rewrite)
        env.update((v, x) for v, x in zip(eqn.outvars, outs) if not isinstance(v, jcore.DropVar))
    return [read(a) for a in jaxpr.outvars]


def _fully_masked_rows(out, v, kv_mask, causal: bool, fill: float):
    """``out`` with each query row whose every key is masked as the matched jnp computes it:
    its scores all equal ``fill``, so softmax weighs every key alike (the mean of ``v``), or,
    with a fill of -inf, gives NaN. (The kernels give such a row zeros.)"""
    b, sq, heads, _ = out.shape
    seen = kv_mask if not causal else lax.cummax(kv_mask.astype(jnp.int32), axis=1) > 0
    if causal:  # query i reads keys 0..i
        seen = seen[:, jnp.minimum(jnp.arange(sq), kv_mask.shape[1] - 1)]
    else:
        seen = jnp.broadcast_to(seen.any(axis=1, keepdims=True), (b, sq))
    if np.isfinite(fill):
        mean = jnp.repeat(v.astype(jnp.float32).mean(axis=1), heads // v.shape[2], axis=1)
        masked = mean[:, None].astype(out.dtype)
    else:
        masked = jnp.full((), jnp.nan, out.dtype)
    return jnp.where(seen[:, :, None, None], out, masked)


def _equation(eqn, invals, rewrite: bool) -> list:
    p = eqn.params
    if eqn.primitive in _INLINE:
        inner = p.get("jaxpr", p.get("call_jaxpr"))
        consts = inner.consts if isinstance(inner, jcore.ClosedJaxpr) else ()
        return interpret(getattr(inner, "jaxpr", inner), consts, invals, rewrite)
    if eqn.primitive is P.scan_p:
        body, (nc, ncar) = p["jaxpr"], scan_counts(p)

        def step(carry, x):
            outs = interpret(body.jaxpr, body.consts, invals[:nc] + list(carry) + list(x),
                             rewrite)
            return outs[:ncar], outs[ncar:]
        carry, ys = lax.scan(step, invals[nc:nc + ncar], invals[nc + ncar:],
                             length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
        return list(carry) + list(ys)
    if eqn.primitive is P.remat_p:
        body = jax.checkpoint(lambda *a: interpret(p["jaxpr"], (), a, rewrite),
                              prevent_cse=p["prevent_cse"], policy=p["policy"])
        return list(body(*invals))
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(p))
    return list(out) if eqn.primitive.multiple_results else [out]


def _count(jaxpr) -> int:
    """Attentions matched at every level of ``jaxpr`` (scan and remat bodies included)."""
    n = len(find(jaxpr))
    for eqn in jaxpr.eqns:
        if eqn.primitive is P.scan_p:
            n += _count(eqn.params["jaxpr"].jaxpr)
        elif eqn.primitive is P.remat_p:
            n += _count(eqn.params["jaxpr"])
    return n


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jcore.Jaxpr):
                yield item


def _may_have(jaxpr) -> bool:
    """A cheap test before :func:`recognize` retraces: some ``transpose(dot(.., div))`` whose
    probabilities nothing else reads (a differentiated program's backward reads them)."""
    uses = collections.Counter(a for e in jaxpr.eqns for a in e.invars
                               if isinstance(a, jcore.Var))
    prod = {v: e for e in jaxpr.eqns for v in e.outvars}

    def single(atom, name):
        e = prod.get(atom) if isinstance(atom, jcore.Var) else None
        return e if e is not None and e.primitive.name == name and uses[atom] == 1 else None

    for eqn in jaxpr.eqns:
        dot = eqn.primitive is lax.transpose_p and single(eqn.invars[0], "dot_general")
        for atom in dot.invars if dot else ():
            conv = single(atom, "convert_element_type")
            if single(conv.invars[0] if conv else atom, "div"):
                return True
    return any(_may_have(sub) for eqn in jaxpr.eqns for sub in _sub_jaxprs(eqn))


def _has_remat(jaxpr) -> bool:
    return any(eqn.primitive is P.remat_p or any(_has_remat(sub) for sub in _sub_jaxprs(eqn))
               for eqn in jaxpr.eqns)


def recognize(closed, whole_step: bool = False):
    """(``closed`` with its attentions replaced, how many), or (None, 0) when it has none.

    ``whole_step``: ``closed`` is a whole step, perhaps differentiated by jax; one with a
    remat (``jax.checkpoint``) body is left as it is: the forward of attention the backward
    recomputes reads its probabilities nowhere else, so it would match, and be planned apart
    from the recomputation, which stays jnp."""
    if not _may_have(closed.jaxpr) or (whole_step and _has_remat(closed.jaxpr)):
        return None, 0
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    flat = jax.make_jaxpr(lambda *a: interpret(closed.jaxpr, closed.consts, a, False))(*avals)
    n = _count(flat.jaxpr)
    if n == 0:
        return None, 0
    return jax.make_jaxpr(lambda *a: interpret(flat.jaxpr, flat.consts, a, True))(*avals), n


def with_attention(fun):
    """``fun`` (pytrees in and out) evaluated with its attentions replaced, where it has any."""
    def wrapped(*args):
        closed, shape = jax.make_jaxpr(fun, return_shape=True)(*args)
        new, n = recognize(closed)
        if new is None:
            return fun(*args)
        outs = interpret(new.jaxpr, new.consts, jax.tree.leaves(args), False)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)
    return wrapped
