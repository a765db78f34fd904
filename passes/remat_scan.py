"""Rematerialize a stack of layers under ``lax.scan`` (a flax ``nn.scan``) in a traced train step.

Differentiating a scan over layers gives two top-level scans: the forward one, whose body is a
layer and whose stacked outputs (``ys``) hold every layer's residuals, and the backward one
(``transpose(...)`` in the name stack), which slices those stacks layer by layer. All of them
are live from the end of the forward loop to the end of the backward one: with many layers,
most of the peak. Rematerializing the stack rewrites the pair as ``jax.checkpoint`` around the
scanned layer would have:

* the forward scan returns, instead of the residuals, the stack of its carries (each layer's
  input) and, with :attr:`~passes.remat.RematPolicy.DOTS`, of the dot results the
  recomputation needs (with :attr:`~passes.remat.RematPolicy.NOTHING`, none);
* the backward scan slices those and the forward scan's stacked inputs (the layer's
  parameters) besides its own, recomputes each layer's residuals with the forward body (only
  the equations they need, less the dots whose results it was given), then runs its own
  body on them.

The rewrite re-evaluates the top-level jaxpr under ``jax.make_jaxpr``, each equation with its
own source information (name stack, traceback), so the passes that read those see the program
as before. Only the two scans change.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as P
from jax.extend import source_info_util
from jax.interpreters import partial_eval as pe

from autopar._compat import scan_counts


@dataclass(frozen=True)
class ScanPair:
    """A layer stack's forward scan (equation ``forward``) and the backward scan (``backward``)
    that reads the forward one's stacked outputs ``residuals`` (positions in its ``ys``)."""
    layer: str
    forward: int
    backward: int
    residuals: tuple[int, ...]


def _is_var(atom) -> bool:
    return isinstance(atom, jcore.Var) and not isinstance(atom, jcore.DropVar)


def scan_pairs(jaxpr, owner: dict, start: int) -> list[ScanPair]:
    """The forward/backward scan pairs of a train step's jaxpr. ``owner``: input var -> the
    layer its parameters belong to; ``start``: the first equation of the backward pass. A
    forward scan belongs to the layer whose parameters it slices; its residuals are the ``ys``
    the backward scan slices and nothing else reads. A forward body with effects is left as
    it is."""
    if not any(eqn.primitive is P.scan_p for eqn in jaxpr.eqns[:start]):
        return []  # an unrolled model: nothing to pair
    uses: dict = {}
    for j, eqn in enumerate(jaxpr.eqns):
        for a in eqn.invars:
            if _is_var(a):
                uses.setdefault(a, set()).add(j)
    results = {a for a in jaxpr.outvars if _is_var(a)}
    pairs = []
    for i, eqn in enumerate(jaxpr.eqns[:start]):
        if eqn.primitive is not P.scan_p:
            continue
        p = eqn.params
        xs = eqn.invars[scan_counts(p)[0] + scan_counts(p)[1]:]
        layers = [owner[a] for a in xs if _is_var(a) and a in owner]
        ys = eqn.outvars[scan_counts(p)[1]:]
        readers = {j for v in ys if _is_var(v) for j in uses.get(v, ()) if j >= start
                   and jaxpr.eqns[j].primitive is P.scan_p}
        if not layers or len(readers) != 1 or p["jaxpr"].jaxpr.effects:
            continue  # (effects would run twice)
        back = readers.pop()
        b = jaxpr.eqns[back].params
        b_ins = jaxpr.eqns[back].invars
        b_xs = set(b_ins[scan_counts(b)[0] + scan_counts(b)[1]:])
        b_rest = set(b_ins[:scan_counts(b)[0] + scan_counts(b)[1]])
        residuals = tuple(k for k, v in enumerate(ys)
                          if _is_var(v) and v in b_xs and v not in b_rest
                          and uses[v] == {back} and v not in results)
        if residuals:
            pairs.append(ScanPair(layers[0], i, back, residuals))
    return pairs


@dataclass(frozen=True)
class _Recompute:
    """How a pair's backward scan recomputes the residuals: the forward body with the dot
    results it saves appended to its outputs (``forward``), and a jaxpr from the used ones
    (``used``) of (forward consts, carries, forward xs, saved dots) to the residuals."""
    forward: object
    again: object
    used: tuple[bool, ...]
    saved: tuple


def _recompute(jaxpr, pair: ScanPair, keep_dots: bool) -> _Recompute:
    eqn = jaxpr.eqns[pair.forward]
    body = eqn.params["jaxpr"]
    inner, ncar = body.jaxpr, scan_counts(eqn.params)[1]
    wanted = [inner.outvars[ncar + k] for k in pair.residuals]
    eqns, dots = inner.eqns, []
    if keep_dots:  # the dots' results come from the forward scan instead of being recomputed
        dots = [v for e in eqns if e.primitive is lax.dot_general_p for v in e.outvars]
        eqns = [e for e in eqns if e.primitive is not lax.dot_general_p]
    again = jcore.Jaxpr(inner.constvars, [*inner.invars, *dots], wanted, eqns)
    again, used = pe.dce_jaxpr(again, [True] * len(wanted))
    saved = tuple(d for d, u in zip(dots, used[len(inner.invars):]) if u)
    forward = jcore.Jaxpr(inner.constvars, inner.invars, [*inner.outvars, *saved], inner.eqns)
    return _Recompute(jcore.ClosedJaxpr(forward, body.consts),
                      jcore.ClosedJaxpr(again, body.consts), tuple(used), saved)


