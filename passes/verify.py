"""Invariants of the Graph IR (``passes.ir``), checked after every pass in debug mode.

:func:`verify` checks what the passes rely on: values numbered in order, each made by exactly
one node (``Graph.producer`` agreeing); every operand an existing value defined before its
use, but a loop carry's fed-back value (a back-edge); boundary nodes with their arity; shapes
tuples of non-negative ints matching the operands' recorded avals; the input, output, equation
and region indexes naming existing nodes of the right kind. The pipeline runs it after each
pass when ``PlanOptions.verify_ir`` (by default: the environment sets ``AUTOPAR_DEBUG=1``).
"""

from __future__ import annotations

import os

from autopar.errors import InvalidIRError
from autopar.passes.ir import Graph, Node, NodeKind

#: The environment variable that turns IR verification on (``AUTOPAR_DEBUG=1``).
DEBUG_ENV = "AUTOPAR_DEBUG"

#: Operand and result counts of each boundary kind (OP nodes have any).
ARITY = {NodeKind.INPUT: (0, 1), NodeKind.CONST: (0, 1), NodeKind.OUTPUT: (1, 0),
         NodeKind.CARRY: (2, 1), NodeKind.SCAN_IN: (1, 1), NodeKind.SCAN_OUT: (1, 1)}

#: The node kind each ``Graph.region_nodes`` entry lists.
REGION_KINDS = {"carry": NodeKind.CARRY, "scan_in": NodeKind.SCAN_IN,
                "scan_out": NodeKind.SCAN_OUT, "merge": NodeKind.MERGE}

#: At most this many problems are named in the error.
SHOWN = 5


def debug_requested() -> bool:
    """Whether the environment asks for IR verification between passes."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def verify(graph: Graph, after: str) -> None:
    """Raise :class:`autopar.errors.InvalidIRError` naming the pass ``after`` which ``graph``
    breaks an invariant (see the module docstring), with the first problems found."""
    found = problems(graph)
    if found:
        more = f" (and {len(found) - SHOWN} more)" if len(found) > SHOWN else ""
        raise InvalidIRError(f"the graph IR is invalid after the `{after}` pass: "
                             + "; ".join(found[:SHOWN]) + more)


def problems(graph: Graph) -> list[str]:
    """Every broken invariant of ``graph``, described; empty when it is valid."""
    return [*_value_problems(graph), *_producer_problems(graph),
            *(p for node in graph.nodes for p in _node_problems(graph, node)),
            *_index_problems(graph)]


def _value_problems(graph: Graph) -> list[str]:
    found = []
    for i, value in enumerate(graph.values):
        if value.id != i:
            found.append(f"value {i} has id {value.id}")
        shape = value.shape
        if not (isinstance(shape, tuple)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                        for d in shape)):
            found.append(f"value {i} has shape {shape!r}, not a tuple of non-negative ints")
    return found


def _producer_problems(graph: Graph) -> list[str]:
    """Each value made by exactly one node, as ``Graph.producer`` records."""
    made: dict[int, list[tuple[int, int]]] = {}
    for node in graph.nodes:
        for pos, vid in enumerate(node.outs):
            made.setdefault(vid, []).append((node.id, pos))
    found = [f"value {vid} is made by {len(where)} nodes {[n for n, _ in where]}"
             for vid, where in made.items() if len(where) > 1]
    found += [f"node {where[0][0]} makes value {vid}, which does not exist"
              for vid, where in made.items() if not 0 <= vid < len(graph.values)]
    found += [f"value {vid} is made by no node" for vid in range(len(graph.values))
              if vid not in made]
    found += [f"Graph.producer says value {vid} comes from {at}, not {made.get(vid)}"
              for vid, at in graph.producer.items() if [at] != made.get(vid)]
    found += [f"Graph.producer misses value {vid}" for vid in made
              if vid not in graph.producer]
    return found


def _node_problems(graph: Graph, node: Node) -> list[str]:
    """``node``'s own invariants: its id, arity, avals, trip counts and operands."""
    found = []
    name = f"node {node.id} ({node.kind.value} {node.prim})"
    if not (0 <= node.id < len(graph.nodes) and graph.nodes[node.id] is node):
        found.append(f"{name} is not at its id's place in Graph.nodes")
    arity = ARITY.get(node.kind, (None, 1) if node.kind is NodeKind.MERGE else (None, None))
    if arity[0] is not None and len(node.ins) != arity[0]:
        found.append(f"{name} has {len(node.ins)} operands, not {arity[0]}")
    if arity[1] is not None and len(node.outs) != arity[1]:
        found.append(f"{name} has {len(node.outs)} results, not {arity[1]}")
    if node.kind is NodeKind.MERGE and not node.ins:
        found.append(f"{name} merges no branch")
    if len(node.in_avals) != len(node.ins):
        found.append(f"{name} has {len(node.ins)} operands but {len(node.in_avals)} avals")
    if node.in_trips and len(node.in_trips) != len(node.ins):
        found.append(f"{name} has {len(node.ins)} operands but {len(node.in_trips)} trips")
    if not (isinstance(node.trip_count, int) and node.trip_count >= 1):
        found.append(f"{name} runs {node.trip_count!r} times a call")
    for pos, vid in enumerate(node.ins):
        found += _operand_problems(graph, node, pos, vid, name)
    return found


