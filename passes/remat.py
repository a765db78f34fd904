"""Pass 1b, remat: rematerialize chosen layers of a traced train step.

A train step's jaxpr holds the forward pass, then the backward pass (``transpose(...)`` in the
name stack), then the optimizer. Values the forward pass makes and the backward pass reads
(*residuals*: activations kept for the gradient) are live from forward to backward, and at
the start of the backward pass all of them are live at once: usually the peak. Rematerializing
a layer keeps only some of its values and recomputes the others in the backward pass, right
before they are needed, as ``jax.checkpoint`` with a policy does:

* :attr:`RematPolicy.DOTS` keeps the layer's inputs and its matmul results and recomputes the
  rest (norms, activations, softmax): little extra compute
  (``jax.checkpoint_policies.dots_saveable``);
* :attr:`RematPolicy.NOTHING` keeps only the layer's inputs and recomputes the whole layer
  (``jax.checkpoint_policies.nothing_saveable``).

The rewrite works on the jaxpr after differentiation, so it needs no change to the user's
model: for each chosen layer, the forward equations that make its recomputed residuals are
copied, with fresh variables, to just before the first backward equation that reads one, and
the backward reads the copies. The copies take the kept values through an
``optimization_barrier`` together with a value of the backward pass, as ``jax.checkpoint``
does: XLA can neither merge them with the originals (CSE) nor run them before the backward
pass reaches the layer, so the originals die after their last forward use.

Layers are the top-level modules of the parameters (the first argument): ``block_0``, or
``layers[3]`` for a list of modules (flax nnx). A forward equation belongs to the layer whose
parameters the next parameter-reading equation reads (a layer's norm statistics, computed
before its scale is applied, belong to it); equations after the last one (the loss) belong to
no layer. Equations with effects are never recomputed. A stack of layers under ``lax.scan``
(an ``nn.scan``) is one layer, named by its stacked parameters: its forward and backward scans
are rewritten by ``passes.remat_scan``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import jax
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as P

from autopar.passes import remat_scan
from autopar.passes.trace import Traced, from_jaxpr


class RematPolicy(enum.Enum):
    DOTS = "dots_saveable"        # keep matmul results, recompute the rest
    NOTHING = "nothing_saveable"  # keep the layer's inputs only

    @property
    def described(self) -> str:
        return {RematPolicy.DOTS: "matmul results kept, the rest recomputed",
                RematPolicy.NOTHING: "only the layer's inputs kept, the layer recomputed"}[self]


@dataclass(frozen=True)
class _Recompute:
    """One layer's rewrite: before equation ``at``, ``boundary`` (kept values) and ``ties``
    (values of the backward pass) go through a barrier, ``eqns`` are copied reading the
    barrier's results, and the backward reads the copies of ``residuals``."""
    layer: str
    at: int
    boundary: tuple
    ties: tuple
    eqns: tuple[int, ...]
    residuals: tuple


_FIRST_KEY = re.compile(r"\['([^']+)'\](?:\[(\d+)\])?")


def layer_of_path(path: str) -> str | None:
    """The layer a parameter's key path names: its first dict key, with a list index right
    after it (``['block_0']['attn']...`` -> ``block_0``; nnx ``['layers'][3]['attn']...`` ->
    ``layers[3]``; a TrainState's ``.params['block_0']...`` -> ``block_0``). The report's
    per-layer rows use the same layers (``autopar._layers``)."""
    m = _FIRST_KEY.search(path)
    if m is None:
        return None
    return f"{m.group(1)}[{m.group(2)}]" if m.group(2) else m.group(1)


def parameter_layers(in_tree) -> list[str | None]:
    """A layer name per flat argument leaf: the parameters' (the first argument's) layers,
    None for the other arguments."""
    children = in_tree.children()
    if not children:
        return []
    dummy = jax.tree_util.tree_unflatten(children[0], [0] * children[0].num_leaves)
    names = [layer_of_path(jax.tree_util.keystr(p))
             for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]
    return names + [None] * (in_tree.num_leaves - len(names))


def _backward_start(eqns) -> int | None:
    for i, eqn in enumerate(eqns):
        if str(eqn.source_info.name_stack).startswith("transpose("):
            return i
    return None


def _is_var(atom) -> bool:
    return isinstance(atom, jcore.Var) and not isinstance(atom, jcore.DropVar)


