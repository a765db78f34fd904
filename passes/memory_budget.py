"""The per-device memory budget as ILP rows (used by :mod:`passes.solve`).

A plan's peak (``cost_model.memory``) is the bytes held for the whole call (arguments, and on
XLA:CPU the results) plus the temporaries live at the worst node. Both are linear in the
strategy choice: a value's bytes on a device follow from the spec its producer's chosen
strategy gives it. So "the bytes live at node t fit in the budget" is one linear row over
the group variables:

    sum over values v held or live at t, over strategies i of v's producer group g:
        s_g[i] * bytes(v in spec_i) <= budget - (resharded operand copies at t)

A row per node would make the ILP as long as the program, so rows are added lazily (cutting
planes): solve, evaluate the plan's peak with ``cost_model.memory.memory_timeline``, add the
row of the node where it peaks, solve again, until the peak fits (:class:`BudgetRows`).

When no plan fits, :func:`smallest_peak` solves for the plan of least peak (the same rows,
``<= M``, minimizing M) and :func:`breakdown` says what its peak is made of, so
``InfeasiblePlanError`` can name the smallest peak and what dominates it.

The liveness here mirrors ``cost_model.memory`` (which values XLA materializes, when they
die); the peak that decides is always that module's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_model.estimate import value_specs
from cost_model.memory import (consumers, last_uses, materialized, memory_timeline,
                               resharded_copies_bytes, value_bytes)
from passes.ir import Graph, NodeKind

#: Rounds of adding rows before giving up on a plan that keeps exceeding the budget.
MAX_ROUNDS = 12


@dataclass
class Liveness:
    """Which values are held for the whole call, and when the others live."""
    held: list[int]                    # argument values, and results where results are held
    born: dict[int, int]               # temporary value -> node making it
    dies: dict[int, int]               # temporary value -> last node it is live at
    results: set[int] = field(default_factory=set)

    def live_at(self, t: int) -> list[int]:
        return [v for v, b in self.born.items() if b <= t <= self.dies[v]]


def liveness(graph: Graph, results_held: bool) -> Liveness:
    users = consumers(graph)
    last = last_uses(graph, users)
    results = {graph.nodes[n].ins[0] for n in graph.output_nodes
               if graph.nodes[n].ins and graph.nodes[n].ins[0] is not None}
    held = [v for n in graph.input_nodes for v in graph.nodes[n].outs]
    if results_held:
        held += sorted(results - set(held))
    end = len(graph.nodes)
    born, dies = {}, {}
    for node in graph.nodes:
        if node.kind is NodeKind.INPUT:
            continue
        for vid in materialized(graph, node, users):
            if results_held and vid in results:
                continue
            born[vid] = node.id
            dies[vid] = end if vid in results else last.get(vid, node.id)
    return Liveness(held, born, dies, results)


def plan_peak(graph: Graph, strats, choice, mesh) -> tuple[int, int, int]:
    """(peak bytes, node where it peaks, resharded-copy bytes at that node) of a plan, by
    ``cost_model.memory``."""
    specs = value_specs(graph, strats, choice)
    operand = {n.id: strats[n.id][choice[n.id]].in_specs for n in graph.nodes}
    held, live = memory_timeline(graph, specs, mesh.axis_sizes,
                                 results_held=mesh.results_held, operand_specs=operand)
    if not live:
        return held, 0, 0
    t = max(range(len(live)), key=live.__getitem__)
    copies = resharded_copies_bytes(graph, specs, operand, mesh.axis_sizes)[t]
    return held + live[t], t, copies


class BudgetRows:
    """Memory rows over the ILP's group variables, in units of the budget."""

    def __init__(self, graph: Graph, strats, groups, mesh, budget_bytes: float):
        self.g, self.strats, self.groups, self.mesh = graph, strats, groups, mesh
        self.budget_bytes = float(budget_bytes)
        self.live = liveness(graph, mesh.results_held)
        self._coefs: dict[int, tuple[int, dict[int, float]]] = {}
        self.cuts: list[tuple[int, float]] = []    # (node, resharded-copy bytes) of each row

    def _value_coefs(self, vid: int) -> tuple[int, dict[int, float]]:
        """(group of v's producer, {strategy index in the group: v's bytes / budget})."""
        if vid not in self._coefs:
            u, k = self.g.producer[vid]
            self._coefs[vid] = (self.groups.group_of[u], {
                i: value_bytes(self.g, vid, self.strats[u][j].out_specs[k],
                               self.mesh.axis_sizes) / self.budget_bytes
                for i, j in enumerate(self.groups.index_map[u])})
        return self._coefs[vid]

    def row(self, t: int, offset: dict[int, int]) -> dict[int, float]:
        """The bytes held or live at node t over the group variables (x budget)."""
        coefs: dict[int, float] = {}
        for vid in self.live.held + self.live.live_at(t):
            g, by_index = self._value_coefs(vid)
            for i, c in by_index.items():
                coefs[offset[g] + i] = coefs.get(offset[g] + i, 0.0) + c
        return coefs

    def rhs(self, copies_bytes: float) -> float:
        return 1.0 - copies_bytes / self.budget_bytes


def breakdown(graph: Graph, strats, choice, mesh, input_labels: list[str]
              ) -> list[tuple[str, int]]:
    """What a plan's peak is made of, largest first: the arguments by label (parameters,
    optimizer state, ...), the results held for the call, and the activations and other
    temporaries live at the peak."""
    specs = value_specs(graph, strats, choice)
    live = liveness(graph, mesh.results_held)
    _, t, copies = plan_peak(graph, strats, choice, mesh)
    parts: dict[str, int] = {}

    def size(vid):
        return value_bytes(graph, vid, specs[vid], mesh.axis_sizes)

    for n, label in zip(graph.input_nodes, input_labels):
        parts[label] = parts.get(label, 0) + sum(size(v) for v in graph.nodes[n].outs)
    inputs = {v for n in graph.input_nodes for v in graph.nodes[n].outs}
    held_results = [v for v in live.held if v not in inputs]
    if held_results:
        parts["results"] = sum(size(v) for v in held_results)
    parts["activations and temporaries"] = sum(size(v) for v in live.live_at(t)) + copies
    return sorted(parts.items(), key=lambda kv: -kv[1])


#: Names of a train step's arguments, by the convention the baselines use too.
TRAIN_STEP_ARGS = ("parameters", "optimizer state", "batch")


def input_labels(in_tree) -> list[str]:
    """A label per flat argument leaf: its top-level argument, named by the train-step
    convention ``(params, opt_state, batch)`` when there are three."""
    children = in_tree.children()
    names = (TRAIN_STEP_ARGS if len(children) == 3 else
             [f"argument {i}" for i in range(len(children))])
    return [name for name, child in zip(names, children) for _ in range(child.num_leaves)]


#: Share of the device memory left to the runtime, the framework and fragmentation when no
#: budget is given.
DEFAULT_MARGIN = 0.1


def default_memory_budget_bytes(profile) -> float:
    """The default budget: the profile's HBM capacity minus :data:`DEFAULT_MARGIN`."""
    return profile.hbm_capacity_bytes * (1.0 - DEFAULT_MARGIN)
