"""Pass 3, propagate: GSPMD-style propagation of fixed shardings through the rule registry.

A value is *fixed* when an annotation names its sharding: an ``in_shardings`` /
``out_shardings`` hint, a ``with_sharding_constraint`` in the program, or flax partitioning
metadata (all made node pins by ``passes.annotate``). Propagation walks the graph forward (a
node's free results from its fixed operands) and backward (a node's free operands from its
fixed results), sweep after sweep until nothing changes, as XLA's sharding propagation does. It
asks each node's own strategy list, the one the ILP chooses from (``passes.strategies`` over the
rule registry), so there is one set of rules: a strategy is *compatible* with a node's fixed
values when it keeps every one of them as it is, with no resharding. State outputs tied to the
input they replace carry its sharding both ways.

Two modes:

* ``complete`` (``search=False``, plain GSPMD): it predicts what XLA's own propagation (Shardy,
  in jax 0.10) makes of the annotations, so that a hand-written ``jax.jit`` program is
  predicted as it compiles. It runs in rounds of widening reach (:class:`Level`, Shardy's
  op-priority schedule): elementwise and layout ops first, then every op along the dims it
  maps from operands to results, then contracting and reduced dims, broadcasts forward last.
  Each round visits the nodes in the order XLA lists them, a sharding that changes sending
  its neighbours to the front (:func:`_complete_sweeps`). A visit gives a node's free values
  the splits its fixed neighbours imply; where those conflict, the larger tensor's splits win
  (:func:`_complete_visit`). A propagated spec may grow by splits in a later visit, never lose
  one. Propagation moves shardings, it never invents one, and values still free at the end
  are replicated, as GSPMD defaults. Each node then takes the strategy that keeps its values,
  or, where they conflict, the one XLA's partitioner would take: computed in its result's
  sharding (:func:`_in_result_spec`; a gather or scatter keeps its larger operand instead,
  :func:`_keeping_larger`), the rest resharded the cheapest way. That is the whole plan: no
  ILP.
* ``forced`` (``search=True``): only what every compatible strategy of a neighbour agrees on
  is fixed, only as *splits* (mesh axis a splits dim d), and only along one tensor (through
  elementwise ops, converts, layout changes, constraints and region boundaries, from a
  full-size value): an elementwise chain after a batch hinted over ``data`` gets "``data``
  splits dim 0", while the other axes stay free, as GSPMD refines a partially replicated
  sharding rather than keeping it replicated. Each value so fixed is
  pinned for the ILP by cutting its producer's strategies to those that keep the splits (the
  cut ``build_strategies`` applies to a hint); the ILP decides the rest.

Priority: a user annotation is fixed before propagation starts and a propagated sharding never
replaces a fixed one, so the user wins. Where two annotations meet at a node that no strategy
can serve as both want, the value is resharded there (as XLA would, in complete mode; the
ILP's choice otherwise) and a :class:`~autopar.errors.ShardingConflictWarning` names both.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
import operator
import warnings
from dataclasses import dataclass, field

from autopar.errors import ShardingConflictWarning
from autopar.passes.estimate import estimate, plan_collectives, plan_peak_memory_bytes
from autopar.passes.ir import Graph, Node, NodeKind
from autopar.passes.rules.dot import CONTRACTIONS
from autopar.passes.rules.elementwise import UNARY_AND_NARY
from autopar.passes.rules.gather import GATHER_SCATTER
from autopar.cost_model.spec import Spec
from autopar.passes.strategies import MeshContext, Strategy
from autopar.passes.trace import CONSTRAINT_PRIMS, constraint_label


@dataclass(frozen=True)
class Origin:
    """Where a fixed sharding comes from: the annotation's label, and whether the value carries
    the annotation itself (``user``) or got it by propagation."""
    label: str
    user: bool


@dataclass(frozen=True)
class Splits:
    """A partial sharding (forced mode): these (mesh axis, dim) splits hold; other axes free."""
    pairs: frozenset

    def admits(self, spec: Spec) -> bool:
        return all(axis in spec.dims[d] for axis, d in self.pairs)

    def to_spec(self, rank: int, axis_order: tuple[str, ...]) -> Spec:
        return Spec(tuple(tuple(a for a in axis_order if (a, d) in self.pairs)
                          for d in range(rank)))

    def __str__(self) -> str:
        return ",".join(f"{a}->dim{d}" for a, d in sorted(self.pairs))


def _admits(fact, spec: Spec) -> bool:
    return fact.admits(spec) if isinstance(fact, Splits) else fact == spec


@functools.lru_cache(maxsize=65536)
def _splits_of(spec: Spec) -> frozenset:
    return frozenset((a, d) for d, axes in enumerate(spec.dims) for a in axes)


@dataclass
class Propagation:
    """Fixed value specs (a Spec, or Splits in forced mode) after propagation, with their
    origins; in complete mode also the strategy index of every node (the plan)."""
    specs: dict[int, Spec | Splits] = field(default_factory=dict)
    origins: dict[int, Origin] = field(default_factory=dict)
    choice: list[int] | None = None
    conflicts: list[str] = field(default_factory=list)
    sweeps: int = 0
    stamp: int = 0                                          # fixes made so far
    fixed_at: dict[int, int] = field(default_factory=dict)  # value -> stamp of its last fix
    compatible_cache: dict = field(default_factory=dict, repr=False)  # see compatible()
    # Complete mode: values whose spec is given (annotations, seeds), never changed by
    # propagation; a propagated spec may still grow by splits.
    closed: set[int] = field(default_factory=set)
    # value -> a small int naming its fixed spec and whether it is closed (2 * the spec's
    # number among those fixed + closed): what a memo key reads of a value, hashed at C speed.
    codes: dict[int, int] = field(default_factory=dict, repr=False)
    _numbers: dict = field(default_factory=dict, repr=False)  # spec -> its number

    def exact(self, vid: int) -> bool:
        return isinstance(self.specs.get(vid), Spec)

    def fix(self, vid: int, spec: Spec | Splits, origin: Origin) -> None:
        self.specs[vid] = spec
        self.origins[vid] = origin
        self.stamp += 1
        self.fixed_at[vid] = self.stamp
        self.codes[vid] = 2 * self._numbers.setdefault(spec, len(self._numbers))

    def close(self) -> None:
        """Make the values fixed so far given ones (:attr:`closed`)."""
        self.closed = set(self.specs)
        for vid in self.closed:
            self.codes[vid] |= 1


def seed(graph: Graph, labels: dict[int, str], extra: dict[int, Spec] | None = None
         ) -> Propagation:
    """The values user annotations fix: pinned inputs and sharding constraints fix their result,
    a pinned output fixes the value it returns (when nothing else already fixed it).
    ``extra``: input node id -> a spec to start from that is not the user's (a candidate
    plan's seed, see :func:`best_of`); a user annotation of the same input wins."""
    prop = Propagation()
    for node_id, spec in (extra or {}).items():
        if graph.nodes[node_id].pinned is None:
            prop.fix(graph.nodes[node_id].outs[0], spec, Origin("a candidate's seed", False))
    for node in graph.nodes:
        if node.pinned is None or node.kind is NodeKind.OUTPUT:
            continue
        for vid, spec in zip(node.outs, node.pinned):
            prop.fix(vid, spec, Origin(labels.get(node.id, _describe(node)), True))
    for n in graph.output_nodes:
        node = graph.nodes[n]
        if node.pinned is not None and node.ins[0] not in prop.specs:
            prop.fix(node.ins[0], node.pinned[0], Origin(labels.get(n, _describe(node)), True))
    prop.close()
    return prop