def forward_layers(closed, leaf_layers: list[str | None]) -> dict[str, list[int]]:
    """Layer name -> the indices of its forward equations (see the module docstring). Empty
    when the program has no backward pass."""
    jaxpr = closed.jaxpr
    start = _backward_start(jaxpr.eqns)
    if start is None:
        return {}
    owner = {v: name for v, name in zip(jaxpr.invars, leaf_layers) if name is not None}
    reads = []
    for eqn in jaxpr.eqns[:start]:
        named = [owner[a] for a in eqn.invars if _is_var(a) and a in owner]
        reads.append(named[0] if named else None)
        # A value made from one layer's parameters alone (a cast, a transpose of a kernel)
        # is that layer's parameter too.
        operands = [a for a in eqn.invars if _is_var(a)]
        if operands and all(a in owner for a in operands) and len(set(named)) == 1:
            owner.update((v, named[0]) for v in eqn.outvars if _is_var(v))
    layers: dict[str, list[int]] = {}
    current = None
    for i in reversed(range(start)):
        current = reads[i] or current
        if current is not None:
            layers.setdefault(current, []).append(i)
    return {name: sorted(idx) for name, idx in reversed(list(layers.items()))}


def _uses_and_producers(jaxpr) -> tuple[dict, dict]:
    """(var -> indices of the equations reading it, var -> index of the equation making it)."""
    uses: dict = {}
    producer: dict = {}
    for j, eqn in enumerate(jaxpr.eqns):
        for a in eqn.invars:
            if _is_var(a):
                uses.setdefault(a, []).append(j)
        producer.update((v, j) for v in eqn.outvars if _is_var(v))
    return uses, producer


def _plan_layer(jaxpr, name: str, forward: list[int], policy: RematPolicy, uses, producer,
                start: int) -> _Recompute | None:
    eqns = jaxpr.eqns
    if any(eqns[i].effects for i in forward):
        return None
    mine = set(forward)
    made = {v: i for i in forward for v in eqns[i].outvars if _is_var(v)}
    results = {a for a in jaxpr.outvars if _is_var(a)}
    kept = {v for v in made
            if v in results or any(j not in mine and j < start for j in uses.get(v, ()))}
    if policy is RematPolicy.DOTS:
        kept |= {v for v, i in made.items() if eqns[i].primitive is lax.dot_general_p}
    residuals = [v for v in made if v not in kept and any(j >= start for j in uses.get(v, ()))]
    if not residuals:
        return None
    needed, stack = set(), [made[v] for v in residuals]
    while stack:
        i = stack.pop()
        if i in needed:
            continue
        needed.add(i)
        stack += [made[a] for a in eqns[i].invars if _is_var(a) and a in made and a not in kept]
    order = sorted(needed)
    produced = {v for i in order for v in eqns[i].outvars}
    boundary = tuple(dict.fromkeys(a for i in order for a in eqns[i].invars
                                   if _is_var(a) and a not in produced))
    at = min(j for v in residuals for j in uses[v] if j >= start)
    return _Recompute(name, at, boundary, _tie(eqns, at, start, producer), tuple(order),
                      tuple(residuals))


def _tie(eqns, at: int, start: int, producer: dict) -> tuple:
    """A value of the backward pass made before equation ``at``: an operand of ``at`` that the
    backward pass made (the gradient arriving at the layer), else the last result before it.
    The recomputation waits for it."""
    for a in eqns[at].invars:
        if _is_var(a) and producer.get(a, -1) >= start:
            return (a,)
    for k in range(at - 1, start - 1, -1):
        outs = [v for v in eqns[k].outvars if _is_var(v)]
        if outs:
            return (outs[0],)
    return ()


def _rewrite(closed, plans: list[_Recompute]):
    jaxpr = closed.jaxpr
    barrier = lax.optimization_barrier_p
    at: dict[int, list[_Recompute]] = {}
    for p in plans:
        at.setdefault(p.at, []).append(p)
    sub: dict = {}

    def renamed(atoms, table):
        return [table.get(a, a) if _is_var(a) else a for a in atoms]

    new_eqns = []
    for j, eqn in enumerate(jaxpr.eqns):
        for p in at.get(j, ()):
            ins = renamed(p.boundary + p.ties, sub)
            outs = [jcore.Var(a.aval) for a in ins]
            first = jaxpr.eqns[p.eqns[0]]
            new_eqns.append(jcore.new_jaxpr_eqn(ins, outs, barrier, {}, frozenset(),
                                                first.source_info, first.ctx))
            local = dict(zip(p.boundary, outs))
            for i in p.eqns:
                e = jaxpr.eqns[i]
                copies = [jcore.Var(v.aval) if _is_var(v) else v for v in e.outvars]
                new_eqns.append(e.replace(invars=renamed(e.invars, local), outvars=copies))
                local.update((v, c) for v, c in zip(e.outvars, copies) if _is_var(v))
            sub.update((v, local[v]) for v in p.residuals)
        new_eqns.append(eqn.replace(invars=renamed(eqn.invars, sub)) if sub else eqn)
    new = jcore.Jaxpr(jaxpr.constvars, jaxpr.invars, renamed(jaxpr.outvars, sub), new_eqns,
                      jaxpr.effects, jaxpr.debug_info)
    return jcore.ClosedJaxpr(new, closed.consts)


