"""Complete propagation (``search=False``, plain GSPMD): the plan XLA's own propagation makes.

It predicts what XLA's own propagation (Shardy, in jax 0.10) makes of the annotations, so
that a hand-written ``jax.jit`` program is predicted as it compiles. It runs in rounds of
widening reach (:class:`Level`, Shardy's op-priority schedule): elementwise and layout ops
first, then every op along the dims it maps from operands to results, then contracting and
reduced dims, broadcasts forward last. Each round visits the nodes in the order XLA lists
them, a sharding that changes sending its neighbours to the front (:func:`complete_sweeps`).
A visit gives a node's free values the splits its fixed neighbours imply; where those
conflict, the larger tensor's splits win (:func:`_complete_visit`). A propagated spec may grow
by splits in a later visit, never lose one. Propagation moves shardings, it never invents
one, and values still free at the end are replicated, as GSPMD defaults. Each node then takes
the strategy that keeps its values, or, where they conflict, the one XLA's partitioner would
take: computed in its result's sharding (:func:`_in_result_spec`; a gather or scatter keeps
its larger operand instead, :func:`_keeping_larger`), the rest resharded the cheapest way
(:func:`select`). That is the whole plan: no ILP.
"""

from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass

from jax import lax

from autopar.cost_model.spec import Spec
from autopar.passes.fixed import (
    Propagation,
    Splits,
    node_operands,
    origin_of,
    propagated_origin,
    spec_of,
    splits_of,
)
from autopar.passes.ir import Graph, Node
from autopar.passes.rules import op_info
from autopar.passes.strategies import MeshContext, Strategy


def _new_splits(s: Strategy, targets) -> int:
    return sum(len(spec_of(s, side, pos).axes) for side, pos, _ in targets)


def _tie(prop: Propagation, graph: Graph, ties) -> bool:
    """A state output and the input it replaces share one sharding, whichever is fixed first."""
    changed = False
    for out_node, in_node in ties:
        a, b = graph.nodes[in_node].outs[0], graph.nodes[out_node].ins[0]
        for src, dst in ((a, b), (b, a)):
            if prop.exact(src) and not prop.exact(dst):
                prop.fix(dst, prop.specs[src], propagated_origin(prop.origins[src].label))
                changed = True
    return changed


class Level(enum.IntEnum):
    """Complete mode's rounds, each run to its fixed point before the next widens the reach.
    They follow the op-priority schedule of Shardy's propagation (XLA's partitioner in jax
    0.10): a sharding settled in an early round is never undone, so the order decides which
    sharding a tensor takes where two meet. A batch split crosses the elementwise and layout
    ops first and then the dots along their batch and free dims, before a weight sharded on a
    contracting dim (an FSDP weight, a row-parallel one) is allowed to split the activations
    it meets; by then they are split already, and the weight is gathered instead."""
    SAME_TENSOR_SINGLE_USE = 0  # elementwise and layout ops whose operands have one use
    SAME_TENSOR = 1             # ... and with any number of uses
    PASS_THROUGH = 2            # every op, along dims it maps operands to results (no partial
                                # sums); a broadcast only backward
    ANY_BUT_BROADCAST_FORWARD = 3
    ANY = 4




def _is_broadcast(node: Node) -> bool:
    """A broadcast_in_dim that adds elements (XLA makes one adding only size-1 dims a reshape)."""
    return (node.primitive is lax.broadcast_in_dim_p
            and math.prod(node.in_avals[0][0]) != math.prod(node.params["shape"]))


def _broadcast_operands(graph: Graph, node: Node) -> frozenset[int]:
    """Operand positions of an elementwise op that broadcast size-1 dims (``x + b[None]``): XLA
    lowers each through a broadcast op, and propagation crosses it as it crosses broadcasts."""
    if not op_info(node).elementwise:
        return frozenset()
    out = graph.values[node.outs[0]].shape
    return frozenset(pos for pos, vid in node_operands(node)
                     if graph.values[vid].rank > 0 and graph.values[vid].shape != out)


def _directions(node: Node, level: Level, multi_use: set[int]) -> tuple[bool, ...]:
    """The directions (True: forward) ``node`` propagates in at ``level``."""
    if op_info(node).same_tensor and not _is_broadcast(node):
        if level is Level.SAME_TENSOR_SINGLE_USE and any(v in multi_use for _, v in
                                                         node_operands(node)):
            return ()  # each use might want another sharding: settled later
        return (True, False)
    if op_info(node).forward_only and level < Level.PASS_THROUGH:
        return (True,)
    if level < Level.PASS_THROUGH:
        return ()
    if _is_broadcast(node) and level < Level.ANY:
        return (False,)
    return (True, False)