def _describe(node: Node) -> str:
    if node.prim in CONSTRAINT_PRIMS:
        return constraint_label(node)
    return f"`{node.prim}` at {node.where or 'the program boundary'}"


def _operands(node: Node):
    return [(pos, vid) for pos, vid in enumerate(node.ins) if vid is not None]


def compatible(node: Node, strats: list[Strategy], specs: dict, cache: dict | None = None
               ) -> list[int]:
    """Indices of the strategies that keep every fixed operand and result of ``node``.
    ``cache``: answers by (strategy list, fixed values), shared by the copies of a layer
    (identical nodes share one strategy list)."""
    fixed_in = tuple((pos, specs[vid]) for pos, vid in _operands(node) if vid in specs)
    fixed_out = tuple((k, specs[vid]) for k, vid in enumerate(node.outs) if vid in specs)
    key = (id(strats), fixed_in, fixed_out)
    if cache is not None and key in cache:
        return cache[key][1]
    fits = [i for i, s in enumerate(strats)
            if all(_admits(f, s.in_specs[p]) for p, f in fixed_in)
            and all(_admits(f, s.out_specs[k]) for k, f in fixed_out)]
    if cache is not None:
        cache[key] = (strats, fits)  # holding the list keeps its id from being reused
    return fits


def _targets(node: Node, prop: Propagation, forward: bool) -> list[tuple[str, int, int]]:
    """The values a visit may fix (free, or partially fixed in forced mode): ("out", k, vid)
    forward, ("in", pos, vid) backward."""
    if forward:
        return [("out", k, vid) for k, vid in enumerate(node.outs) if not prop.exact(vid)]
    return [("in", pos, vid) for pos, vid in _operands(node) if not prop.exact(vid)]