def remat_layers(traced: Traced) -> dict[str, list[int]]:
    """The layers of a traced train step that rematerialization can apply to, in forward
    order, with their forward equations."""
    return forward_layers(traced.closed_jaxpr, parameter_layers(traced.in_tree))


def _scan_pairs(closed, in_tree) -> list[remat_scan.ScanPair]:
    """The layer stacks under a scan that the rewrite of ``passes.remat_scan`` applies to."""
    jaxpr = closed.jaxpr
    start = _backward_start(jaxpr.eqns)
    if start is None:
        return []
    owner = {v: name for v, name in zip(jaxpr.invars, parameter_layers(in_tree))
             if name is not None}
    return remat_scan.scan_pairs(jaxpr, owner, start)


def scanned_layers(traced: Traced) -> list[str]:
    """The layers whose parameters a top-level ``scan`` reads (an ``nn.scan`` stack) that this
    pass cannot rematerialize: no backward scan slices that scan's residuals."""
    jaxpr = traced.closed_jaxpr.jaxpr
    owner = {v: name for v, name in zip(jaxpr.invars, parameter_layers(traced.in_tree))
             if name is not None}
    paired = {p.layer for p in _scan_pairs(traced.closed_jaxpr, traced.in_tree)}
    return list(dict.fromkeys(owner[a] for eqn in jaxpr.eqns if eqn.primitive is P.scan_p
                              for a in eqn.invars if _is_var(a) and a in owner
                              and owner[a] not in paired))


def _plans(traced: Traced, layers, policy: RematPolicy) -> list[_Recompute]:
    """The rewrites of the unrolled ``layers`` (None: every layer) under ``policy``, in their
    order; a stack under a scan is left to ``passes.remat_scan``. Every layer's are made once
    per program and policy (kept on its graph): the remat search asks for them to size the
    layers' residuals, then to rewrite some."""
    key = ("remat.plans", policy)
    every = traced.graph.analyses.get(key)
    if every is None:
        closed = traced.closed_jaxpr
        forward = remat_layers(traced)
        stacked = {p.layer for p in _scan_pairs(closed, traced.in_tree)}
        start = _backward_start(closed.jaxpr.eqns)
        uses, producer = _uses_and_producers(closed.jaxpr)
        every = traced.graph.analyses[key] = {
            name: _plan_layer(closed.jaxpr, name, forward[name], policy, uses, producer, start)
            for name in forward if name not in stacked}
    return [every[name] for name in (every if layers is None else layers)
            if every.get(name) is not None]


def residual_bytes(traced: Traced, policy: RematPolicy) -> dict[str, int]:
    """Layer -> the bytes (whole arrays, unsharded) of the values ``policy`` would recompute
    instead of keeping, for every layer it applies to; for a stack under a scan, less the
    stacked layer inputs kept instead."""
    saved = {p.layer: sum(v.aval.size * v.aval.dtype.itemsize for v in p.residuals)
             for p in _plans(traced, None, policy)}
    for pair in _scan_pairs(traced.closed_jaxpr, traced.in_tree):
        freed = remat_scan.saved_bytes(traced.closed_jaxpr.jaxpr, pair,
                                       keep_dots=policy is RematPolicy.DOTS)
        if freed > 0:
            saved[pair.layer] = freed
    return saved


def rematerialize(traced: Traced, layers: list[str], policy: RematPolicy) -> Traced:
    """``traced`` with ``layers`` rematerialized under ``policy``: a new jaxpr, traced to a new
    graph. Layers with nothing to recompute are left as they are."""
    plans = _plans(traced, layers, policy)
    closed = _rewrite(traced.closed_jaxpr, plans) if plans else traced.closed_jaxpr
    pairs = [p for p in _scan_pairs(closed, traced.in_tree) if p.layer in layers]
    if pairs:
        closed = remat_scan.rewrite(closed, pairs, keep_dots=policy is RematPolicy.DOTS)
    if closed is traced.closed_jaxpr:
        return traced
    return from_jaxpr(closed, traced.in_tree, traced.out_tree, traced.out_avals)
