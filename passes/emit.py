"""Pass 9, emit: the planned program as a jaxpr interpreter that pins every planned value.

The interpreter walks the traced jaxpr and re-binds each equation. Each result is pinned with
``jax.lax.with_sharding_constraint`` at the spec the solver chose. Where a consumer's strategy
wants an operand in another spec, the operand is moved there through the steps of
``cost_model.collectives.plan_redistribute``, each pinned in turn, so XLA performs exactly the
collectives the plan priced. Calls are inlined; remat bodies are re-wrapped in
``jax.checkpoint``; custom_jvp/vjp calls are re-bound as the original primitive so their custom
derivatives survive; scan, while and cond are rebuilt with lax, their bodies interpreted the same
way. Shardings live on an Auto-axes copy of the user's mesh.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as P
from jax.sharding import NamedSharding

from autopar._compat import equation_context, scan_counts
from autopar.cost_model.collectives import plan_redistribute
from autopar.passes.ir import Graph, NodeKind, itemsize
from autopar.cost_model.spec import Spec
from autopar.passes.backend_options import OptionNote, as_options
from autopar.passes.rules import info_of
from autopar.passes.strategies import Rewrite, RewriteKind
from autopar.passes.trace import CALLS, CUSTOM_CALLS, Traced, call_body

_REGIONS = {P.scan_p: "emit_scan", P.while_p: "emit_while", P.cond_p: "emit_cond"}

#: ``(emitter, eqn, operands moved to the strategy's in_specs, rewrite) -> results``: how a
#: node whose strategy carries a :class:`Rewrite` of that kind is emitted; the equation's
#: results, then the operands the rewrite keeps (``Rewrite.keeps``), in its order.
RewriteEmitter = Callable[["Emitter", Any, list, Rewrite], list]
REWRITES: dict[RewriteKind, RewriteEmitter] = {}


def _constrainable(x) -> bool:
    return (hasattr(x, "ndim") and x.ndim > 0
            and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended))


def values_pinned_by_their_converts(graph: Graph, value_specs: dict[int, Spec],
                                    node_in_specs: dict[int, tuple]) -> set[int]:
    """The values made by an op and read only by dtype converts that keep their spec: their
    converts' pins fix them too. Left unpinned, a round trip of converts (XLA:CPU's bf16 result
    of an f32 dot, then the program's cast back to f32) stays adjacent, and XLA folds it where
    excess precision is allowed, as it does in a program with no constraints."""
    out = set()
    for vid, uses in graph.consumers().items():
        spec = value_specs.get(vid)
        made_by = graph.producer.get(vid)
        if (spec is None or made_by is None
                or graph.nodes[made_by[0]].kind is not NodeKind.OP):
            continue
        if all(_keeps_spec(graph.nodes[n], node_in_specs.get(n), pos, spec, value_specs)
               for n, pos in uses):
            out.add(vid)
    return out


def _keeps_spec(node, in_specs, pos: int, spec: Spec, value_specs) -> bool:
    return (node.kind is NodeKind.OP and node.primitive is lax.convert_element_type_p
            and in_specs is not None and in_specs[pos] == spec
            and value_specs.get(node.outs[0]) == spec)


class Emitter:
    def __init__(self, traced: Traced, value_specs: dict[int, Spec],
                 node_in_specs: dict[int, tuple], mesh,
                 node_rewrites: dict[int, Rewrite] | None = None):
        self.graph: Graph = traced.graph
        self.value_specs = value_specs        # value id -> spec of its producer's strategy
        self.node_in_specs = node_in_specs    # node id -> operand specs of its strategy
        self.node_rewrites = node_rewrites or {}  # node id -> its strategy's rewrite
        self.mesh = mesh
        self.sizes_items = tuple(zip(mesh.axis_names, mesh.devices.shape))
        # value id -> a function rebuilding it, for recomputable values (broadcasts of a
        # scalar): moving one means building it again in the new spec, with no collective.
        self.rebuild: dict[int, Callable] = {}
        self.unpinned = values_pinned_by_their_converts(self.graph, value_specs, node_in_specs)
        # (scope, value id, spec) -> the value in that spec, returned by a rewrite that moved
        # it (Rewrite.keeps): later readers in the scope, or in one nested in it (they close
        # over it), that want that spec take it
        self.kept: dict[tuple, Any] = {}

    # ----- pinning and moving values
    def pin(self, x, spec: Spec | None):
        if spec is None or not _constrainable(x):
            return x
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, spec.to_partition_spec()))

    def vid(self, scope, atom) -> int | None:
        if isinstance(atom, jcore.Literal):
            return None
        return self.graph.var_values.get((scope, atom))

    def move(self, x, vid: int | None, dst: Spec | None):
        """x, the value vid, moved to spec dst by the planned redistribution steps."""
        if dst is None or not _constrainable(x):
            return x
        src = self.value_specs.get(vid) if vid is not None else None
        if src is None or src == dst:
            return x if vid in self.unpinned else self.pin(x, dst)
        if vid in self.rebuild:
            return self.pin(self.rebuild[vid](), dst)
        for step in plan_redistribute(src, dst, tuple(x.shape), itemsize(x.dtype),
                                      self.sizes_items):
            x = self.pin(x, step.after)
        return x

    def feed(self, xs, scope, atoms, node: int, positions):
        """Operands xs (atoms in scope) moved to what node's strategy wants at positions."""
        wanted = self.node_in_specs[node]
        out = []
        for x, a, p in zip(xs, atoms, positions):
            vid = self.vid(scope, a)
            kept = self._kept(scope, vid, wanted[p]) if self.kept else None
            out.append(self.move(x, vid, wanted[p]) if kept is None else kept)
        return out

    def _kept(self, scope, vid, spec):
        """The value ``vid`` in ``spec`` as a rewrite in ``scope`` or one enclosing it returned
        it (:attr:`kept`), or None."""
        for n in range(len(scope), -1, -1):
            if (scope[:n], vid, spec) in self.kept:
                return self.kept[scope[:n], vid, spec]
        return None

    def pin_results(self, scope, outvars, vals):
        out = []
        for var, v in zip(outvars, vals):
            vid = None if isinstance(var, jcore.DropVar) else self.vid(scope, var)
            out.append(v if vid is None or vid in self.unpinned
                       else self.pin(v, self.value_specs.get(vid)))
        return out

    # ----- interpretation
    def run(self, jaxpr, consts, args, scope: tuple):
        env: dict[Any, Any] = {}

        def read(atom):
            return atom.val if isinstance(atom, jcore.Literal) else env[atom]

        for var, val in zip(jaxpr.constvars, consts):
            env[var] = val
        for var, val in zip(jaxpr.invars, args):
            env[var] = val
        for i, eqn in enumerate(jaxpr.eqns):
            outs = self.equation(eqn, [read(a) for a in eqn.invars], scope, i)
            for var, val in zip(eqn.outvars, outs):
                if not isinstance(var, jcore.DropVar):
                    env[var] = val
        return [read(a) for a in jaxpr.outvars]

    def equation(self, eqn, invals, scope, i) -> list:
        if eqn.primitive in _REGIONS:
            return getattr(self, _REGIONS[eqn.primitive])(eqn, invals, scope, i)
        if eqn.primitive in CALLS and eqn.primitive not in CUSTOM_CALLS:
            inner, consts = call_body(eqn)
            body = lambda *a: self.run(inner, consts, a, scope + (i,))  # noqa: E731
            if eqn.primitive is P.remat_p:
                body = jax.checkpoint(body, prevent_cse=eqn.params["prevent_cse"],
                                      policy=eqn.params["policy"])
            return list(body(*invals))
        node = self.graph.eqn_nodes.get(scope + (i,))
        if node is not None:
            invals = self.feed(invals, scope, eqn.invars, node, range(len(invals)))
        if info_of(eqn.primitive).pin_param is not None:
            return self.pin_results(scope, eqn.outvars, invals)
        if node in self.node_rewrites:
            rewrite = self.node_rewrites[node]
            outs = REWRITES[rewrite.kind](self, eqn, invals, rewrite)
            for (pos, spec), x in zip(rewrite.keeps, outs[len(eqn.outvars):]):
                self.kept[scope, self.vid(scope, eqn.invars[pos]), spec] = self.pin(x, spec)
            return self.pin_results(scope, eqn.outvars, outs[:len(eqn.outvars)])

        def bind():
            with eqn.ctx.manager, equation_context(eqn):
                return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
        out = bind()
        outs = list(out) if eqn.primitive.multiple_results else [out]
        if node is not None and self.graph.nodes[node].outs and \
                self.graph.values[self.graph.nodes[node].outs[0]].recomputable:
            self.rebuild[self.graph.nodes[node].outs[0]] = bind
        return self.pin_results(scope, eqn.outvars, outs)

    # ----- regions
    def emit_scan(self, eqn, invals, scope, i):
        p = eqn.params
        body, (nc, ncar) = p["jaxpr"], scan_counts(p)
        nodes = self.graph.region_nodes[scope + (i,)]
        body_scope = scope + (i,)
        consts = invals[:nc]
        init = [self.feed([x], scope, [a], n, [0])[0] for x, a, n in
                zip(invals[nc:nc + ncar], eqn.invars[nc:nc + ncar], nodes["carry"])]
        xs = [self.feed([x], scope, [a], n, [0])[0] for x, a, n in
              zip(invals[nc + ncar:], eqn.invars[nc + ncar:], nodes["scan_in"])]
        carry_outs, y_outs = body.jaxpr.outvars[:ncar], body.jaxpr.outvars[ncar:]
        ahead = _Ahead(self, nodes["scan_in"], xs, p["length"], p["reverse"])

        def step(carry, x):
            carry, x = ahead.take(carry, x)
            x = [self.pin(v, self.value_specs[self.graph.nodes[n].outs[0]])
                 for v, n in zip(x, nodes["scan_in"])]
            outs = self.run(body.jaxpr, body.consts, consts + list(carry) + list(x), body_scope)
            new = [self.feed([v], body_scope, [a], n, [1])[0]
                   for v, a, n in zip(outs[:ncar], carry_outs, nodes["carry"])]
            ys = [self.feed([v], body_scope, [a], n, [0])[0]
                  for v, a, n in zip(outs[ncar:], y_outs, nodes["scan_out"])]
            return ahead.give(new), ys

        carry, ys = jax.lax.scan(step, ahead.init(init), ahead.scanned(xs), length=p["length"],
                                 reverse=p["reverse"], unroll=p["unroll"])
        return self.pin_results(scope, eqn.outvars, list(carry)[:ncar] + list(ys))

    def emit_while(self, eqn, invals, scope, i):
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts = invals[:nc], invals[nc:nc + nb]
        cond_j, body_j = p["cond_jaxpr"], p["body_jaxpr"]
        carries = self.graph.region_nodes[scope + (i,)]["carry"]
        body_scope = scope + (i, "body")
        init = [self.feed([x], scope, [a], n, [0])[0]
                for x, a, n in zip(invals[nc + nb:], eqn.invars[nc + nb:], carries)]

        def cond_fun(carry):
            return self.run(cond_j.jaxpr, cond_j.consts, cconsts + list(carry),
                            scope + (i, "cond"))[0]

        def body_fun(carry):
            outs = self.run(body_j.jaxpr, body_j.consts, bconsts + list(carry), body_scope)
            return [self.feed([v], body_scope, [a], n, [1])[0]
                    for v, a, n in zip(outs, body_j.jaxpr.outvars, carries)]

        return self.pin_results(scope, eqn.outvars,
                                list(jax.lax.while_loop(cond_fun, body_fun, init)))

    def emit_cond(self, eqn, invals, scope, i):
        index, ops = invals[0], invals[1:]
        merges = self.graph.region_nodes[scope + (i,)]["merge"]

        def branch(b, closed):
            def f(*a):
                outs = self.run(closed.jaxpr, closed.consts, a, scope + (i, b))
                return [self.feed([v], scope + (i, b), [atom], n, [b])[0]
                        for v, atom, n in zip(outs, closed.jaxpr.outvars, merges)]
            return f

        fns = [branch(b, c) for b, c in enumerate(eqn.params["branches"])]
        return self.pin_results(scope, eqn.outvars, list(jax.lax.switch(index, fns, *ops)))