def _allowed(strats: list[Strategy], level: Level) -> list[int]:
    """The strategies a visit may take at ``level``: before :attr:`Level.ANY_BUT_BROADCAST_FORWARD`
    none leaving partial sums (a split reaches a contracting or reduced dim only then)."""
    if level >= Level.ANY_BUT_BROADCAST_FORWARD:
        return list(range(len(strats)))
    return [i for i, s in enumerate(strats) if not s.collectives]


def _multi_use(graph: Graph) -> set[int]:
    """Values of rank >= 1 read by more than one operand slot."""
    return {v for v, uses in graph.consumers().items()
            if len(uses) > 1 and graph.values[v].rank > 0}


@dataclass
class _Shape:
    """What complete propagation reads of the graph alone, made once per graph (every seed's
    propagation walks the same graph)."""
    multi_use: set[int]
    broadcasts: list[frozenset]      # per node: see _broadcast_operands
    consumers: dict
    order: list[int]                 # _post_order
    kind_ids: list[int]              # per node: a class of what _directions reads of it
    kind_nodes: list[int]            # per class: a node of it
    neighbours: list[list[int]]      # per node: its operands' and results' values
    slots: list[list[tuple]]         # per node: ("in", pos, vid) / ("out", k, vid) slots
    open_slots: list[list[tuple]]    # ... without its broadcasting operands (see shut)

    @staticmethod
    def of(graph: Graph) -> _Shape:
        if "propagate.shape" not in graph.analyses:
            multi_use = _multi_use(graph)
            broadcasts = [_broadcast_operands(graph, node) for node in graph.nodes]
            operands = [node_operands(node) for node in graph.nodes]
            slots = [[("in", pos, vid) for pos, vid in ops]
                     + [("out", k, vid) for k, vid in enumerate(node.outs)]
                     for node, ops in zip(graph.nodes, operands)]
            classes: dict[tuple, int] = {}
            kind_ids = [classes.setdefault((node.kind, node.prim, _is_broadcast(node),
                                            any(v in multi_use for _, v in ops)), len(classes))
                        for node, ops in zip(graph.nodes, operands)]
            kind_nodes = [0] * len(classes)
            for node_id, k in reversed(list(enumerate(kind_ids))):
                kind_nodes[k] = node_id
            graph.analyses["propagate.shape"] = _Shape(
                multi_use, broadcasts, graph.consumers(), _post_order(graph), kind_ids,
                kind_nodes,
                [[v for _, v in ops] + list(node.outs)
                 for node, ops in zip(graph.nodes, operands)],
                slots,
                [[t for t in sl if not (t[0] == "in" and t[1] in b)] if b else sl
                 for sl, b in zip(slots, broadcasts)])
        return graph.analyses["propagate.shape"]


