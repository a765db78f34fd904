"""Pass 4, cluster: merge nodes into groups that share one ILP decision.

* Followers. An elementwise op, a convert or a layout op (reshape, transpose, squeeze: the
  ``follower`` flag of ``passes.rules.op_info``) with a single full-shape operand follows that
  operand's producer: for every strategy of the producer it takes its own cheapest strategy
  given the producer's result spec.
  This is Alpa's "follow and merge"; it cuts the ILP by about the number of such ops, at the
  price of never resharding right before a follower.
* Ties. A state output (a new parameter or optimizer state) that replaces an input keeps the
  input's sharding, so the next step can take it as it is.
"""

from __future__ import annotations

import numpy as np

from autopar.passes.dedup import input_shapes
from autopar.passes.ir import Graph, NodeKind
from autopar.passes.dedup import Groups
from autopar.passes.rules import op_info
from autopar.passes.strategies import MeshContext, Strategy


def _leader_operand(node, graph: Graph, state_shapes: frozenset):
    """The operand a follower follows: its only operand of the result's full shape (others
    being literals, scalars or size-1-broadcast operands such as a bias). An op with two full
    operands (a residual add) stays its own decision, since following either one could force
    a costly reshard of the other; except in state math (the result has an argument's shape:
    an optimizer update, a gradient sum), where every operand is best kept in one sharding,
    and the op follows its first operand. The edges from the others stay priced."""
    out_shape = graph.values[node.outs[0]].shape
    elementwise = op_info(node).elementwise
    full = [(pos, vid) for pos, vid in enumerate(node.ins)
            if vid is not None and graph.values[vid].rank
            and (not elementwise or graph.values[vid].shape == out_shape)]
    if len(full) > 1 and elementwise and out_shape in state_shapes:
        return full[0]
    return full[0] if len(full) == 1 else None


def _pick(follower: list[Strategy], pos: int, spec, value, mesh: MeshContext, by_spec) -> int:
    if spec in by_spec:
        return by_spec[spec]
    costs = [s.cost_s + mesh.reshard_time_s(spec, s.in_specs[pos], value) for s in follower]
    return int(np.argmin(costs))


def _follow(follower: list[Strategy], pos: int, leader: list[Strategy], k: int,
            leader_map: np.ndarray, value, mesh: MeshContext) -> np.ndarray:
    """The follower's strategy for each strategy of its leader's group."""
    by_spec = {}
    for j, s in sorted(enumerate(follower), key=lambda t: (t[1].cost_s, t[0])):
        by_spec.setdefault(s.in_specs[pos], j)
    return np.array([_pick(follower, pos, leader[i].out_specs[k], value, mesh, by_spec)
                     for i in leader_map])


def cluster(graph: Graph, strats: list[list[Strategy]], mesh: MeshContext,
            ties: list[tuple[int, int]] = (), follow: bool = True) -> Groups:
    """ties: (output node, input node) pairs whose shardings must be equal."""
    group_of = list(range(len(graph.nodes)))
    index_map = [np.arange(len(s)) for s in strats]
    picked: dict = {}
    state_shapes = input_shapes(graph)
    for node in graph.nodes:
        if not follow or node.kind is not NodeKind.OP or not op_info(node).follower:
            continue
        if node.pinned is not None or len(node.outs) != 1:
            continue
        lead = _leader_operand(node, graph, state_shapes)
        if lead is None:
            continue
        pos, vid = lead
        u, k = graph.producer[vid]
        # Strategy lists are shared by structurally identical nodes (build_strategies), so
        # the copies of a repeated layer pick once.
        key = (id(strats[node.id]), id(strats[u]), index_map[u].tobytes(), pos, k)
        if key not in picked:
            picked[key] = _follow(strats[node.id], pos, strats[u], k, index_map[u],
                                  graph.values[vid], mesh)
        index_map[node.id] = picked[key]
        group_of[node.id] = group_of[u]
    for out_node, in_node in ties:
        in_specs = [strats[in_node][i].out_specs[0] for i in index_map[in_node]]
        where = {s.in_specs[0]: j for j, s in enumerate(strats[out_node])}
        if all(spec in where for spec in in_specs):
            index_map[out_node] = np.array([where[spec] for spec in in_specs])
            group_of[out_node] = group_of[in_node]
    members: dict[int, list[int]] = {}
    for n, g in enumerate(group_of):
        members.setdefault(g, []).append(n)
    sizes = {g: len(index_map[m[0]]) for g, m in members.items()}
    return Groups(group_of, index_map, members, sizes)