class _Ahead:
    """A scan's prefetched inputs (``RewriteKind.PREFETCH`` on their ``scan_in`` node): each
    is taken out of the scanned inputs, its first iteration's slice moved to the spec the
    body takes it in before the loop, and each iteration moves the next one's while the body
    runs, carrying it (with the iteration's number) to the next iteration."""

    def __init__(self, emitter: Emitter, scan_in: list[int], xs: list, length: int,
                 reverse: bool):
        self.emitter, self.xs, self.length, self.reverse = emitter, xs, length, reverse
        self.specs = [emitter.value_specs[emitter.graph.nodes[n].outs[0]] for n in scan_in]
        self.sliced = [Spec(emitter.node_in_specs[n][0].dims[1:]) for n in scan_in]
        self.ks = [k for k, n in enumerate(scan_in) if getattr(
            emitter.node_rewrites.get(n), "kind", None) is RewriteKind.PREFETCH]
        self.t = None

    def _slice(self, k: int, t):
        """Iteration ``t``'s slice of input ``k``, moved (gathered) to the body's spec."""
        at = self.length - 1 - t if self.reverse else t
        x = lax.dynamic_index_in_dim(self.xs[k], at, 0, keepdims=False)
        return self.emitter.pin(self.emitter.pin(x, self.sliced[k]), self.specs[k])

    def init(self, carry: list) -> list:
        if not self.ks:
            return carry
        return list(carry) + [jnp.int32(0)] + [self._slice(k, 0) for k in self.ks]

    def scanned(self, xs: list) -> list:
        return [x for k, x in enumerate(xs) if k not in self.ks]

    def take(self, carry, x) -> tuple[list, list]:
        """(the body's carry, its scanned inputs, the prefetched ones in place)."""
        if not self.ks:
            return list(carry), list(x)
        ncar = len(carry) - 1 - len(self.ks)
        self.t = carry[ncar]
        ahead = dict(zip(self.ks, carry[ncar + 1:]))
        scanned = iter(x)
        return (list(carry[:ncar]),
                [ahead[k] if k in ahead else next(scanned) for k in range(len(self.specs))])

    def give(self, carry: list) -> list:
        """The new carry, with the next iteration's slices (the last iteration takes its own
        again: its prefetch is not used)."""
        if not self.ks:
            return carry
        nxt = jnp.minimum(self.t + 1, self.length - 1)
        return list(carry) + [self.t + 1] + [self._slice(k, nxt) for k in self.ks]