def _spec_of(s: Strategy, side: str, pos: int) -> Spec:
    return s.out_specs[pos] if side == "out" else s.in_specs[pos]


def _new_splits(s: Strategy, targets) -> int:
    return sum(len(_spec_of(s, side, pos).axes) for side, pos, _ in targets)


def _origin_of(node: Node, specs, origins) -> Origin:
    """The origin a value fixed at ``node`` inherits: the first fixed neighbour's annotation."""
    for vid in itertools.chain(node.ins, node.outs):  # operands first, as _operands
        if vid is not None and vid in specs:
            return _propagated(origins[vid].label)
    raise AssertionError("a node is visited only with a fixed neighbour")


@functools.lru_cache(maxsize=1024)
def _propagated(label: str) -> Origin:
    """The origin of a sharding propagated from annotation ``label`` (one object per label:
    a deep model fixes hundreds of thousands of values from a handful of annotations)."""
    return Origin(label, False)


def visit(node: Node, strats: list[Strategy], prop: Propagation, forward: bool,
          sources: frozenset | None = None) -> bool:
    """Forced mode: fix the splits every strategy compatible with ``node``'s fixed values
    agrees on; True when something was fixed. ``sources``: the values whose fixed shardings
    may propagate (None: all)."""
    targets = _targets(node, prop, forward)
    if not targets:
        return False
    neighbours = [v for _, v in _operands(node)] + list(node.outs)
    known = {v: prop.specs[v] for v in neighbours
             if v in prop.specs and (sources is None or v in sources)}
    if not known:
        return False
    fits = compatible(node, strats, known, prop.compatible_cache)
    if not fits:
        return False  # a conflict: resolved when the node picks its strategy
    origin = _origin_of(node, prop.specs, prop.origins)
    changed = False
    for side, pos, vid in targets:
        common = frozenset.intersection(*[_splits_of(_spec_of(strats[i], side, pos))
                                          for i in fits])
        old = prop.specs.get(vid)
        if common and (old is None or common != old.pairs):
            prop.fix(vid, Splits(common | (old.pairs if old else frozenset())),
                     prop.origins.get(vid, origin))
            changed = True
    return changed


def _tie(prop: Propagation, graph: Graph, ties) -> bool:
    """A state output and the input it replaces share one sharding, whichever is fixed first."""
    changed = False
    for out_node, in_node in ties:
        a, b = graph.nodes[in_node].outs[0], graph.nodes[out_node].ins[0]
        for src, dst in ((a, b), (b, a)):
            if prop.exact(src) and not prop.exact(dst):
                prop.fix(dst, prop.specs[src], _propagated(prop.origins[src].label))
                changed = True
    return changed