def saved_bytes(jaxpr, pair: ScanPair, keep_dots: bool) -> int:
    """Bytes (whole stacks, unsharded) the rewrite frees: the residuals, less the stacked
    carries and dot results it keeps instead."""
    eqn = jaxpr.eqns[pair.forward]
    p = eqn.params
    ys = eqn.outvars[scan_counts(p)[1]:]
    carries = eqn.invars[scan_counts(p)[0]:scan_counts(p)[0] + scan_counts(p)[1]]
    kept = [a.aval for a in carries] + [v.aval for v in _recompute(jaxpr, pair, keep_dots).saved]
    return (sum(_nbytes(ys[k].aval) for k in pair.residuals)
            - p["length"] * sum(_nbytes(a) for a in kept))


def _nbytes(aval) -> int:
    return int(aval.size) * aval.dtype.itemsize


def rewrite(closed, pairs: list[ScanPair], keep_dots: bool):
    """``closed`` with each pair's residuals recomputed in its backward scan."""
    jaxpr = closed.jaxpr
    plans = {p.forward: (p, _recompute(jaxpr, p, keep_dots)) for p in pairs}
    backward = {p.backward: p.forward for p in pairs}
    kept: dict[int, tuple] = {}  # forward eqn -> what its backward scan recomputes from

    def run(*args):
        env: dict = {}

        def read(a):
            return a.val if isinstance(a, jcore.Literal) else env[a]

        env.update(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))
        for j, eqn in enumerate(jaxpr.eqns):
            ins = [read(a) for a in eqn.invars]
            with (source_info_util.user_context(eqn.source_info.traceback,
                                                name_stack=eqn.source_info.name_stack),
                  eqn.ctx.manager):
                if j in plans:
                    outs, kept[j] = _forward(eqn, ins, *plans[j])
                elif j in backward:
                    pair, plan = plans[backward[j]]
                    outs = _backward(eqn, ins, jaxpr.eqns[pair.forward], pair, plan,
                                     kept[pair.forward])
                else:
                    outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
                    if not eqn.primitive.multiple_results:
                        outs = [outs]
            env.update((v, o) for v, o in zip(eqn.outvars, outs) if _is_var(v))
        return [read(a) for a in jaxpr.outvars]

    return jax.make_jaxpr(run)(*[v.aval for v in jaxpr.invars])


def _scan(eqn, step, init, xs):
    p = eqn.params
    return jax.lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"],
                        unroll=p["unroll"])


def _forward(eqn, ins, pair: ScanPair, plan: _Recompute):
    """(the forward scan's results, the stacks its backward scan recomputes from): the scan
    returns its carries and the saved dot results stacked instead of the residuals, which
    come back as None (only the backward scan read them, and it no longer does)."""
    p = eqn.params
    nc, ncar = scan_counts(p)[0], scan_counts(p)[1]
    consts, init, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
    n_ys = len(eqn.outvars) - ncar
    gone = set(pair.residuals)
    body = jcore.jaxpr_as_fun(plan.forward)

    def step(carry, x):
        outs = body(*consts, *carry, *x)
        ys = [y for k, y in enumerate(outs[ncar:ncar + n_ys]) if k not in gone]
        return list(outs[:ncar]), (ys, list(carry), list(outs[ncar + n_ys:]))

    last, (ys, carries, dots) = _scan(eqn, step, list(init), list(xs))
    ys_iter = iter(ys)
    full = [None if k in gone else next(ys_iter) for k in range(n_ys)]
    return list(last) + full, (list(consts), carries, list(xs), dots)


def _backward(eqn, ins, f_eqn, pair: ScanPair, plan: _Recompute, kept: tuple):
    """The backward scan, recomputing the residuals from ``kept`` (the forward scan's consts,
    and its stacked carries, inputs and saved dot results) layer by layer."""
    f_consts, carries, f_xs, dots = kept
    p = eqn.params
    nc, ncar = scan_counts(p)[0], scan_counts(p)[1]
    consts, init, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
    f_ys = f_eqn.outvars[scan_counts(f_eqn.params)[1]:]
    # the backward scan's xs that are residuals: position -> index among the recomputed ones
    slot = {pos: r for pos, atom in enumerate(eqn.invars[nc + ncar:])
            for r, k in enumerate(pair.residuals) if atom is f_ys[k]}
    own = [x for pos, x in enumerate(xs) if pos not in slot]
    again, body = jcore.jaxpr_as_fun(plan.again), jcore.jaxpr_as_fun(p["jaxpr"])

    def step(carry, x):
        own_x, carry_x, f_x, dot_x = x
        f_ins = [v for v, u in zip([*f_consts, *carry_x, *f_x, *dot_x], plan.used) if u]
        residuals = again(*f_ins)
        own_iter = iter(own_x)
        b_xs = [residuals[slot[pos]] if pos in slot else next(own_iter)
                for pos in range(len(xs))]
        outs = body(*consts, *carry, *b_xs)
        return list(outs[:ncar]), list(outs[ncar:])

    last, ys = _scan(eqn, step, list(init), (own, carries, f_xs, dots))
    return list(last) + list(ys)
