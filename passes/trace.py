"""Pass 1, trace: a user function and example arguments become a Graph IR.

``jax.make_jaxpr`` gives the jaxpr. Calls (jit, closed_call, custom_jvp/vjp calls, remat) are
inlined: their bodies are planned like the rest, and emission re-creates the call around them.
Loops and branches (scan, while, cond) keep one copy of their body in the graph, joined to the
outside by boundary nodes (NodeKind.CARRY, SCAN_IN, SCAN_OUT, MERGE), so that a carried value
keeps one sharding across iterations and a loop body's costs are counted once per trip.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as P

from autopar._compat import primitives, scan_counts
from autopar._mesh import off_explicit_mesh, on_explicit_axes
from autopar.errors import (ArgumentError, AutoparError, TracingError, autopar_file,
                            jax_file)
from autopar.passes import attention_match
from autopar.passes.ir import Graph, NodeKind
from autopar.passes.rules import info_of

#: Calls whose body is inlined for planning (emission re-creates the call around it).
CALLS = frozenset((P.jit_p, P.closed_call_p, P.call_p, P.remat_p, P.custom_jvp_call_p,
                   P.custom_vjp_call_p, *primitives("custom_vjp_call_jaxpr_p")))
#: The calls emission re-binds as the original primitive, so their custom derivatives survive.
CUSTOM_CALLS = frozenset((P.custom_jvp_call_p, P.custom_vjp_call_p,
                          *primitives("custom_vjp_call_jaxpr_p")))
def constraint_label(node) -> str:
    """How messages name a node that pins its result to a sharding (``OpInfo.pin_param``): a
    `with_sharding_constraint`, or a `jax.sharding.reshard` jax adds."""
    what = ("with_sharding_constraint" if node.primitive is lax.sharding_constraint_p
            else f"jax.sharding.{node.prim}")
    return f"{what} at {node.where}"


@dataclass
class Traced:
    graph: Graph
    closed_jaxpr: Any
    in_tree: Any
    out_tree: Any
    in_avals: tuple
    out_avals: tuple


def call_body(eqn) -> tuple[Any, tuple]:
    """The inner jaxpr of a call-like equation and its constants."""
    params = eqn.params
    inner = params.get("jaxpr", params.get("call_jaxpr", params.get("fun_jaxpr")))
    if isinstance(inner, jcore.ClosedJaxpr):
        return inner.jaxpr, tuple(inner.consts)
    return inner, ()


def check_args(args) -> tuple[list, Any]:
    leaves, treedef = jax.tree_util.tree_flatten(args)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    for path, leaf in zip(paths, leaves):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise ArgumentError(
                f"example argument leaf `args{path}` is of type {type(leaf).__name__}, not an array. "
                "Pass arrays or jax.ShapeDtypeStruct leaves; close over Python values in `fn`, "
                "or mark them static with functools.partial.")
        if _untraceable(leaf.dtype):
            raise ArgumentError(
                f"example argument leaf `args{path}` is an array of dtype {leaf.dtype}, which "
                "jax cannot trace. Pass numeric or boolean arrays; close over other values in "
                "`fn`, or mark them static with functools.partial.")
    return leaves, treedef


def _untraceable(dtype) -> bool:
    """A numpy dtype jax has no type for: objects, strings, bytes, dates, records (bfloat16
    and the other ml_dtypes are kind "V" too, without fields; jax's float0, the tangent type
    of integers, is a record jax traces)."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # a jax extended dtype (PRNG keys): jax's own
        return False
    if dtype == jax.dtypes.float0:
        return False
    return dtype.kind in "OSUMm" or dtype.fields is not None


