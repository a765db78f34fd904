"""The per-device memory budget as ILP rows (used by :mod:`passes.memory_fit`).

A plan's peak (``cost_model.memory``) is the bytes held for the whole call (arguments, and on
XLA:CPU the results) plus the temporaries live at the worst node. Both are linear in the
strategy choice: a value's bytes on a device follow from the spec its producer's chosen
strategy gives it. So "the bytes live at node t fit in the budget" is one linear row over
the group variables:

    sum over values v held or live at t, over strategies i of v's producer group g:
        s_g[i] * bytes(v in spec_i) <= budget - (the plan's other bytes at t: resharded copies)

A row per node would make the ILP as long as the program, so rows are added lazily (cutting
planes): solve, evaluate the plan's peak with ``cost_model.memory.memory_timeline``, add the
row of the node where it peaks, solve again, until the peak fits (:class:`BudgetRows`).

When no plan fits, :func:`smallest_peak` solves for the plan of least peak (the same rows,
``<= M``, minimizing M) and :func:`breakdown` says what its peak is made of, so
``InfeasiblePlanError`` can name the smallest peak and what dominates it.

The liveness here is ``cost_model.memory``'s own (:func:`cost_model.memory.temporaries`: which
values XLA materializes, its float32 copies of 16-bit dot operands, when each dies). What the
rows cannot say linearly (resharded operand copies, and on XLA:CPU the temporaries its buffer
assignment places in result buffers not yet written) is the plan's constant offset at that
node (:func:`plan_peak`); the peak that decides is always ``cost_model.memory``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.passes.estimate import plan_timeline, reductions, value_specs
from autopar.passes.liveness import (
    Buffer,
    reduction_bytes,
    running_sum,
    temporaries,
    value_bytes,
)
from autopar.passes.ir import Graph

#: Rounds of adding rows before giving up on a plan that keeps exceeding the budget.
MAX_ROUNDS = 12


@dataclass
class Liveness:
    """Which values are held for the whole call, and when the other buffers live."""
    held: list[int]                    # argument values, and results where results are held
    buffers: list[Buffer]              # the temporaries (``cost_model.memory.temporaries``)
    results: set[int] = field(default_factory=set)

    def live_at(self, t: int) -> list[Buffer]:
        return [b for b in self.buffers if b.born <= t <= b.dies]


def liveness(graph: Graph, results_held: bool) -> Liveness:
    """The liveness ``cost_model.memory.memory_timeline`` prices, for a plan that returns every
    result in the spec it is made in (a result made in place is held, or lives to the end)."""
    key = ("memory_budget.liveness", results_held)
    if key not in graph.analyses:
        graph.analyses[key] = _liveness(graph, results_held)
    return graph.analyses[key]


def _liveness(graph: Graph, results_held: bool) -> Liveness:
    results = {graph.nodes[n].ins[0] for n in graph.output_nodes
               if graph.nodes[n].ins and graph.nodes[n].ins[0] is not None}
    held = [v for n in graph.input_nodes for v in graph.nodes[n].outs]
    results -= set(held)
    buffers = temporaries(graph, results_held, frozenset(results))
    if results_held:
        held += sorted(results)
    else:
        end = len(graph.nodes) - 1
        buffers += [Buffer(v, graph.producer[v][0], end) for v in sorted(results)]
    return Liveness(held, buffers, results)


def plan_peak(graph: Graph, strats, choice, mesh) -> tuple[int, int, int]:
    """(peak bytes, node where it peaks, the bytes at that node the rows do not cover) of a
    plan, by ``cost_model.memory``. The last is the peak less the plan's row at that node:
    resharded operand copies, less what XLA:CPU places in result buffers not yet written."""
    held, live = plan_timeline(graph, strats, choice, mesh.axis_sizes, mesh.results_held)
    if not live:
        return held, 0, 0
    t = max(range(len(live)), key=live.__getitem__)
    return held + live[t], t, _uncovered(graph, strats, choice, mesh, [(held + live[t], t)])[0]


def peaks_over(graph: Graph, strats, choice, mesh, budget_bytes: float, most: int
               ) -> list[tuple[int, int]]:
    """(node, bytes the rows do not cover there) at the peak of each of the ``most`` highest
    stretches of consecutive nodes where the plan is over ``budget_bytes``, highest first: a
    plan over the budget in several places gets a row for each at once, where the peak alone
    would take a solve per place."""
    held, live = plan_timeline(graph, strats, choice, mesh.axis_sizes, mesh.results_held)
    stretches, top = [], None  # (live bytes, node) at each stretch's peak
    for t, nbytes in enumerate(live):
        if held + nbytes > budget_bytes:
            if top is None or nbytes > top[0]:
                top = (nbytes, t)
        elif top is not None:
            stretches.append(top)
            top = None
    if top is not None:
        stretches.append(top)
    tops = [(held + nbytes, t) for nbytes, t in sorted(stretches, reverse=True)[:most]]
    return list(zip([t for _, t in tops], _uncovered(graph, strats, choice, mesh, tops)))


def _uncovered(graph: Graph, strats, choice, mesh, totals: list[tuple[int, int]]
               ) -> list[int]:
    """For each (total bytes, node t) of a plan, the bytes of the total that its row at t
    does not count."""
    lv = liveness(graph, mesh.results_held)
    specs = value_specs(graph, strats, choice)
    reduced = reductions(graph, strats, choice, mesh.axis_sizes)

    def size(vid):
        return value_bytes(graph, vid, specs[vid], mesh.axis_sizes)

    held = sum(size(v) for v in lv.held)
    return [total - held - sum(int(b.scale * size(b.vid)) for b in lv.live_at(t))
            - reduced.get(t, 0) for total, t in totals]


class BudgetRows:
    """Memory rows over the ILP's group variables, in units of the budget."""

    def __init__(self, graph: Graph, strats, groups, mesh, budget_bytes: float):
        self.g, self.strats, self.groups, self.mesh = graph, strats, groups, mesh
        self.budget_bytes = float(budget_bytes)
        self.live = liveness(graph, mesh.results_held)
        self._coefs: dict[int, tuple[int, dict[int, float]]] = {}
        self._rows: dict[int, dict[tuple[int, int], float]] = {}
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
        return {offset[g] + i: c for (g, i), c in self._group_row(t).items()}

    def _group_row(self, t: int) -> dict[tuple[int, int], float]:
        """:meth:`row` by (group, strategy index in the group), computed once per node: every
        solve of a refit prices the rows again."""
        if t in self._rows:
            return self._rows[t]
        coefs: dict[tuple[int, int], float] = {}
        weighted = ([(vid, 1.0) for vid in self.live.held]
                    + [(b.vid, b.scale) for b in self.live.live_at(t)])
        for vid, scale in weighted:
            g, by_index = self._value_coefs(vid)
            for i, c in by_index.items():
                coefs[g, i] = coefs.get((g, i), 0.0) + scale * c
        g, by_index = self._reduction_coefs(t)
        for i, c in by_index.items():
            coefs[g, i] = coefs.get((g, i), 0.0) + c
        self._rows[t] = coefs
        return coefs

    def _reduction_coefs(self, t: int) -> tuple[int, dict[int, float]]:
        """(group of node t, {strategy index in the group: the bytes node t's reductions of
        partial results hold as it runs / budget}, for the strategies that reduce)."""
        node = self.g.nodes[t]
        coefs = {}
        for i, j in enumerate(self.groups.index_map[t]):
            nbytes = reduction_bytes(self.g, node, self.strats[t][j], self.mesh.axis_sizes)
            if nbytes:
                coefs[i] = nbytes / self.budget_bytes
        return self.groups.group_of[t], coefs

    def rhs(self, offset_bytes: float) -> float:
        """The row's bound, less the plan's bytes the row does not cover (:func:`plan_peak`)."""
        return 1.0 - offset_bytes / self.budget_bytes