def run_sweeps(graph: Graph, strats, prop: Propagation, complete: bool, ties=(),
               axis_sizes: dict | None = None) -> None:
    """Propagate to a fixed point. Complete mode: whole specs, level by level (:class:`Level`,
    :func:`_complete_sweeps`). Forced mode: the splits every compatible strategy agrees on,
    spread only along one tensor (see :func:`_one_tensor`), in forward and backward sweeps."""
    if complete:
        _complete_sweeps(graph, strats, prop, ties, axis_sizes or {})
    else:
        _sweeps(graph, strats, prop)


def _one_tensor(graph: Graph, node: Node) -> frozenset | None:
    """Forced mode's reach: a same-tensor node (:data:`_SAME_TENSOR`) passes on the splits of
    its full-size values only. Elsewhere, or from a smaller operand (a broadcast bias or norm
    scale), keeping a sharding is not forced: an FSDP-sharded weight does not make the
    activations it meets split their features, the ILP weighs gathering it instead."""
    if node.kind not in _SAME_TENSOR_KINDS and node.prim not in _SAME_TENSOR:
        return frozenset()
    vids = [v for _, v in _operands(node)] + list(node.outs)
    largest = max(graph.values[v].nbytes // graph.values[v].itemsize for v in vids)
    return frozenset(v for v in vids
                     if graph.values[v].nbytes // graph.values[v].itemsize == largest)


def _sweeps(graph: Graph, strats, prop: Propagation, max_sweeps: int = 50) -> None:
    """Forced mode: forward and backward sweeps to a fixed point. A visit reads only the node's
    neighbours' fixed specs, so a node none of whose neighbours was fixed since its last visit
    in that direction is skipped: it would fix nothing new (this keeps deep models fast)."""
    nodes = graph.nodes
    reach = [_one_tensor(graph, node) for node in nodes]
    neighbours = [[v for _, v in _operands(node)] + list(node.outs) for node in nodes]
    last = {True: [-1] * len(nodes), False: [-1] * len(nodes)}  # direction -> stamp at visit

    def sweep(order, forward: bool) -> bool:
        changed = False
        for node in order:
            newest = max((prop.fixed_at.get(v, 0) for v in neighbours[node.id]), default=0)
            if newest <= last[forward][node.id]:
                continue
            last[forward][node.id] = prop.stamp
            changed |= visit(node, strats[node.id], prop, forward, reach[node.id])
        return changed

    for _ in range(max_sweeps):
        prop.sweeps += 1
        changed = sweep(nodes, True)
        changed |= sweep(reversed(nodes), False)
        if not changed:
            return


# Ops whose operands and results are one tensor in the same layout (elementwise, converts,
# layout changes, constraints, region boundaries). Two annotations that meet there with no
# common strategy want the same tensor sharded two ways: a conflict. Elsewhere (a contraction
# of an FSDP-sharded weight with a data-parallel batch, say) a resharding is ordinary work.
_SAME_TENSOR = frozenset(UNARY_AND_NARY) | {"reshape", "transpose", "squeeze", "expand_dims",
                                            "broadcast_in_dim", "copy"}
_SAME_TENSOR_KINDS = (NodeKind.OUTPUT, NodeKind.CARRY, NodeKind.MERGE, NodeKind.SCAN_IN,
                      NodeKind.SCAN_OUT)


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


_FORWARD_ONLY_OPS = frozenset({"dynamic_slice", "dynamic_update_slice"})


def _is_broadcast(node: Node) -> bool:
    """A broadcast_in_dim that adds elements (XLA makes one adding only size-1 dims a reshape)."""
    return (node.prim == "broadcast_in_dim"
            and math.prod(node.in_avals[0][0]) != math.prod(node.params["shape"]))


def _broadcast_operands(graph: Graph, node: Node) -> frozenset[int]:
    """Operand positions of an elementwise op that broadcast size-1 dims (``x + b[None]``): XLA
    lowers each through a broadcast op, and propagation crosses it as it crosses broadcasts."""
    if node.prim not in UNARY_AND_NARY:
        return frozenset()
    out = graph.values[node.outs[0]].shape
    return frozenset(pos for pos, vid in _operands(node)
                     if graph.values[vid].rank > 0 and graph.values[vid].shape != out)


def _directions(node: Node, level: Level, multi_use: set[int]) -> tuple[bool, ...]:
    """The directions (True: forward) ``node`` propagates in at ``level``."""
    if node.kind in _SAME_TENSOR_KINDS or (node.prim in _SAME_TENSOR and not _is_broadcast(node)):
        if level is Level.SAME_TENSOR_SINGLE_USE and any(v in multi_use for _, v in
                                                         _operands(node)):
            return ()  # each use might want another sharding: settled later
        return (True, False)
    if node.prim in _FORWARD_ONLY_OPS and level < Level.PASS_THROUGH:
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
            operands = [_operands(node) for node in graph.nodes]
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


def _complete_sweeps(graph: Graph, strats, prop: Propagation, ties, axis_sizes: dict) -> None:
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
    by_list: dict = {}  # one allowed list per strategy list and reach, so the memo can key on it
    allowed_of: dict[bool, list] = {}  # reach -> the allowed list of every node
    for level in Level:
        wide = level >= Level.ANY_BUT_BROADCAST_FORWARD
        if wide not in allowed_of:
            allowed_of[wide] = []
            for node_strats in strats:
                key = (id(node_strats), wide)
                if key not in by_list:
                    by_list[key] = _allowed(node_strats, level)
                    narrow = by_list.get((id(node_strats), False))
                    if wide and narrow == by_list[key]:
                        by_list[key] = narrow  # the same list: no reason to visit it again
                allowed_of[wide].append(by_list[key])
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
        slots = [("in", pos, vid) for pos, vid in _operands(node) if pos not in shut] + \
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
    origin = _origin_of(node, prop.specs, prop.origins)
    fixed = []
    for n, new in decision:
        vid, old = slots[n][2], prop.specs.get(slots[n][2])
        if _splits_of(old or Spec.replicated(len(new.dims))) < _splits_of(new):
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
    elementwise = node.prim in UNARY_AND_NARY
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
        kept = [i for i in fits if axis in _spec_of(strats[i], side, pos).dims[d]]
        fits = kept or fits
    target_slots = [t for _, t in targets]
    best = min(fits, key=lambda i: (_new_splits(strats[i], target_slots), strats[i].cost_s, i))
    decision = []
    for n, (side, pos, vid) in targets:
        new, old = _spec_of(strats[best], side, pos), prop.specs.get(vid)
        if _splits_of(old or Spec.replicated(len(new.dims))) < _splits_of(new):
            decision.append((n, new))
    return tuple(decision)


def find_conflicts(graph: Graph, strats, prop: Propagation, labels: dict[int, str]
                   ) -> list[str]:
    """Same-tensor nodes where a user annotation and another annotation (or a sharding
    propagated from one) admit no common strategy; one warning per pair of annotations. Two
    propagated shardings meeting is ordinary resharding, left to the plan without a word."""
    seen, messages = set(), []
    for node in graph.nodes:
        if node.kind not in _SAME_TENSOR_KINDS and node.prim not in _SAME_TENSOR:
            continue
        wants = {}  # label -> (user, spec) of the fixed values at this node
        for vid in [v for _, v in _operands(node)] + list(node.outs):
            if vid in prop.specs:
                origin = prop.origins[vid]
                wants.setdefault(origin.label, (origin.user, prop.specs[vid]))
        if node.kind is NodeKind.OUTPUT and node.pinned is not None and node.id in labels:
            wants.setdefault(labels[node.id], (True, node.pinned[0]))
        users = [lab for lab, (user, _) in wants.items() if user]
        if len(wants) < 2 or not users or compatible(node, strats[node.id], prop.specs):
            continue
        pair = [users[0], next(lab for lab in wants if lab != users[0])]
        if tuple(sorted(pair)) in seen:
            continue
        seen.add(tuple(sorted(pair)))
        said = "; ".join(f"{lab} wants {wants[lab][1]}{'' if wants[lab][0] else ' (propagated)'}"
                         for lab in pair)
        messages.append(
            f"autopar: sharding annotations conflict at `{node.prim}` "
            f"({node.where or 'the program boundary'}): {said}. A user annotation wins over a "
            "propagated one; the value is resharded where they meet. Make the two annotations "
            "agree to avoid the resharding.")
    return messages


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
    if node.prim not in GATHER_SCATTER:
        options = _in_result_spec(strats[node.id], options, want_out,
                                  partial_sums=node.prim not in CONTRACTIONS)
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
        options = [i for i in options if _spec_of(strats[i], side, pos) == spec] or options
    return options


def _moved_cost_s(node: Node, s: Strategy, want_in, want_out, graph: Graph,
                  mesh: MeshContext) -> float:
    cost = s.cost_s
    for pos, vid, spec in want_in:
        cost += mesh.reshard_time_s(spec, s.in_specs[pos], graph.values[vid]) * node.edge_trip(pos)
    for k, spec in want_out:
        cost += mesh.reshard_time_s(s.out_specs[k], spec, graph.values[node.outs[k]])
    return cost


def pin_forced(graph: Graph, strats, prop: Propagation) -> int:
    """Forced mode: cut each producer of a propagated value to the strategies that keep its
    splits, as ``build_strategies`` cuts a hinted node (a partial fix has no full spec to put in
    ``node.pinned``). Returns the number of nodes cut."""
    cut = 0
    for node in graph.nodes:
        fixed = [(k, prop.specs[v]) for k, v in enumerate(node.outs)
                 if v in prop.specs and not prop.origins[v].user]
        if not fixed or node.pinned is not None:
            continue
        kept = [s for s in strats[node.id] if all(_admits(f, s.out_specs[k]) for k, f in fixed)]
        if not kept or len(kept) == len(strats[node.id]):
            continue  # fixed backward by a consumer this producer cannot serve: left to the ILP
        strats[node.id] = kept
        cut += 1
    return cut


def propagate(graph: Graph, strats: list[list[Strategy]], mesh: MeshContext,
              labels: dict[int, str], ties=(), *, complete: bool, warn: bool = True,
              extra: dict[int, Spec] | None = None) -> Propagation:
    """Run the pass. ``labels``: node id -> the annotation that pinned it (for messages);
    ``ties``: (output node, input node) pairs sharing a sharding; ``extra``: see :func:`seed`.
    In forced mode ``strats`` is cut in place; in complete mode the result holds every node's
    strategy. ``warn``: warn of the conflicts found (``Propagation.conflicts``); without it
    they are not looked for (a candidate plan's propagation)."""
    prop = seed(graph, labels, extra)
    if not complete and not prop.specs:
        return prop  # forced mode moves fixed shardings only: with none, nothing moves
    run_sweeps(graph, strats, prop, complete, ties, mesh.axis_sizes)
    if warn:
        prop.conflicts = find_conflicts(graph, strats, prop, labels)
    for message in prop.conflicts:
        warnings.warn(message, ShardingConflictWarning, stacklevel=3)
    if complete:
        prop.choice = select(graph, strats, mesh, prop, ties)
    else:
        pin_forced(graph, strats, prop)
    return prop


def propagated_plans(graph: Graph, strats, mesh: MeshContext, labels: dict[int, str], ties=(),
                     seeds: dict[str, dict[int, Spec]] | None = None,
                     annotations_alone: bool = True) -> dict[str, list[int]]:
    """Candidate plans beside the ILP's: the complete propagation of the annotations (when
    there are any, and ``annotations_alone``), and with each of ``seeds`` (name -> input node
    id -> spec: a hand-written baseline's input shardings, say) added under them. The ILP's
    clustering, its per-edge pricing and its time limit can miss a plan that propagation from
    a good start finds; the ILP starts from the best of these (``passes.solve``'s warm start)
    and :func:`best_of` compares them with its plan. (:func:`candidate_starts` and
    :func:`propagate_from` are its two halves, for callers that spread the work.)"""
    return propagate_from(graph, strats, mesh, labels, ties,
                          candidate_starts(labels, seeds, annotations_alone))


def candidate_starts(labels: dict[int, str], seeds: dict[str, dict[int, Spec]] | None = None,
                     annotations_alone: bool = True) -> list[tuple[str, dict | None]]:
    """:func:`propagated_plans`'s plans to make: (name, ``extra`` for :func:`seed`) each."""
    return ([("propagated", None)] if labels and annotations_alone else []) + [
        (f"propagated ({name})", extra) for name, extra in (seeds or {}).items()]


def propagate_from(graph: Graph, strats, mesh: MeshContext, labels: dict[int, str], ties,
                   starts: list[tuple[str, dict | None]]) -> dict[str, list[int]]:
    """Name -> the complete propagation's plan, for each of ``starts``
    (:func:`candidate_starts`)."""
    return {name: propagate(graph, strats, mesh, labels, ties, complete=True, warn=False,
                            extra=extra).choice
            for name, extra in starts}


def step_times(graph: Graph, strats, mesh: MeshContext,
               plans: dict[str, list[int]]) -> dict[str, float]:
    """Each plan's predicted step time in seconds (the estimate, without memory)."""
    return {name: estimate(graph, strats, choice, mesh,
                           plan_collectives(graph, strats, choice, mesh), memory=False)
            .step_time_s for name, choice in plans.items()}


def best_of(solution, graph: Graph, strats, mesh: MeshContext, candidates: dict[str, list[int]],
            memory_budget_bytes: float | None = None, known_s: dict[str, float] | None = None):
    """The plan predicted fastest among the ILP's ``solution`` and ``candidates`` (name ->
    plan, :func:`propagated_plans`), by the estimate (``cost_model.estimate``); a plan that
    fits ``memory_budget_bytes`` first. So with annotations, search never does worse than
    ``search=False``, and never worse than the seeds' plans. Returns (solution, predicted step
    time per plan name, predicted peak bytes per plan name); the ILP's plan is named by its
    status. Peaks are predicted fastest plan first, up to the first that fits (the slower ones
    cannot win), so the fastest plan's is always there. When none fits, every peak is
    predicted, and a candidate's below the solve's least peak found becomes it. ``known_s``:
    step times of candidates already predicted (:func:`step_times`)."""
    plans = {solution.status: solution.choice, **candidates}
    known_s = {name: t for name, t in (known_s or {}).items() if name in candidates}
    times = step_times(graph, strats, mesh,
                       {name: choice for name, choice in plans.items() if name not in known_s})
    times = {name: times[name] if name in times else known_s[name] for name in plans}
    peaks: dict[str, int] = {}
    best = None
    for name in sorted(plans, key=times.get):  # stable: the ILP's plan first among equals
        peaks[name] = plan_peak_memory_bytes(graph, strats, plans[name], mesh.axis_sizes,
                                             mesh.results_held)
        fits = (solution.fits_budget if name == solution.status else
                memory_budget_bytes is None or peaks[name] <= memory_budget_bytes)
        if best is None or fits:
            best = solution if name == solution.status else dataclasses.replace(
                solution, choice=plans[name], status=name, fits_budget=fits)
        if fits:
            break
    if not best.fits_budget and best.least_peak_choice is not None:
        # Nothing fits: the smallest peak found (the error reports it) may be a candidate's.
        least = min(peaks, key=peaks.get)
        if peaks[least] < best.least_peak_bytes:
            best = dataclasses.replace(best, least_peak_bytes=peaks[least],
                                       least_peak_choice=plans[least])
    return best, times, peaks