def complete_sweeps(graph: Graph, strats, prop: Propagation, ties, axis_sizes: dict) -> None:
    """Complete mode, level by level. Each level drains a worklist as Shardy's rewrite driver
    does: every node once, in the order XLA lists the program (:func:`_post_order`), and
    whenever a value changes, its producer and those of its consumers not yet waiting are
    visited next (last pushed, first visited). The order matters where two shardings race to
    a tensor: the one that arrives first is kept, the other one gets resharded."""
    shape = _Shape.of(graph)
    multi_use, broadcasts, consumers, order = (shape.multi_use, shape.broadcasts,
                                               shape.consumers, shape.order)
    neighbours = shape.neighbours
    # A visit decides from the node's inputs below and its neighbours' specs alone, so a node
    # whose inputs are as at its last visit and none of whose neighbours was fixed since is
    # skipped: it would decide the same (this keeps deep models fast). touched[n]: the stamp
    # of the last fix of one of n's neighbours.
    last_inputs: list = [None] * len(graph.nodes)
    last_stamp = [-1] * len(graph.nodes)
    touched = _touched(prop, neighbours)
    memo: dict = {}
    by_list: dict = {}  # see _allowed_per_node
    allowed_of: dict[bool, list] = {}  # reach -> the allowed list of every node
    for level in Level:
        wide = level >= Level.ANY_BUT_BROADCAST_FORWARD
        if wide not in allowed_of:
            allowed_of[wide] = _allowed_per_node(strats, level, by_list)
        allowed = allowed_of[wide]
        by_kind = [_directions(graph.nodes[n], level, multi_use) for n in shape.kind_nodes]
        dirs = [by_kind[k] for k in shape.kind_ids]
        # A broadcasting operand is crossed as a broadcast op: backward from PASS_THROUGH on,
        # forward only at ANY.
        none = frozenset()
        shut = broadcasts if level < Level.PASS_THROUGH else [none] * len(broadcasts)
        quiet = broadcasts if level < Level.ANY else [none] * len(broadcasts)
        stack = order[::-1]
        while stack:
            queued = set(stack)
            while stack:
                n = stack.pop()
                queued.discard(n)
                if not dirs[n] or not touched[n]:
                    continue  # (no neighbour fixed: nothing to propagate)
                inputs = (dirs[n], id(allowed[n]), shut[n], quiet[n])
                if inputs == last_inputs[n] and touched[n] <= last_stamp[n]:
                    continue
                last_inputs[n], last_stamp[n] = inputs, prop.stamp
                slots = shape.open_slots[n] if shut[n] else shape.slots[n]
                for vid in _complete_visit(graph, graph.nodes[n], strats[n], allowed[n], prop,
                                           dirs[n], axis_sizes, shut[n], quiet[n], memo, slots):
                    for m in [graph.producer[vid][0]] + [m for m, _ in consumers.get(vid, ())]:
                        touched[m] = prop.stamp
                        if m not in queued:
                            stack.append(m)
                            queued.add(m)
            prop.sweeps += 1
            if _tie(prop, graph, ties):
                stack = order[::-1]
                touched = _touched(prop, neighbours)


def _allowed_per_node(strats, level: Level, by_list: dict) -> list[list[int]]:
    """Per node, the strategies a visit may take at ``level`` (:func:`_allowed`). ``by_list``:
    one allowed list per strategy list and reach, shared across levels, so the memo can key
    on it."""
    wide = level >= Level.ANY_BUT_BROADCAST_FORWARD
    allowed = []
    for node_strats in strats:
        key = (id(node_strats), wide)
        if key not in by_list:
            by_list[key] = _allowed(node_strats, level)
            narrow = by_list.get((id(node_strats), False))
            if wide and narrow == by_list[key]:
                by_list[key] = narrow  # the same list: no reason to visit it again
        allowed.append(by_list[key])
    return allowed


def _touched(prop: Propagation, neighbours: list[list[int]]) -> list[int]:
    """Per node, the stamp of the last fix of one of its ``neighbours`` (0: none)."""
    fixed_at = prop.fixed_at
    return [max([fixed_at.get(v, 0) for v in vs], default=0) for vs in neighbours]


def _post_order(graph: Graph) -> list[int]:
    """Node ids in the order XLA hands the program to Shardy: a post-order walk from the results
    (in result order, each node's operands in operand order), as HLO lists its instructions;
    nodes no result needs come last. So the backward pass reaches a gradient along the chain
    the first result needs before a later result's branch (a norm's bias gradient) does."""
    seen, order = set(), []
    for root in graph.output_nodes + [n.id for n in graph.nodes]:
        stack = [(root, False)]
        while stack:
            node_id, expanded = stack.pop()
            if expanded:
                order.append(node_id)
                continue
            if node_id in seen:
                continue
            seen.add(node_id)
            stack.append((node_id, True))
            ins = [graph.producer[v][0] for v in graph.nodes[node_id].ins if v is not None]
            stack.extend((n, False) for n in reversed(ins) if n not in seen)
    return order


_VID = operator.itemgetter(2)  # a slot's value