def build_flat_fn(traced: Traced, value_specs, node_in_specs, mesh,
                  node_rewrites: dict[int, Rewrite] | None = None) -> Callable:
    """A function of the flat argument list that runs the planned program; its results are
    already moved to the specs the output nodes chose. ``node_rewrites``: the nodes whose
    strategy is emitted as a region (:data:`REWRITES`)."""
    emitter = Emitter(traced, value_specs, node_in_specs, mesh, node_rewrites)
    closed = traced.closed_jaxpr
    graph = traced.graph

    def flat_fn(*flat_args):
        outs = emitter.run(closed.jaxpr, closed.consts, flat_args, ())
        return [emitter.feed([x], (), [a], n, [0])[0]
                for x, a, n in zip(outs, closed.jaxpr.outvars, graph.output_nodes)]
    return flat_fn


def compiler_option_notes(graph: Graph, platform: str) -> tuple[OptionNote, ...]:
    """XLA options the planned program needs on ``platform``, whatever the hardware profile.
    XLA:CPU expands optimization barriers early and then merges a rematerialized computation
    with its original (CSE), so rematerialization (``passes.remat``, or ``jax.checkpoint`` in
    the program) would save no memory there; keeping the barriers makes it behave as XLA:GPU
    and XLA:TPU do."""
    if platform == "cpu" and any(n.primitive is lax.optimization_barrier_p for n in graph.nodes):
        return (OptionNote(name="xla_disable_hlo_passes", value="cse_barrier_expander",
                           is_set=True,
                           why="XLA:CPU keeps the optimization barriers of rematerialized "
                               "layers, so recomputation is not merged back (CSE)"),)
    return ()


def compiler_options(graph: Graph, platform: str) -> dict:
    """:func:`compiler_option_notes` as a ``compiler_options`` dict."""
    return as_options(compiler_option_notes(graph, platform))
