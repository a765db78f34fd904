"""The Graph IR the planner works on.

A :class:`Graph` is a flat list of :class:`Node` s over numbered :class:`Value` s. It is built
from a jaxpr by ``passes.trace``: nested jaxprs (jit, custom_jvp/vjp calls, remat, scan, while,
cond) are inlined into the same flat graph, with boundary nodes where a region hands values
across a loop or branch. Every value that emission will constrain is reachable from the jaxpr
variable that defines it through ``Graph.var_values``, keyed by ``(scope, var)``: the scope is
the path of equation indices leading to the jaxpr, so one jaxpr object reused at two call
sites still gives distinct values.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax import lax


class NodeKind(enum.Enum):
    OP = "op"              # one primitive application
    INPUT = "input"        # an argument of the planned function
    CONST = "const"        # a constant captured in the jaxpr, kept replicated
    OUTPUT = "output"      # a result of the planned function (a sink)
    CARRY = "carry"        # a loop-carried value: (init, value fed back) -> value seen by the body
    SCAN_IN = "scan_in"    # one iteration's slice of a scanned-over input
    SCAN_OUT = "scan_out"  # the stacked result of a scan
    MERGE = "merge"        # a cond result: one operand per branch


@dataclass(frozen=True)
class Value:
    id: int
    shape: tuple[int, ...]
    dtype: Any
    # Made by an op XLA recomputes wherever it is needed (an iota, a broadcast of a scalar):
    # Rebuilt, not moved, where a consumer wants another spec (see `recomputable`).
    recomputable: bool = False

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def size(self) -> int:
        """Elements (a float0 value has them, at 0 bytes each)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


@functools.cache
def itemsize(dtype) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes such as PRNG keys
        return 8


def canonical_dtype(dtype):
    """``np.dtype(dtype)``, or ``dtype`` itself where numpy has none (jax's extended dtypes,
    such as a typed PRNG key's)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return dtype


@dataclass
class Node:
    id: int
    kind: NodeKind
    prim: str
    ins: tuple[int | None, ...]           # value ids; None marks a literal operand
    in_avals: tuple[tuple[tuple[int, ...], Any], ...]  # (shape, dtype) of every operand
    outs: tuple[int, ...]
    params: dict = field(default_factory=dict)
    trip_count: int = 1                   # how often the node runs per call
    in_trips: tuple[int, ...] = ()        # per operand: how often that edge is crossed
    where: str = ""                       # source location, for reports
    pinned: tuple[Any, ...] | None = None  # user-fixed specs of the results (or of a sink's operand)
    # The jax Primitive of an OP node (``eqn.primitive``): what the op-info registry
    # (passes.rules.op_info) is keyed by. ``prim`` is its name, or the boundary kind's.
    primitive: Any = None

    def edge_trip(self, pos: int) -> int:
        return self.in_trips[pos] if self.in_trips else self.trip_count


@dataclass
class Graph:
    values: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    producer: dict[int, tuple[int, int]] = field(default_factory=dict)  # value -> (node, out pos)
    var_values: dict[tuple[tuple, Any], int] = field(default_factory=dict)
    eqn_nodes: dict[tuple, int] = field(default_factory=dict)  # equation path -> its OP node
    # equation path of a scan/while/cond -> its boundary nodes by kind ("carry", "scan_in",
    # "scan_out", "merge"), in operand / result order
    region_nodes: dict[tuple, dict[str, list[int]]] = field(default_factory=dict)
    input_nodes: list[int] = field(default_factory=list)
    output_nodes: list[int] = field(default_factory=list)
    # Analyses that read only the graph (liveness, fusions), memoized by name by the passes
    # that compute them; a pass that changes the graph makes a new Graph.
    analyses: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def new_value(self, shape, dtype) -> int:
        vid = len(self.values)
        self.values.append(Value(vid, tuple(int(s) for s in shape), dtype))
        return vid

    def add_node(self, kind: NodeKind, prim: str, ins, in_avals, outs, **kw) -> Node:
        node = Node(len(self.nodes), kind, prim, tuple(ins), tuple(in_avals), tuple(outs), **kw)
        self.nodes.append(node)
        for pos, vid in enumerate(node.outs):
            self.producer[vid] = (node.id, pos)
        return node

    def consumers(self) -> dict[int, list[tuple[int, int]]]:
        """value -> [(node, operand position)], computed once (do not change it)."""
        if "consumers" not in self.analyses:
            uses: dict[int, list[tuple[int, int]]] = {}
            for node in self.nodes:
                for pos, vid in enumerate(node.ins):
                    if vid is not None:
                        uses.setdefault(vid, []).append((node.id, pos))
            self.analyses["consumers"] = uses
        return self.analyses["consumers"]

    def scopes(self) -> dict[int, tuple]:
        """OP node -> the equation path of the jaxpr it is in (``()``: the top level),
        computed once."""
        if "scopes" not in self.analyses:
            self.analyses["scopes"] = {n: path[:-1] for path, n in self.eqn_nodes.items()}
        return self.analyses["scopes"]

    def verify(self) -> None:
        """Internal invariants every pass may rely on."""
        for node in self.nodes:
            assert len(node.ins) == len(node.in_avals), node
            for vid in node.ins:
                assert vid is None or vid in self.producer, (node, vid)


def recomputable(graph: Graph, node: Node) -> bool:
    """Whether ``node``'s result is a broadcast of a scalar: XLA fuses it into its consumers
    instead of keeping it, and the emitter rebuilds it in whatever spec a consumer wants
    instead of moving it."""
    return node.kind is NodeKind.OP and node.primitive is lax.broadcast_in_dim_p and all(
        vid is None or graph.values[vid].rank == 0 for vid in node.ins)