def peak_lower_bound_bytes(graph: Graph, devices: int, results_held: bool) -> float:
    """A per-device peak no plan of ``graph`` on ``devices`` goes under: the arguments and the
    temporaries live at the worst node, each split evenly over all the devices. Which values are
    temporaries and when they live does not depend on the plan, and no spec splits a value over
    more than all the devices. (On XLA:CPU a temporary may sit in a result's buffer, which is
    held for the call anyway; with donation, results and arguments share buffers: the
    arguments plus the temporaries at a node stay under the peak either way.)"""
    live = liveness(graph, results_held)
    args = sum(graph.values[v].nbytes for n in graph.input_nodes for v in graph.nodes[n].outs)
    spans = [(b.born, b.dies, int(b.scale * graph.values[b.vid].nbytes)) for b in live.buffers]
    return (args + max(running_sum(spans, len(graph.nodes)), default=0)) / devices


def breakdown(graph: Graph, strats, choice, mesh, input_labels: list[str]
              ) -> list[tuple[str, int]]:
    """What a plan's peak (:func:`plan_peak`) is made of, largest first: the arguments by
    label (parameters, optimizer state, ...), the results held for the call, and the rest
    live at the peak (activations, temporaries, resharded copies); the parts sum to the
    peak."""
    specs = value_specs(graph, strats, choice)
    live = liveness(graph, mesh.results_held)
    peak = plan_peak(graph, strats, choice, mesh)[0]
    parts: dict[str, int] = {}

    def size(vid):
        return value_bytes(graph, vid, specs[vid], mesh.axis_sizes)

    for n, label in zip(graph.input_nodes, input_labels):
        parts[label] = parts.get(label, 0) + sum(size(v) for v in graph.nodes[n].outs)
    inputs = {v for n in graph.input_nodes for v in graph.nodes[n].outs}
    held_results = [v for v in live.held if v not in inputs]
    if held_results:
        parts["results"] = sum(size(v) for v in held_results)
    parts[LIVE_AT_PEAK] = max(0, peak - sum(parts.values()))
    return sorted(parts.items(), key=lambda kv: -kv[1])


#: The part of a peak that is neither an argument nor a result (:func:`breakdown`).
LIVE_AT_PEAK = "activations and temporaries"


#: Names of a train step's arguments, by the convention the baselines use too.
TRAIN_STEP_ARGS = ("parameters", "optimizer state", "batch")


def input_labels(in_tree, replaced=frozenset()) -> list[str]:
    """A label per flat argument leaf: its top-level argument, named by the train-step
    convention ``(params, opt_state, batch)`` when there are three and results replace
    every leaf of the first two and not of the third (``replaced``: flat leaf indices a
    result replaces), else ``argument i``."""
    children = in_tree.children()
    counts = [child.num_leaves for child in children]
    starts = [sum(counts[:i]) for i in range(len(counts))]

    def state(i):
        return counts[i] > 0 and all(j in replaced
                                     for j in range(starts[i], starts[i] + counts[i]))
    convention = len(children) == 3 and state(0) and state(1) and not state(2)
    names = TRAIN_STEP_ARGS if convention else [f"argument {i}" for i in range(len(children))]
    return [name for name, count in zip(names, counts) for _ in range(count)]


#: Share of the device memory left to the runtime, the framework and fragmentation when no
#: budget is given.
DEFAULT_MARGIN = 0.1


def default_memory_budget_bytes(profile) -> float:
    """The default budget: the profile's HBM capacity minus :data:`DEFAULT_MARGIN`."""
    return profile.hbm_capacity_bytes * (1.0 - DEFAULT_MARGIN)
