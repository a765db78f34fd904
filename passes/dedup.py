"""Layer deduplication: structurally identical nodes share one ILP decision.

An unrolled Python loop of flax modules puts N copies of a block in the graph: the forward
ops, their backward ops and the optimizer updates of each copy's parameters. Solving each copy
separately makes the ILP grow with depth, and lets copies of one layer drift to different
shardings for no reason. Here each node gets a *structural color*:

* color 0 is the node's local signature (:func:`node_key`: kind, primitive, parameters, operand
  and result shapes and dtypes, trip counts, pins);
* each refinement round (Weisfeiler-Lehman) recolors a node by its color, the colors of the
  producers of its operands and the multiset of colors of the consumers of its results.

After ``rounds`` rounds, two nodes share a color when their neighbourhoods of that radius are
identical: the same op at the same place in two copies of a layer. The radius stays well
below the length of a layer, so copies match each other, while the ends of the first and last
copy (which see the embedding or the head) get colors of their own.

:func:`tie_groups` then merges ILP groups (``passes.cluster``) whose members have the same
colors and index maps into one decision: the representative is solved once and every copy
takes its choice. Boundary values between layers become edges between the same two groups,
which :mod:`passes.ilp` adds once, weighted by their count.

Tying is always sound: tied nodes have identical strategy lists (:func:`node_key` is also the
strategy cache key), so any choice of the group is a valid strategy for every member.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.passes.ir import Graph, Node, NodeKind
from autopar.passes.reductions import is_combined_reduction

#: Refinement rounds; far fewer hops than a transformer layer has ops.
@dataclass
class Groups:
    """Which nodes share a decision: node -> (group, index map from group to node strategies)."""
    group_of: list[int]
    index_map: list[np.ndarray]
    members: dict[int, list[int]]
    sizes: dict[int, int]
    # Structural color per node (passes.dedup): nodes of one color in one group cost the same
    # and their edges are priced once, weighted by how many there are.
    color: list[int] | None = None



ROUNDS = 3


def _freeze(value):
    """A hashable stand-in for a primitive parameter, equal for equal parameters (a hashable
    tuple is its own)."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.shape, str(value.dtype), value.tobytes())
    try:
        hash(value)
    except TypeError:
        if isinstance(value, tuple):
            return tuple(_freeze(v) for v in value)
        return ("repr", type(value).__name__, repr(value))
    return value


def node_key(graph: Graph, node: Node, combined: bool) -> tuple:
    """Everything :func:`passes.strategies.node_strategies` reads from a node: two nodes with
    equal keys get equal strategy lists. ``combined``: see ``is_combined_reduction``."""
    # dtypes as they are: equal dtypes are equal and hash alike, and str() of a numpy dtype
    # costs more than the rest of the key (226,000 of them at 96 layers).
    outs = tuple((graph.values[v].shape, graph.values[v].dtype) for v in node.outs)
    return (node.kind, node.prim, _freeze(node.params),
            tuple((shape, dtype) for shape, dtype in node.in_avals),
            tuple(v is None for v in node.ins), outs, combined)


def input_shapes(graph: Graph) -> frozenset:
    """The shapes of the arguments of rank >= 1 (``passes.cluster``), and of one iteration's
    slice of a scanned-over argument (a layer's parameter in a scan over layers:
    its gradient is computed, and reduced, one iteration at a time)."""
    shapes = {graph.values[graph.nodes[n].outs[0]].shape for n in graph.input_nodes}
    shapes |= {graph.values[n.outs[0]].shape for n in graph.nodes
               if n.kind is NodeKind.SCAN_IN and graph.values[n.ins[0]].shape in shapes}
    return frozenset(s for s in shapes if s)


def node_keys(graph: Graph) -> list[tuple]:
    """:func:`node_key` of every node."""

    return [node_key(graph, n, is_combined_reduction(n, graph)) for n in graph.nodes]


@dataclass
class Colors:
    """Structural colors of the nodes and how many distinct ones there are."""
    of: list[int]
    count: int


def structural_colors(graph: Graph, keys: list[tuple], rounds: int = ROUNDS) -> Colors:
    """Color refinement from the local keys (see the module docstring)."""
    intern: dict = {}

    def cid(key) -> int:
        return intern.setdefault(key, len(intern))

    color = [cid((k, n.trip_count, n.in_trips, _freeze(n.pinned)))
             for k, n in zip(keys, graph.nodes)]
    producer, uses = graph.producer, graph.consumers()
    # Per node: its operands' (producer, position) and its results' (reader, position).
    ins_of = [tuple(None if v is None else producer[v] for v in node.ins)
              for node in graph.nodes]
    outs_of = [tuple(uses.get(v, ()) for v in node.outs) for node in graph.nodes]
    for _ in range(rounds):
        intern = {}
        new = []
        for c, ins, outs in zip(color, ins_of, outs_of):
            new.append(cid((c, tuple(None if p is None else (color[p[0]], p[1]) for p in ins),
                            tuple(tuple(sorted([(color[w], q) for w, q in readers]))
                                  for readers in outs))))
        color = new
    return Colors(color, len(intern))


def tie_groups(groups, colors: Colors):
    """Merge groups whose members are structurally identical (same colors, same index maps)
    into one decision. Returns a new ``Groups`` carrying the colors."""

    rep_of_sig: dict = {}
    rep_of_group: dict[int, int] = {}
    for g, members in groups.members.items():
        sig = (groups.sizes[g], tuple(sorted(
            (colors.of[m], groups.index_map[m].tobytes()) for m in members)))
        rep_of_group[g] = rep_of_sig.setdefault(sig, g)
    group_of = [rep_of_group[g] for g in groups.group_of]
    members: dict[int, list[int]] = {}
    for n, g in enumerate(group_of):
        members.setdefault(g, []).append(n)
    sizes = {g: groups.sizes[g] for g in members}
    return Groups(group_of, groups.index_map, members, sizes, colors.of)