def _complete_visit(graph: Graph, node: Node, strats: list[Strategy], allowed: list[int],
                    prop: Propagation, directions: tuple[bool, ...], axis_sizes: dict,
                    shut=frozenset(), quiet=frozenset(), memo: dict | None = None,
                    slots: list[tuple] | None = None) -> list[int]:
    """Complete mode: give ``node``'s free and propagated values (results if ``directions``
    holds True, forward; operands if it holds False, backward) the splits its fixed neighbours
    imply. Returns the values fixed. Operands at positions ``shut`` take no part; those at
    ``quiet`` are not sources.

    Every split of a fixed neighbour (mesh axis a splits dim d of value v) is a constraint on
    the strategy. Where they cannot all hold, the splits of the larger tensor win, as in
    Shardy's conflict resolution: taken from the largest tensor down (at an elementwise op,
    between tensors of one size, the dim split over more devices first), a split is kept when
    some strategy keeps it with those before, else dropped. Of the strategies keeping the kept
    splits, the one splitting the values it fixes least is taken (propagation moves shardings,
    it never invents one). A propagated sharding may grow by splits, it never loses one; a
    user annotation never changes.

    ``memo``: decisions by (strategy list, level's reach, the slots' specs): the copies of a
    layer share a strategy list (``passes.strategies``) and, in a deep model, meet the same
    specs, so each decision is made once. ``slots``: the node's slots without those ``shut``,
    when the caller has them."""
    if slots is None:
        slots = [("in", pos, vid) for pos, vid in node_operands(node) if pos not in shut] + \
            [("out", k, vid) for k, vid in enumerate(node.outs)]
    key = None
    if memo is not None:
        codes = prop.codes
        key = (id(strats), id(allowed), directions, shut, quiet,
               tuple(map(codes.get, map(_VID, slots))))
        decision = memo.get(key)
    if key is None or decision is None:
        decision = _decide(graph, node, strats, allowed, prop, directions, axis_sizes, quiet,
                           slots)
        if key is not None:
            memo[key] = decision
    if not decision:
        return []
    origin = origin_of(node, prop.specs, prop.origins)
    fixed = []
    for n, new in decision:
        vid, old = slots[n][2], prop.specs.get(slots[n][2])
        if splits_of(old or Spec.replicated(len(new.dims))) < splits_of(new):
            prop.fix(vid, new, prop.origins.get(vid, origin))
            fixed.append(vid)
    return fixed


def _decide(graph: Graph, node: Node, strats, allowed, prop: Propagation, directions,
            axis_sizes, quiet, slots) -> tuple:
    """:func:`_complete_visit`'s decision: (slot index, spec) of each value it grows."""
    sides = {"out" if forward else "in" for forward in directions}
    targets = [(n, t) for n, t in enumerate(slots) if t[0] in sides and t[2] not in prop.closed]
    if not targets or not allowed:
        return ()
    elementwise = op_info(node).elementwise
    constraints = sorted(
        (-math.prod(graph.values[vid].shape),
         -math.prod(axis_sizes[a] for a in axes) if elementwise else 0, n, d, i, side, pos, axis)
        for n, (side, pos, vid) in enumerate(slots)
        if vid in prop.specs and not (side == "in" and pos in quiet)
        for d, axes in enumerate(prop.specs[vid].dims) for i, axis in enumerate(axes))
    if not constraints:
        return ()
    fits = allowed
    for _, _, _, d, _, side, pos, axis in constraints:
        kept = [i for i in fits if axis in spec_of(strats[i], side, pos).dims[d]]
        fits = kept or fits
    target_slots = [t for _, t in targets]
    best = min(fits, key=lambda i: (_new_splits(strats[i], target_slots), strats[i].cost_s, i))
    decision = []
    for n, (side, pos, vid) in targets:
        new, old = spec_of(strats[best], side, pos), prop.specs.get(vid)
        if splits_of(old or Spec.replicated(len(new.dims))) < splits_of(new):
            decision.append((n, new))
    return tuple(decision)