def trace(fn: Callable, args: tuple) -> Traced:
    leaves, in_tree = check_args(args)
    args = jax.tree_util.tree_unflatten(in_tree, [_off_explicit_axes(x) for x in leaves])
    with attention_match.recognizing(), off_explicit_mesh():  # recognizing: attention_match
        try:
            closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        except AutoparError:
            raise
        except Exception as e:  # the user's function: say so, keep theirs as the cause
            name = getattr(fn, "__name__", fn)
            inside = _autopar_frame(e)
            if inside is not None:  # autopar's own code failed (inside autopar.value_and_grad)
                raise TracingError(
                    f"tracing `{name}` failed inside autopar ({inside}): {type(e).__name__}: "
                    f"{e}. This is a bug in autopar, not in the function: please report it "
                    "with the function (where a pipeline was asked for, `pipeline=None` "
                    "avoids the code autopar runs while it traces).") from e
            raise TracingError(
                f"tracing `{name}` on its example arguments failed: "
                f"{type(e).__name__}: {e} (fix the function or its example arguments; the "
                "traceback above points into it)") from e
        closed = attention_match.recognize(closed, whole_step=True)[0] or closed  # no gradient
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    return from_jaxpr(unwrap_jit(closed), in_tree, out_tree, tuple(out_leaves))


def _autopar_frame(e: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``e``'s traceback outside jax (below the trace
    that caught it), where that frame is autopar's own code (not its bundled models), else
    None: the user's code (or a library it calls) raised, or jax raised calling it."""
    last = None
    for frame, line in list(traceback.walk_tb(e.__traceback__))[1:]:
        path = os.path.realpath(frame.f_code.co_filename)
        if not jax_file(path):
            last = (path, line)
    if last is None or not autopar_file(last[0], models=False):
        return None
    return f"{os.path.basename(last[0])}:{last[1]}"


def _off_explicit_axes(leaf):
    """An argument placed on a mesh with Explicit (or Manual) axes traces as a plain one: its
    sharding is part of its type there, and jax's sharding-in-types rules would then pin the
    program's shardings; autopar plans them, and the plan runs on Auto axes
    (``autopar.Plan.jit`` places such arguments)."""
    if on_explicit_axes(leaf):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    return leaf


def unwrap_jit(closed):
    """The body of a jaxpr that is one ``jit`` of the whole function (``fn`` was ``jax.jit``-ed):
    its equations at the top level, where ``passes.remat`` finds the train step's forward and
    backward passes. Planning inlines calls anyway; the jit's own shardings are not read,
    as for any inner call."""
    while True:
        jaxpr = closed.jaxpr
        if len(jaxpr.eqns) != 1 or jaxpr.constvars:
            return closed
        eqn = jaxpr.eqns[0]
        inner = eqn.params.get("jaxpr")
        if (eqn.primitive is not P.jit_p or not isinstance(inner, jcore.ClosedJaxpr)
                or list(eqn.invars) != list(jaxpr.invars)
                or list(eqn.outvars) != list(jaxpr.outvars)):
            return closed
        closed = inner


def from_jaxpr(closed, in_tree, out_tree, out_avals: tuple) -> Traced:
    """The Graph IR of a closed jaxpr whose arguments and results flatten by ``in_tree`` and
    ``out_tree`` (``trace``'s own, or a rewritten jaxpr of the same function: ``passes.remat``)."""
    graph = Graph()
    t = _Tracer(graph)
    jaxpr = closed.jaxpr
    for var in jaxpr.invars:
        vid = graph.new_value(var.aval.shape, var.aval.dtype)
        node = graph.add_node(NodeKind.INPUT, "input", (), (), (vid,))
        graph.input_nodes.append(node.id)
        graph.var_values[((), var)] = vid
    for var, const in zip(jaxpr.constvars, closed.consts):
        graph.var_values[((), var)] = t.const(np.shape(const), var.aval.dtype)
    t.walk(jaxpr, (), 1)
    for atom in jaxpr.outvars:
        vid = t.read((), atom)
        node = graph.add_node(NodeKind.OUTPUT, "output", (vid,), (_aval(atom),), ())
        graph.output_nodes.append(node.id)
    graph.verify()
    return Traced(graph, closed, in_tree, out_tree, tuple(v.aval for v in jaxpr.invars),
                  out_avals)


def _aval(atom):
    return (tuple(atom.aval.shape), atom.aval.dtype)


def _where(eqn) -> str:
    stack = str(eqn.source_info.name_stack)
    return stack or eqn.primitive.name