def _operand_problems(graph: Graph, node: Node, pos: int, vid: int | None,
                      name: str) -> list[str]:
    """Operand ``pos`` of ``node``: an existing value (None, a literal, only on OP nodes),
    made by an earlier node (a loop carry's fed-back value, operand 1, by any), of the shape
    its aval records."""
    if vid is None:
        return [] if node.kind is NodeKind.OP else [f"{name} has a literal operand {pos}"]
    if not 0 <= vid < len(graph.values):
        return [f"{name} reads value {vid}, which does not exist"]
    found = []
    maker = graph.producer.get(vid, (None,))[0]
    back_edge = node.kind is NodeKind.CARRY and pos == 1
    if maker is not None and maker >= node.id and not back_edge:
        found.append(f"{name} reads value {vid} before node {maker} makes it")
    if pos < len(node.in_avals) and tuple(node.in_avals[pos][0]) != graph.values[vid].shape:
        found.append(f"{name} operand {pos} has aval shape {tuple(node.in_avals[pos][0])} but "
                     f"value {vid} has shape {graph.values[vid].shape}")
    return found


def _index_problems(graph: Graph) -> list[str]:
    """The graph's indexes: input and output nodes, equation and region nodes, variables."""
    found = []
    for what, ids, kind in (("input_nodes", graph.input_nodes, NodeKind.INPUT),
                            ("output_nodes", graph.output_nodes, NodeKind.OUTPUT)):
        every = [n.id for n in graph.nodes if n.kind is kind]
        if list(ids) != every:
            found.append(f"Graph.{what} {_short(ids)} are not the {kind.value} nodes "
                         f"{_short(every)} in order")
    found += [f"Graph.eqn_nodes names node {n} for equation {path}, not an op node"
              for path, n in graph.eqn_nodes.items() if not _is(graph, n, NodeKind.OP)]
    found += [f"Graph.region_nodes[{path}][{key!r}] names node {n}, not a {key} node"
              for path, by_kind in graph.region_nodes.items()
              for key, ids in by_kind.items() for n in ids
              if not _is(graph, n, REGION_KINDS.get(key))]
    found += [f"Graph.var_values maps {var} to value {vid}, which does not exist"
              for var, vid in graph.var_values.items() if not 0 <= vid < len(graph.values)]
    return found


def _is(graph: Graph, node_id: int, kind: NodeKind | None) -> bool:
    return 0 <= node_id < len(graph.nodes) and graph.nodes[node_id].kind is kind


def _short(ids) -> str:
    ids = list(ids)
    return str(ids) if len(ids) <= 8 else f"{ids[:8]}... ({len(ids)})"