def select(graph: Graph, strats, mesh: MeshContext, prop: Propagation, ties=()) -> list[int]:
    """Complete mode: every node's strategy. Free values are replicated; a node keeps its values
    when a strategy can, else takes what XLA's partitioner would (:func:`_in_result_spec`,
    :func:`_keeping_larger`), the cheapest of those counting the resharding of its operands
    into it and of its results into their fixed specs."""
    tied = {out_node: in_node for out_node, in_node in ties}
    choice: list[int] = [0] * len(graph.nodes)
    values = graph.values
    actual: list[Spec | None] = [None] * len(values)  # per value: its producer's result spec
    # Per value, the spec its consumers read: a propagated spec holds where a node produces
    # the value another way (XLA reshards the value into it there); else what its producer
    # makes (replicated until then).
    current: list[Spec | None] = [None] * len(values)
    for vid, fact in prop.specs.items():
        current[vid] = (fact.to_spec(values[vid].rank, mesh.axis_names)
                        if isinstance(fact, Splits) else fact)
    replicated = Spec.replicated

    # Decisions by everything they read, shared by the copies of a layer (which share their
    # strategy list, see passes.strategies).
    memo: dict = {}
    for node in graph.nodes:
        node_strats = strats[node.id]
        tie_want = actual[graph.nodes[tied[node.id]].outs[0]] if node.id in tied else None
        ins = tuple(current[v] or replicated(values[v].rank) for v in node.ins if v is not None)
        outs = tuple(current[v] or replicated(values[v].rank) for v in node.outs)
        key = (id(node_strats), tie_want, ins, outs, node.trip_count, node.in_trips)
        best = memo.get(key)
        if best is None:
            want_in = [(pos, vid, sp) for (pos, vid), sp in
                       zip(((p, v) for p, v in enumerate(node.ins) if v is not None), ins)]
            best = memo[key] = _select_one(graph, node, strats, mesh, tie_want, want_in,
                                           list(enumerate(outs)))
        choice[node.id] = best
        for vid, spec in zip(node.outs, node_strats[best].out_specs):
            actual[vid] = spec
            if current[vid] is None:
                current[vid] = spec
    return choice


def _select_one(graph: Graph, node: Node, strats, mesh: MeshContext, tie_want, want_in,
                want_out) -> int:
    """:func:`select`'s strategy for one node, given the spec its tied input has (or None) and
    the specs its operands and results are wanted in."""
    options = list(range(len(strats[node.id])))
    if tie_want is not None:
        options = [i for i in options if strats[node.id][i].in_specs[0] == tie_want] or options
    exact = [i for i in options
             if all(strats[node.id][i].in_specs[p] == sp for p, _, sp in want_in)
             and all(strats[node.id][i].out_specs[k] == sp for k, sp in want_out)]
    if exact:
        return min(exact, key=lambda i: (strats[node.id][i].cost_s, i))
    if not op_info(node).gather_scatter:
        options = _in_result_spec(strats[node.id], options, want_out,
                                  partial_sums=not op_info(node).contraction)
    options = _keeping_larger(graph, node, strats[node.id], options, want_in, want_out)
    return min(options, key=lambda i: (_moved_cost_s(node, strats[node.id][i], want_in,
                                                     want_out, graph, mesh), i))


def _in_result_spec(strats: list[Strategy], options: list[int], want_out,
                    partial_sums: bool) -> list[int]:
    """XLA's partitioner computes an op in its result's sharding and reshards the operands that
    do not fit it (an elementwise op's other operand; an FSDP weight gathered at a dot; tokens
    moved to the expert that holds them). At a contraction it does so rather than leave partial
    sums to reduce (``partial_sums=False``). The options producing the result specs, when
    there are any. Gathers and scatters are the exception: their partitioner keeps the
    operand's sharding (:func:`_keeping_larger`)."""
    fits = [i for i in options if (partial_sums or not strats[i].collectives)
            and all(strats[i].out_specs[k] == spec for k, spec in want_out)]
    return fits or options


def _keeping_larger(graph: Graph, node: Node, strats: list[Strategy], options: list[int],
                    want_in, want_out) -> list[int]:
    """Where a node cannot keep all its values as they are, XLA's partitioner keeps the larger
    ones and reshards the smaller: it masks a gather from a vocab-sharded table and gathers
    the indices; it scatters updates into a vocab-sharded gradient, gathering them. The options
    keeping each value's spec, largest value first, while some option still does."""
    slots = [(math.prod(graph.values[vid].shape), "in", pos, spec) for pos, vid, spec in want_in]
    slots += [(math.prod(graph.values[node.outs[k]].shape), "out", k, spec)
              for k, spec in want_out]
    for _, side, pos, spec in sorted(slots, key=lambda t: (-t[0], t[1], t[2])):
        options = [i for i in options if spec_of(strats[i], side, pos) == spec] or options
    return options


def _moved_cost_s(node: Node, s: Strategy, want_in, want_out, graph: Graph,
                  mesh: MeshContext) -> float:
    cost = s.cost_s
    for pos, vid, spec in want_in:
        cost += mesh.reshard_time_s(spec, s.in_specs[pos], graph.values[vid]) * node.edge_trip(pos)
    for k, spec in want_out:
        cost += mesh.reshard_time_s(s.out_specs[k], spec, graph.values[node.outs[k]])
    return cost
