"""The shardings propagation fixes: the record both modes fill (:class:`Propagation`), where each
sharding comes from (:class:`Origin`), the user annotations that start it (:func:`seed`), and
the strategies of a node that keep its fixed values (:func:`compatible`). The modes:
``passes.propagate`` (forced, the pass entry) and ``passes.gspmd`` (complete)."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

from autopar.cost_model.spec import Spec
from autopar.passes.ir import Graph, Node, NodeKind
from autopar.passes.rules import op_info
from autopar.passes.strategies import Strategy
from autopar.passes.trace import constraint_label


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


def admits(fact, spec: Spec) -> bool:
    return fact.admits(spec) if isinstance(fact, Splits) else fact == spec


@functools.lru_cache(maxsize=65536)
def splits_of(spec: Spec) -> frozenset:
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
    plan's seed, see ``passes.candidates.best_of``); a user annotation of the same input wins."""
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
    if op_info(node).pin_param is not None:
        return constraint_label(node)
    return f"`{node.prim}` at {node.where or 'the program boundary'}"


def node_operands(node: Node):
    return [(pos, vid) for pos, vid in enumerate(node.ins) if vid is not None]


def compatible(node: Node, strats: list[Strategy], specs: dict, cache: dict | None = None
               ) -> list[int]:
    """Indices of the strategies that keep every fixed operand and result of ``node``.
    ``cache``: answers by (strategy list, fixed values), shared by the copies of a layer
    (identical nodes share one strategy list)."""
    fixed_in = tuple((pos, specs[vid]) for pos, vid in node_operands(node) if vid in specs)
    fixed_out = tuple((k, specs[vid]) for k, vid in enumerate(node.outs) if vid in specs)
    key = (id(strats), fixed_in, fixed_out)
    if cache is not None and key in cache:
        return cache[key][1]
    fits = [i for i, s in enumerate(strats)
            if all(admits(f, s.in_specs[p]) for p, f in fixed_in)
            and all(admits(f, s.out_specs[k]) for k, f in fixed_out)]
    if cache is not None:
        cache[key] = (strats, fits)  # holding the list keeps its id from being reused
    return fits


def spec_of(s: Strategy, side: str, pos: int) -> Spec:
    return s.out_specs[pos] if side == "out" else s.in_specs[pos]


def origin_of(node: Node, specs, origins) -> Origin:
    """The origin a value fixed at ``node`` inherits: the first fixed neighbour's annotation."""
    for vid in itertools.chain(node.ins, node.outs):  # operands first, as node_operands
        if vid is not None and vid in specs:
            return propagated_origin(origins[vid].label)
    raise AssertionError("a node is visited only with a fixed neighbour")


@functools.lru_cache(maxsize=1024)
def propagated_origin(label: str) -> Origin:
    """The origin of a sharding propagated from annotation ``label`` (one object per label:
    a deep model fixes hundreds of thousands of values from a handful of annotations)."""
    return Origin(label, False)