class _Tracer:
    def __init__(self, graph: Graph):
        self.g = graph

    def const(self, shape, dtype) -> int:
        vid = self.g.new_value(shape, dtype)
        self.g.add_node(NodeKind.CONST, "const", (), (), (vid,))
        return vid

    def read(self, scope, atom) -> int:
        """The value of an atom; a literal becomes a replicated constant."""
        if isinstance(atom, jcore.Literal):
            return self.const(np.shape(atom.val), atom.aval.dtype)
        return self.g.var_values[(scope, atom)]

    def read_operand(self, scope, atom) -> int | None:
        if isinstance(atom, jcore.Literal):
            return None
        return self.g.var_values[(scope, atom)]

    def bind_inputs(self, scope, invars, vids) -> None:
        for var, vid in zip(invars, vids):
            self.g.var_values[(scope, var)] = vid

    def bind_outputs(self, scope, outvars, vids) -> None:
        for var, vid in zip(outvars, vids):
            if not isinstance(var, jcore.DropVar):
                self.g.var_values[(scope, var)] = vid

    def walk(self, jaxpr, scope: tuple, trip: int) -> None:
        for i, eqn in enumerate(jaxpr.eqns):
            _HANDLERS.get(eqn.primitive, _Tracer.op)(self, eqn, scope, i, trip)

    # ----- ordinary equations
    def op(self, eqn, scope, i, trip) -> None:
        ins = [self.read_operand(scope, a) for a in eqn.invars]
        outs = [self.g.new_value(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
        pin_param = info_of(eqn.primitive).pin_param
        pinned = None if pin_param is None else (eqn.params[pin_param],)
        node = self.g.add_node(NodeKind.OP, eqn.primitive.name, ins,
                               [_aval(a) for a in eqn.invars], outs, params=dict(eqn.params),
                               trip_count=trip, where=_where(eqn), pinned=pinned,
                               primitive=eqn.primitive)
        self.g.eqn_nodes[scope + (i,)] = node.id
        self.bind_outputs(scope, eqn.outvars, outs)

    def multi_identity(self, eqn, scope, i, trip) -> None:
        outs = []
        for atom, var in zip(eqn.invars, eqn.outvars):
            vid = self.g.new_value(var.aval.shape, var.aval.dtype)
            self.g.add_node(NodeKind.OP, eqn.primitive.name, (self.read(scope, atom),),
                            (_aval(atom),), (vid,), trip_count=trip, where=_where(eqn),
                            primitive=eqn.primitive)
            outs.append(vid)
        self.bind_outputs(scope, eqn.outvars, outs)

    def call(self, eqn, scope, i, trip) -> None:
        inner, consts = call_body(eqn)
        inner_scope = scope + (i,)
        ins = [self.read(scope, a) for a in eqn.invars]
        self.bind_inputs(inner_scope, inner.constvars,
                         [self.const(np.shape(c), v.aval.dtype) for v, c in zip(inner.constvars, consts)])
        self.bind_inputs(inner_scope, inner.invars, ins)
        self.walk(inner, inner_scope, trip)
        self.bind_outputs(scope, eqn.outvars, [self.read(inner_scope, a) for a in inner.outvars])

    # ----- regions
    def _carry_nodes(self, scope, init_atoms, trip, body_trip):
        carries = []
        for atom in init_atoms:
            vid = self.g.new_value(atom.aval.shape, atom.aval.dtype)
            node = self.g.add_node(NodeKind.CARRY, "carry", (self.read(scope, atom), None),
                                   (_aval(atom), _aval(atom)), (vid,), trip_count=trip,
                                   in_trips=(trip, body_trip))
            carries.append(node)
        return carries

    def _close_carries(self, carries, body_scope, out_atoms) -> None:
        for node, atom in zip(carries, out_atoms):
            node.ins = (node.ins[0], self.read(body_scope, atom))

    def _bind_closed(self, scope, closed) -> None:
        self.bind_inputs(scope, closed.jaxpr.constvars,
                         [self.const(np.shape(c), v.aval.dtype)
                          for v, c in zip(closed.jaxpr.constvars, closed.consts)])

    def scan(self, eqn, scope, i, trip) -> None:
        p = eqn.params
        body, n_consts, n_carry, length = p["jaxpr"], scan_counts(p)[0], scan_counts(p)[1], p["length"]
        body_scope, body_trip = scope + (i,), trip * int(length)
        consts = eqn.invars[:n_consts]
        inits = eqn.invars[n_consts:n_consts + n_carry]
        xs = eqn.invars[n_consts + n_carry:]
        carries = self._carry_nodes(scope, inits, trip, body_trip)
        x_vals = []
        for atom, var in zip(xs, body.jaxpr.invars[n_consts + n_carry:]):
            vid = self.g.new_value(var.aval.shape, var.aval.dtype)
            self.g.add_node(NodeKind.SCAN_IN, "scan_in", (self.read(scope, atom),),
                            (_aval(atom),), (vid,), trip_count=trip)
            x_vals.append(vid)
        self._bind_closed(body_scope, body)
        self.bind_inputs(body_scope, body.jaxpr.invars,
                         [self.read(scope, a) for a in consts] +
                         [c.outs[0] for c in carries] + x_vals)
        self.walk(body.jaxpr, body_scope, body_trip)
        self._close_carries(carries, body_scope, body.jaxpr.outvars[:n_carry])
        y_nodes = []
        for atom, var in zip(body.jaxpr.outvars[n_carry:], eqn.outvars[n_carry:]):
            vid = self.g.new_value(var.aval.shape, var.aval.dtype)
            y_nodes.append(self.g.add_node(NodeKind.SCAN_OUT, "scan_out",
                                           (self.read(body_scope, atom),), (_aval(atom),), (vid,),
                                           trip_count=trip))
        self.g.region_nodes[scope + (i,)] = {
            "carry": [c.id for c in carries],
            "scan_in": [self.g.producer[v][0] for v in x_vals],
            "scan_out": [n.id for n in y_nodes]}
        self.bind_outputs(scope, eqn.outvars,
                          [c.outs[0] for c in carries] + [n.outs[0] for n in y_nodes])

    def while_loop(self, eqn, scope, i, trip) -> None:
        # The trip count of a while loop is unknown before it runs: its body is counted once.
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts = eqn.invars[:nc], eqn.invars[nc:nc + nb]
        carries = self._carry_nodes(scope, eqn.invars[nc + nb:], trip, trip)
        carry_vals = [c.outs[0] for c in carries]
        cond_scope, body_scope = scope + (i, "cond"), scope + (i, "body")
        for sub_scope, closed, consts in ((cond_scope, p["cond_jaxpr"], cond_consts),
                                          (body_scope, p["body_jaxpr"], body_consts)):
            self._bind_closed(sub_scope, closed)
            self.bind_inputs(sub_scope, closed.jaxpr.invars,
                             [self.read(scope, a) for a in consts] + carry_vals)
            self.walk(closed.jaxpr, sub_scope, trip)
        self._close_carries(carries, body_scope, p["body_jaxpr"].jaxpr.outvars)
        self.g.region_nodes[scope + (i,)] = {"carry": [c.id for c in carries]}
        self.bind_outputs(scope, eqn.outvars, carry_vals)

    def cond(self, eqn, scope, i, trip) -> None:
        ops = [self.read(scope, a) for a in eqn.invars[1:]]
        branch_outs = []
        for b, closed in enumerate(eqn.params["branches"]):
            sub_scope = scope + (i, b)
            self._bind_closed(sub_scope, closed)
            self.bind_inputs(sub_scope, closed.jaxpr.invars, ops)
            self.walk(closed.jaxpr, sub_scope, trip)
            branch_outs.append([self.read(sub_scope, a) for a in closed.jaxpr.outvars])
        merges = []
        for k, var in enumerate(eqn.outvars):
            vid = self.g.new_value(var.aval.shape, var.aval.dtype)
            ins = tuple(outs[k] for outs in branch_outs)
            merges.append(self.g.add_node(NodeKind.MERGE, "merge", ins, (_aval(var),) * len(ins),
                                          (vid,), trip_count=trip))
        self.g.region_nodes[scope + (i,)] = {"merge": [n.id for n in merges]}
        self.bind_outputs(scope, eqn.outvars, [n.outs[0] for n in merges])


# Calls, control flow, and the primitives whose operands pass through one to one (planned as
# independent identities: one node per operand, named after the primitive); the rest are ops.
_HANDLERS = {**dict.fromkeys(CALLS, _Tracer.call), P.scan_p: _Tracer.scan,
             P.while_p: _Tracer.while_loop, P.cond_p: _Tracer.cond,
             lax.optimization_barrier_p: _Tracer.multi_identity}
