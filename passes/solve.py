"""Pass 6, solve: pick one strategy per node by integer linear programming.

Formulation (Alpa's intra-op ILP, with resharding edges compressed by spec class):

* Variables. One binary one-hot vector ``s_g`` per *group* of nodes (a node alone, or nodes
  tied together: a follower merged into the op it follows by ``passes.cluster``, or a state
  output tied to the input it replaces). Node ``n`` in group ``g`` takes strategy
  ``map_n[i]`` when ``s_g[i] = 1``. Built by :meth:`IlpBuilder.add_groups`.
* ``sum(s_g) = 1`` for every group (:meth:`IlpBuilder.add_groups`).
* Node costs. ``sum_i s_g[i] * sum_{n in g} trips_n * (compute + comm)(map_n[i])``, where compute
  counts the flops each device really does (replicated work is not free) and comm is the
  reduction of partial results (:meth:`IlpBuilder.add_node_costs`).
* Edge costs. For an edge from node u (group a) to node w (group b), the cost of resharding u's
  result into the spec w needs depends only on the pair (u's out spec, w's in spec). Group a's
  strategies fall into classes by u's out spec, group b's by w's in spec, and a continuous
  ``e[p, q] >= 0`` per class pair satisfies ``sum_q e[p, q] = sum_{i in p} s_a[i]`` and
  ``sum_p e[p, q] = sum_{j in q} s_b[j]``. With one-hot ``s`` this forces ``e`` to the one pair
  chosen, so ``sum e[p, q] * R[p, q]`` is the exact resharding cost. Edges within a group, or
  with only one class on a side, are linear in ``s`` and need no ``e``
  (:meth:`IlpBuilder.add_edges`, :meth:`IlpBuilder._transport`).
* Large edges. When the two sides have more than ``MAX_EXACT_EDGE_PAIRS`` spec pairs (rank-4
  activations on a 2-D mesh, most tensors on a 3-D one), the same construction runs once per
  mesh axis over the dimension that axis splits on each side, with the cost of moving that
  axis alone. The sum over axes approximates the joint resharding cost with far fewer
  variables; node choices stay coupled across axes, and the plan's estimate is always
  computed exactly afterwards.

Costs are in microseconds so HiGHS sees well-scaled numbers. HiGHS runs through
``scipy.optimize.milp`` with a time limit; on the limit the best incumbent is kept, and with
none a greedy plan is used and a warning says so.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import scipy.sparse

from autopar.errors import InfeasiblePlanError
from autopar.cost_model.collectives import CommStep
from autopar.passes.background import Deferred
from autopar.passes.dedup import Groups
from autopar.passes.ir import Graph, NodeKind
from autopar.passes.memory_budget import (
    MAX_ROUNDS,
    BudgetRows,
    breakdown,
    peak_lower_bound_bytes,
    peaks_over,
    plan_peak,
)
from autopar.passes.strategies import MeshContext, Strategy
from autopar.errors import MemoryBudgetWarning, SolverFallbackWarning

_US = 1e6
# An edge whose two sides have more distinct spec pairs than this is priced axis by axis.
MAX_EXACT_EDGE_PAIRS = 400
# Relative optimality gap once memory rows are in: they weaken the LP bound, and closing the
# last fraction of a percent can take HiGHS ten times as long.
MEMORY_GAP = 5e-2
#: scipy.optimize.milp's status for "other" (HiGHS refused an option, among others).
HIGHS_OTHER_STATUS = 4


@dataclass
class Solution:
    choice: list[int]          # node -> chosen strategy index
    objective_us: float
    status: str                # "optimal", "time_limit", "greedy"
    num_variables: int
    num_constraints: int
    solve_time_s: float
    edges_before: int = 0      # graph edges
    edges_after: int = 0       # edge classes the ILP prices (passes.dedup)
    memory_rows: int = 0       # liveness rows the memory budget needed (passes.memory_budget)
    fits_budget: bool = True   # False: no plan found fits the memory budget (this one ignores it)
    least_peak_bytes: float | None = None  # the least peak found, when the budget was refitted
    least_peak_choice: list[int] | None = None  # ... and its plan


class IlpBuilder:
    def __init__(self, graph: Graph, strats: list[list[Strategy]], groups: Groups,
                 mesh: MeshContext):
        self.g, self.strats, self.groups, self.mesh = graph, strats, groups, mesh
        self.offset: dict[int, int] = {}
        self.n = 0
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []
        self._edge_cache: dict = {}
        # (group u, group w, u's class keys, w's class keys) -> [classes, classes, R]: edges
        # between the same two groups and classes share their e variables (see _transport).
        self._pending: dict = {}
        self.transports: list[tuple] = []  # every e block: (first var, Q, groups, keys, classes)
        self.latencies: list[tuple[int, list[int]]] = []  # (y, the x it bounds): see below

    def _new_vars(self, k: int, integer: bool) -> int:
        start = self.n
        self.n += k
        self.cost += [0.0] * k
        self.integer += [int(integer)] * k
        return start

    def build(self) -> IlpBuilder:
        """The whole ILP: groups, node costs, group latencies and edges."""
        self.add_groups()
        self.add_node_costs()
        self.add_group_latencies()
        self.add_edges()
        return self

    def add_groups(self) -> None:
        for g, size in self.groups.sizes.items():
            self.offset[g] = self._new_vars(size, True)
            self.rows.append(({self.offset[g] + i: 1.0 for i in range(size)}, 1.0, 1.0))

    def add_node_costs(self) -> None:
        """Nodes of one color in one group (copies of a layer) are priced once, times their
        count."""
        group_of, color = self.groups.group_of, self.groups.color
        classes: dict = {}
        for n in range(len(self.g.nodes)):
            key = n if color is None else (group_of[n], color[n])
            rep, count = classes.get(key, (n, 0))
            classes[key] = (rep, count + 1)
        for n, count in classes.values():
            node, strats, g = self.g.nodes[n], self.strats[n], group_of[n]
            for i, j in enumerate(self.groups.index_map[n]):
                self.cost[self.offset[g] + i] += strats[j].cost_s * node.trip_count * _US * count

    def add_group_latencies(self) -> None:
        """One latency per group of combined reductions (``CommStep.combined``: a train step's
        gradients and loss, which XLA's combiner merges and each strategy prices without
        latency): per kind, devices and trip count, a variable ``y`` at least the sum of each
        group's strategy variables whose node makes such a reduction, costing that latency
        once, as the estimate charges it (``cost_model.estimate``). Without it the ILP took
        plans whose lone combined reduction (a loss reduced over an axis no gradient is) paid
        a whole latency the ILP did not see: the MLP of the sharding benchmark on (8,), 13%
        slower."""
        xs_of: dict[tuple, dict[int, set[int]]] = {}  # key -> group -> its variables
        makes: dict[int, bool] = {}  # per strategy list: whether any strategy combines
        for g, members in self.groups.members.items():
            for n in members:
                strats = self.strats[n]
                if id(strats) not in makes:
                    makes[id(strats)] = any(step.combined for st in strats
                                            for step in st.collectives)
                if not makes[id(strats)]:
                    continue
                trips = self.g.nodes[n].trip_count
                for i, j in enumerate(self.groups.index_map[n]):
                    for step in strats[j].collectives:
                        if step.combined and step.kind is not None:
                            key = (step.kind, step.axes, step.group_size, step.axis_sizes, trips)
                            xs_of.setdefault(key, {}).setdefault(g, set()).add(
                                self.offset[g] + i)
        for (kind, axes, size, sizes, trips), by_group in xs_of.items():
            y = self._new_vars(1, False)
            self.latencies.append((y, sorted(set().union(*by_group.values()))))
            self.cost[y] = CommStep(kind, axes, size, 0, 0, axis_sizes=sizes).time_s(
                self.mesh.levels) * trips * _US
            # A group takes one strategy: y >= the sum of its variables that make the step.
            self.rows += [({y: 1.0, **{x: -1.0 for x in sorted(xs)}}, 0.0, np.inf)
                          for _, xs in sorted(by_group.items())]

    def _edge_matrix(self, u, k, w, pos):
        """Classes of group(u) by u's out spec k, of group(w) by w's in spec pos, and R [us]."""
        value = self.g.values[self.g.nodes[u].outs[k]]
        gu, gw = self.groups.group_of[u], self.groups.group_of[w]
        src = [self.strats[u][j].out_specs[k] for j in self.groups.index_map[u]]
        dst = [self.strats[w][j].in_specs[pos] for j in self.groups.index_map[w]]
        trip = self.g.nodes[w].edge_trip(pos)
        return gu, gw, src, dst, value, trip

    def _cost_us(self, a, b, value, trip) -> float:
        key = (a, b, value.shape, value.itemsize, value.recomputable)
        if key not in self._edge_cache:
            self._edge_cache[key] = self.mesh.reshard_time_s(a, b, value) * _US
        return self._edge_cache[key] * trip

    def edges(self):
        """[((u, k, w, pos), count)]: one edge per class of structurally identical edges
        (between the same two groups, from and to nodes of the same colors)."""
        group_of, color = self.groups.group_of, self.groups.color
        out: dict = {}
        for w_node in self.g.nodes:
            for pos, vid in enumerate(w_node.ins):
                if vid is None:
                    continue
                u, k = self.g.producer[vid]
                w = w_node.id
                key = ((u, w) if color is None else
                       (group_of[u], group_of[w], color[u], color[w]), k, pos)
                rep, count = out.get(key, ((u, k, w, pos), 0))
                out[key] = (rep, count + 1)
        return list(out.values())

    def edge_counts(self) -> tuple[int, int]:
        """(graph edges, edge classes priced)."""
        return sum(c for _, c in self.edge_classes), len(self.edge_classes)

    def add_edges(self) -> None:
        self.edge_classes = self.edges()
        for (u, k, w, pos), count in self.edge_classes:
            self._add_edge(u, k, w, pos, count)
        self._flush_transports()

    def _add_edge(self, u, k, w, pos, count: int = 1) -> None:
        gu, gw, src, dst, value, trip = self._edge_matrix(u, k, w, pos)
        trip *= count
        if gu == gw:
            for i, (a, b) in enumerate(zip(src, dst)):
                self.cost[self.offset[gu] + i] += self._cost_us(a, b, value, trip)
            return
        if len(set(src)) * len(set(dst)) <= MAX_EXACT_EDGE_PAIRS:
            self._transport(gu, gw, src, dst, lambda a, b: self._cost_us(a, b, value, trip))
            return
        # Too many spec pairs: price the move axis by axis (see the module docstring).
        for axis in self.mesh.axis_names:
            self._transport(
                gu, gw, [a.place_of(axis) for a in src], [b.place_of(axis) for b in dst],
                lambda p, q, axis=axis: self._axis_cost_us(axis, p, q, value, trip))

    def _axis_cost_us(self, axis, p, q, value, trip) -> float:
        key = (axis, p, q, value.shape, value.itemsize, value.recomputable)
        if key not in self._edge_cache:
            self._edge_cache[key] = self.mesh.axis_reshard_time_s(axis, p, q, value) * _US
        return self._edge_cache[key] * trip

    def _transport(self, gu, gw, src_keys, dst_keys, cost) -> None:
        """Add sum_p,q e[p,q] * cost(p, q) where e is the one pair of classes (src_keys of
        group gu's choice, dst_keys of group gw's choice) the two choices fall in. Edges with
        the same groups and keys (copies of a layer boundary, a value read twice) add their
        costs into one e (:meth:`_flush_transports`)."""
        src_classes = list(dict.fromkeys(src_keys))
        dst_classes = list(dict.fromkeys(dst_keys))
        R = np.array([[cost(a, b) for b in dst_classes] for a in src_classes])
        if not R.any():
            return
        if len(src_classes) == 1 or len(dst_classes) == 1:  # linear in the other side
            for i, b in enumerate(dst_keys):
                self.cost[self.offset[gw] + i] += R[0, dst_classes.index(b)] if len(
                    src_classes) == 1 else 0.0
            for i, a in enumerate(src_keys):
                self.cost[self.offset[gu] + i] += R[src_classes.index(a), 0] if len(
                    src_classes) > 1 else 0.0
            return
        key = (gu, gw, tuple(src_keys), tuple(dst_keys))
        if key in self._pending:  # another edge between the same classes: one e, costs add
            self._pending[key][2] += R
        else:
            self._pending[key] = [src_classes, dst_classes, R]

    def _flush_transports(self) -> None:
        for (gu, gw, src_keys, dst_keys), (src_classes, dst_classes, R) in self._pending.items():
            self._add_transport(gu, gw, src_keys, dst_keys, src_classes, dst_classes, R)
        self._pending = {}

    def _add_transport(self, gu, gw, src_keys, dst_keys, src_classes, dst_classes, R) -> None:
        P, Q = len(src_classes), len(dst_classes)
        e0 = self._new_vars(P * Q, False)
        self.transports.append((e0, Q, gu, gw, src_keys, dst_keys, src_classes, dst_classes))
        self.cost[e0:e0 + P * Q] = R.ravel().tolist()
        src_idx = {c: p for p, c in enumerate(src_classes)}
        dst_idx = {c: q for q, c in enumerate(dst_classes)}
        rows_p = [{e0 + p * Q + q: 1.0 for q in range(Q)} for p in range(P)]
        rows_q = [{e0 + p * Q + q: 1.0 for p in range(P)} for q in range(Q)]
        for i, a in enumerate(src_keys):
            rows_p[src_idx[a]][self.offset[gu] + i] = -1.0
        for j, b in enumerate(dst_keys):
            rows_q[dst_idx[b]][self.offset[gw] + j] = -1.0
        self.rows += [(r, 0.0, 0.0) for r in rows_p + rows_q]

    def point(self, choice: list[int]) -> np.ndarray | None:
        """The ILP's variables for a plan (a strategy per node) made elsewhere (a propagated
        one): each group takes the index of its first member that has the plan's strategy, its
        other members follow as the group maps them, and each e block takes the pair of classes
        the two groups fall in. A feasible point, so its objective bounds the optimum; None
        when some group holds no member's strategy."""
        x = np.zeros(self.n)
        picked = {}
        for g, members in self.groups.members.items():
            i = next((int(np.flatnonzero(self.groups.index_map[m] == choice[m])[0])
                      for m in members if (self.groups.index_map[m] == choice[m]).any()), None)
            if i is None:
                return None
            picked[g] = i
            x[self.offset[g] + i] = 1.0
        for e0, Q, gu, gw, src_keys, dst_keys, src_classes, dst_classes in self.transports:
            p = src_classes.index(src_keys[picked[gu]])
            q = dst_classes.index(dst_keys[picked[gw]])
            x[e0 + p * Q + q] = 1.0
        for y, xs in self.latencies:
            x[y] = x[xs].max()
        return x

    def matrices(self, extra_rows=()):
        """(c, A, lb, ub, integrality) of the ILP, with ``extra_rows`` (as :attr:`rows`)."""
        rows = self.rows + list(extra_rows)
        data, ri, ci, lb, ub = [], [], [], [], []
        for r, (coefs, lo, hi) in enumerate(rows):
            for c, v in coefs.items():
                ri.append(r)
                ci.append(c)
                data.append(v)
            lb.append(lo)
            ub.append(hi)
        A = scipy.sparse.csr_array((data, (ri, ci)), shape=(len(rows), self.n))
        return np.array(self.cost), A, np.array(lb), np.array(ub), np.array(self.integer)


def _milp(c, A, lb, ub, integer, time_limit_s: float, upper=None, gap: float = 1e-3,
          cutoff=None):
    """HiGHS through scipy. ``cutoff``: an objective some plan is known to reach (a warm
    start), or a function giving it (or None), called only when the MIP runs: HiGHS's
    ``objective_bound`` option, which prunes every branch that cannot beat it; scipy passes it
    through verbatim, with a RuntimeWarning that says so. HiGHS's feasibility
    jump heuristic is off: these ILPs are solved at the root (their LP relaxation is integral
    or nearly), and on the 96-layer GPT it spent 0.5 s of each 1.4 s solve before the LP.
    (Symmetry detection stays on: off, it saved 3-7% of each solve on the planning
    benchmark's GPTs, but the MLP on (2, 2, 2) of the sharding benchmark then took another
    of its near-optimal plans, 3% slower as compiled.)

    One thread, so the same ILP gives the same plan: with its default threads HiGHS returned
    either of two equally fast plans of the unrolled 96-layer GPT (2 of 6 solves of one
    dumped ILP differed), and their peaks differ (68802.9 and 68930.9 MiB), so the memory
    refit took different paths from run to run. HiGHS's thread pool is per process and fixed
    by its first solve: when something in the process solved with another thread count
    first, HiGHS refuses the option (status 4, no solution), and the solve runs again
    without it.

    One thread was not enough: in the planning process the same ILP (the same matrices and
    options) still gave either plan, in 3 of 9 runs of the benchmark the other one, though
    the ILP dumped and solved alone in a fresh process gave one plan 8 times of 8. So ties
    are broken: each cost gets a fixed pseudo-random share of :data:`TIE_BREAK` of the
    largest cost (:func:`_tie_break`); then 24 runs agreed on every solve's objective, and
    the 14 that compared plans on one plan. The result's ``fun`` is the cost of its ``x``
    without the tie breaks.

    (Ties the ILP cannot tell apart were once plans the estimate told apart: on the Llama on
    (4, 2), two plans of one objective were predicted 1.28 and 1.43 ms, because the axis-by-
    axis price of a large edge called free a move the estimate gathers; see
    ``MeshContext.axis_reshard_time_s``.)

    The LP relaxation is solved first, and its optimum taken when integral; a fractional one
    is the start of a dive, whose plan is taken when within ``gap`` of it
    (:func:`_from_relaxation`)."""
    options = {"time_limit": time_limit_s, "disp": bool(os.environ.get("AUTOPAR_HIGHS_LOG")),
               "mip_rel_gap": gap, "mip_heuristic_run_feasibility_jump": False,
               "threads": 1}
    costs = c + _tie_break(c)
    start = time.perf_counter()

    def run(integrality, options, bounds=None):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Unrecognized options", RuntimeWarning)
            res = scipy.optimize.milp(
                costs, integrality=integrality,
                bounds=(scipy.optimize.Bounds(0, 1 if upper is None else upper)
                        if bounds is None else bounds),
                constraints=scipy.optimize.LinearConstraint(A, lb, ub), options=options)
        if res.x is None and res.status == HIGHS_OTHER_STATUS and "threads" in options:
            return run(integrality, {k: v for k, v in options.items() if k != "threads"},
                       bounds)
        return res

    res, dived = _from_relaxation(run, integer, options, costs, gap, upper)
    if (res is not None and cutoff is not None and not callable(cutoff)
            and float(costs @ res.x) > cutoff):
        # Over a given cutoff: an integral relaxation's optimum is the ILP's, so no plan
        # beats the cutoff, as the MIP would prove; a dive's plan may miss one that does.
        res = (scipy.optimize.OptimizeResult(x=None, fun=None, status=2,
                                             message=CUTOFF_MESSAGE)
               if res.message == RELAXATION_MESSAGE else None)
    if res is None:
        if callable(cutoff):
            cutoff = cutoff()
        if dived is not None and cutoff is not None and float(costs @ dived.x) > cutoff:
            dived = None  # the cutoff asks for better
        if dived is not None:  # the MIP looks for a better plan than the dive's
            cutoff = float(costs @ dived.x)
        if cutoff is not None:
            options["objective_bound"] = cutoff
        options["time_limit"] = max(time_limit_s - (time.perf_counter() - start),
                                    time_limit_s * MIP_MIN_SHARE)
        res = run(integer, options)
        if res.x is None and dived is not None:
            # None better: proven (infeasible under the dive's objective), or not in time.
            dived.status, dived.message = (0, DIVE_MESSAGE) if res.status == 2 else (
                1, DIVE_UNPROVEN_MESSAGE)
            res = dived
    if res.x is not None:
        res.fun = float(c @ res.x)
    return res, time.perf_counter() - start


#: The least share of a solve's time limit the MIP gets after the LP relaxation
#: (:func:`_from_relaxation`, which may take the whole limit) was fractional or did not
#: finish; so a solve takes at most 1 + MIP_MIN_SHARE times its limit.
MIP_MIN_SHARE = 0.25
#: How far from an integer an integer variable of the LP relaxation's optimum may be.
INTEGRAL_TOLERANCE = 1e-6
#: The message of a solve that took an integral LP relaxation's optimum.
RELAXATION_MESSAGE = "optimal (an integral LP relaxation)"
#: The message of a solve whose integral relaxation's optimum is over its cutoff.
CUTOFF_MESSAGE = "no plan under the cutoff (an integral LP relaxation)"
#: The message of a solve that took the plan of a dive from a fractional relaxation.
DIVE_MESSAGE = "optimal within the gap (a dive from the LP relaxation)"
#: The message of a solve that took a dive's plan the MIP found none better than in time.
DIVE_UNPROVEN_MESSAGE = "time limit (the plan of a dive from the LP relaxation)"
#: The share of a solve's time limit a dive (:func:`_from_relaxation`) may take.
DIVE_SHARE = 0.25


def _from_relaxation(run, integer, options: dict, costs, gap: float, upper=None):
    """The ILP's solution read from its LP relaxation, or None when the MIP must run.
    ``run(integrality, options, bounds=None)`` solves the ILP with those (bounds: the
    variables', when not the ILP's own).

    These ILPs are mostly solved at the root: on the unrolled 96-layer GPT, HiGHS's MIP solve
    (presolve, the root LP, 1 node) took 1.4 s and its penalty solve 1.6 s, each
    returning the LP relaxation's optimum, while the LP alone, by dual simplex without presolve,
    took 0.56 and 0.65 s, the same plans (every column). An integral optimum of the relaxation
    is an optimum of the ILP; the tie breaks (:func:`_tie_break`) make it the one the MIP
    returns. The LP may take the whole time limit: the MoE of the sharding benchmark on
    (2, 2, 2) is integral too, its LP 8.6 s, its MIP 19.9 s of its 20 s limit (alone; with
    another row planning beside it, the LP took over the 10 s half the limit it had once,
    and the MIP did not finish). (Presolve, or interior point, made these LPs slower: 14-22 s
    for the 3-D MoE and Llama, whose LPs take 7.9 and 15.3 s as they are.)

    A fractional optimum has most integer variables integral (the unrolled 32-layer Llama's:
    all but 1,345 of 100,720), and lies close to the ILP's (0.03% under it there; HiGHS's MIP
    took 10 s to find and prove that optimum). So the integer variables the relaxation left
    integral are fixed and the MIP solves the rest (a dive), in at most :data:`DIVE_SHARE` of
    the time limit and only in what the LP left of it (so a solve still takes at most
    1 + :data:`MIP_MIN_SHARE` times its limit); its plan is taken when within ``gap`` of the
    relaxation's objective, a lower bound of the ILP's: the whole MIP, stopped at that gap,
    guarantees no more.

    Returns (the solution, or None when the MIP must run; a dive's plan outside the gap, or
    None): the MIP then looks for a better plan than that one, which stays the answer when
    it finds none (the tiny GPT's memory rows as constraints at 80% of its fastest peak:
    the dive's plan, 5.5% over the relaxation, is the one the MIP found in 10 s; with the
    time the LP and the dive took, the MIP found none)."""
    start = time.perf_counter()
    relaxed = run(np.zeros_like(integer), {
        "time_limit": options["time_limit"], "disp": options["disp"],
        "presolve": False, **({"threads": options["threads"]} if "threads" in options else {})})
    if relaxed.x is None or relaxed.status != 0:
        return None, None
    ints = np.asarray(integer) > 0
    off = np.abs(relaxed.x - np.round(relaxed.x)) > INTEGRAL_TOLERANCE
    if not off[ints].any():
        relaxed.x[ints] = np.round(relaxed.x[ints])
        relaxed.message = RELAXATION_MESSAGE
        return relaxed, None
    left_s = min(options["time_limit"] - (time.perf_counter() - start),
                 options["time_limit"] * DIVE_SHARE)
    if left_s <= 0:
        return None, None
    fixed = ints & ~off
    lo = np.zeros(len(costs))
    hi = np.broadcast_to(np.asarray(1.0 if upper is None else upper, float), lo.shape).copy()
    lo[fixed] = hi[fixed] = np.round(relaxed.x[fixed])
    dived = run(integer, {**options, "time_limit": left_s}, scipy.optimize.Bounds(lo, hi))
    if dived.x is None:
        return None, None
    bound, objective = float(costs @ relaxed.x), float(costs @ dived.x)
    if objective - bound > gap * max(abs(objective), 1e-9):
        return None, dived
    dived.status, dived.message = 0, DIVE_MESSAGE  # within the gap, whatever stopped it
    return dived, None


#: The tie breaks' scale, a share of the largest cost (see :func:`_milp`): on the 96-layer
#: GPT they added 25 us to a 203 ms optimum, far inside the solver's gap (0.1%).
TIE_BREAK = 1e-7


def _tie_break(c) -> np.ndarray:
    """A cost per variable, the same in every run, small enough to choose only among plans
    the ILP's costs cannot tell apart."""
    scale = TIE_BREAK * max(1.0, float(np.abs(c).max(initial=0.0)))
    return np.random.default_rng(0).random(len(c)) * scale


def _choice_of(x, graph: Graph, groups: Groups, offset: dict[int, int]) -> list[int]:
    choice = [0] * len(graph.nodes)
    for g, members in groups.members.items():
        i = int(np.argmax(x[offset[g]:offset[g] + groups.sizes[g]]))
        for n in members:
            choice[n] = int(groups.index_map[n][i])
    return choice


def solve(graph: Graph, strats, groups: Groups, mesh: MeshContext, *,
          time_limit_s: float = 60.0, memory_budget_bytes: float | None = None,
          warm: list[list[int]] | Deferred = (), while_solving: tuple[Deferred, ...] = (),
          progress=lambda msg: None) -> Solution:
    """The ILP's plan. ``warm``: plans made elsewhere (propagated ones) to start from, or a
    :class:`passes.background.Deferred` of name -> plan (made while the ILP is built): the
    best objective among them is HiGHS's cutoff (:func:`_milp`), and when the solver finds
    nothing better in its time limit, that plan is the solution (status "warm start"). With
    ``memory_budget_bytes``, a plan over the budget is refitted (:func:`_fit_budget`). When
    none fits, the plan without the budget, marked ``fits_budget=False``
    (:func:`over_budget_error` says why). ``while_solving``: work started in the background
    once the ILP is built, to run while HiGHS solves it (``passes.background``), as the
    budget's rows are."""
    builder = IlpBuilder(graph, strats, groups, mesh).build()
    c, A, lb, ub, integer = builder.matrices()
    rows = (None if memory_budget_bytes is None else
            Deferred(BudgetRows, graph, strats, groups, mesh, memory_budget_bytes))
    for job in tuple(while_solving) + ((rows,) if rows else ()):
        job.start()
    started = []  # the warm start, once asked for: an integral relaxation needs none

    def cutoff() -> float | None:
        started.append(_warm_start(builder, c, warm.result().values()
                                   if isinstance(warm, Deferred) else warm))
        return None if started[0] is None else _cutoff_of(started[0][1])

    res, took = _milp(c, A, lb, ub, integer, time_limit_s, cutoff=cutoff)
    start = started[0] if started else None
    progress(f"ILP: {took:.2f}s, {res.message}"
             + ("" if start is None else f" (warm start: cutoff {start[1]:.1f} us)"))
    if start is not None and (res.x is None or c @ res.x > _cutoff_of(start[1])):
        # Nothing better than the warm start: proven (infeasible under the cutoff), or not
        # found in time. (A plan within the cutoff's slack of it is as good: the tie breaks
        # may prefer it.)
        proven = res.status == 2
        if not proven:
            warnings.warn(f"autopar: the ILP found no plan better than the propagated one in "
                          f"{time_limit_s:.0f}s ({res.message}); using that plan. Raise "
                          "`time_limit_s` for a better one.", SolverFallbackWarning,
                          stacklevel=3)
        res = scipy.optimize.OptimizeResult(x=start[0], fun=start[1], status=0 if proven else 1,
                                            message="warm start")
    if res.status == 2:  # infeasible: pins are the only hard constraints
        raise InfeasiblePlanError(
            "no sharding plan satisfies the pinned shardings: two hints or "
            "with_sharding_constraint calls contradict each other. Remove one of them.")
    budget = None if rows is None else rows.result()
    if res.x is None:
        warnings.warn(f"autopar: the ILP found no solution in {time_limit_s:.0f}s "
                      f"({res.message}); using a greedy plan (or a propagated one predicted "
                      "faster, with baseline_seeds). Raise `time_limit_s` for a better one.",
                      SolverFallbackWarning, stacklevel=3)
        choice = greedy(graph, strats, groups, mesh)
        fits = budget is None or plan_peak(graph, strats, choice, mesh)[0] <= budget.budget_bytes
        return Solution(choice, float("nan"), "greedy", builder.n, len(builder.rows), took,
                        *builder.edge_counts(), fits_budget=fits)
    solution = _solution(res, graph, strats, groups, mesh, builder, took)
    if budget is None:
        return solution
    peak, t, copies = plan_peak(graph, strats, solution.choice, mesh)
    if peak <= budget.budget_bytes:
        return solution
    progress(f"memory: the plan peaks at {peak / 2**20:.1f} MiB at node {t}, over the budget "
             f"of {budget.budget_bytes / 2**20:.1f} MiB")
    budget.cuts.append((t, copies))
    (least, least_choice), fitted = _fit_budget(builder, budget, time_limit_s, solution.choice,
                                                took, solution.objective_us, progress)
    if fitted is None:
        return dataclasses.replace(solution, fits_budget=False, memory_rows=len(budget.cuts),
                                   least_peak_bytes=least, least_peak_choice=least_choice)
    choice, objective_us, took = fitted
    _inputs_take_their_slices(graph, strats, groups, mesh, choice)
    return dataclasses.replace(solution, choice=choice, objective_us=objective_us,
                               solve_time_s=solution.solve_time_s + took,
                               memory_rows=len(budget.cuts), least_peak_bytes=least,
                               least_peak_choice=least_choice)


def _solution(res, graph, strats, groups, mesh, builder: IlpBuilder, took: float) -> Solution:
    choice = _choice_of(res.x, graph, groups, builder.offset)
    _inputs_take_their_slices(graph, strats, groups, mesh, choice)
    status = ("optimal" if res.status == 0 else
              "warm start" if res.message == "warm start" else "time_limit")  # not proven
    return Solution(choice, float(res.fun), status, builder.n, len(builder.rows), took,
                    *builder.edge_counts())


def _cutoff_of(objective_us: float) -> float:
    """HiGHS's cutoff for a warm start of this objective: a hair above it, so a plan as good
    (which the tie breaks may prefer) is not cut off."""
    return objective_us * (1 + 1e-6) + 1e-9


def _warm_start(builder: IlpBuilder, c: np.ndarray, plans) -> tuple[np.ndarray, float] | None:
    """(point, objective) of the best of ``plans`` the ILP can take, or None."""
    points = [x for x in (builder.point(p) for p in plans) if x is not None]
    if not points:
        return None
    best = min(points, key=lambda x: float(c @ x))
    return best, float(c @ best)


#: Penalty solves of :func:`_fit_budget` (a tight budget needs a penalty up to
#: PENALTY_STEP ** 4 times the first), and the time limit of each, as a multiple of the plain
#: solve's time (at least PENALTY_TIME_MIN_S, at most PENALTY_TIME_LIMIT_S): a penalized
#: objective has many near-ties, and proving one optimal can take HiGHS far longer than
#: finding it; the penalty is a heuristic anyway. The minimum leaves the LP relaxation
#: (:func:`_from_relaxation`) time to finish on a loaded machine: the scanned 32-layer
#: GPT's penalized LPs take 0.56 s, and once hit a limit of 0.5 s (the MIP then ran: 3.3 s to
#: plan instead of 2.1).
PENALTY_SOLVES = 5
#: The factor between successive penalties until a plan fits.
PENALTY_STEP = 8.0
PENALTY_TIME_FACTOR = 2.0
PENALTY_TIME_MIN_S = 2.0
PENALTY_TIME_LIMIT_S = 5.0
#: A plan that fits within this of the plain plan's objective ends the refit; a slower one is
#: polished by solves of the memory rows as hard constraints (:func:`_hard_rows`, at most
#: HARD_ROW_SOLVES, each adding a row for each of up to HARD_ROW_NEW_ROWS stretches of nodes
#: its plan is over the budget at), limited together to HARD_ROW_TIME_FACTOR times the plain
#: solve's time and at least HARD_ROW_MIN_S: HiGHS takes much longer under hard rows (the
#: unrolled 96-layer GPT's: 5 s, its plain solve 2.4 s; the 2-layer GPT at 90% of its fastest
#: peak: the whole 10 s).
PENALTY_CLOSE_ENOUGH = 1e-3
HARD_ROW_SOLVES = 2
HARD_ROW_NEW_ROWS = 4
HARD_ROW_TIME_FACTOR = 4.0
HARD_ROW_MIN_S = 10.0
#: Graphs with these nodes (loops) are not polished: a plan polished to the budget's edge
#: compiles over it (scanned 32-layer GPT, default H100 budget of 67.06 GiB: 66.95 GiB
#: predicted, 69.64 compiled; the penalties' plan, 11% slower: 44.1 and 49.6). XLA:CPU's own
#: live-range report puts that plan's peak at 64.35 GiB, under the prediction: what the
#: model misses is how XLA:CPU packs the stack's 2 and 8 GiB buffers into its temp arena.
LOOP_KINDS = (NodeKind.CARRY, NodeKind.SCAN_IN, NodeKind.SCAN_OUT)


def _fit_budget(builder: IlpBuilder, budget: BudgetRows, time_limit_s: float,
                start: list[int], start_s: float, objective_us: float, progress):
    """((least peak found, its plan), (choice, objective in us, seconds) of the cheapest plan
    found that fits the budget, or None). ``start``: the plan that ignores the budget, solved in
    ``start_s``, of ILP objective ``objective_us``.

    Faster plans first, by penalty (Lagrangian relaxation): minimize time + lam * (bytes live
    at the rows of ``budget.cuts``, the nodes where plans peaked), from lam = ``objective_us``
    / PENALTY_STEP per budget (so a plan just over the budget gives up little time), raising
    lam until the plan fits, adding the row of every node a plan peaks at. A plan that fits
    within :data:`PENALTY_CLOSE_ENOUGH` of the plain plan's objective is taken; a slower one
    is only an upper bound for the cheapest plan under those rows as hard constraints
    (:func:`_hard_rows`), which replaced bisecting lam down: the penalty prices every byte at
    every row, so its first plan that fits can be far under the budget and far slower (not on
    graphs with loops: :data:`LOOP_KINDS`). Only when no penalty gives a plan that fits is the
    plan of least peak searched for (:func:`_smallest_peak`, memory only, over the rows the
    penalties found), and taken when it fits; it also gives the smallest peak an
    ``InfeasiblePlanError`` names. (It used to run first, for its rows; on the 96-layer
    unrolled GPT it took 4-5 s of a refit whose first fitting penalty plan is 0.0% slower.)
    The least-peak search prices no resharding, so its plans can peak on the copies their
    mismatched shardings make (a GPT on (2, 4) at 95% of its fastest peak: least peak found
    95.5%, while the penalties find a plan that fits). A budget under
    :func:`passes.memory_budget.peak_lower_bound_bytes` skips the penalties."""
    g, strats, groups, mesh = builder.g, builder.strats, builder.groups, builder.mesh
    c, A, lb, ub, integer = builder.matrices()
    t0 = time.perf_counter()

    def smallest() -> tuple[int, list[int]]:
        found = _smallest_peak(g, strats, groups, mesh, budget, time_limit_s, start)
        progress(f"least peak found: {found[0] / 2**20:.1f} MiB")
        return found

    bound = peak_lower_bound_bytes(g, math.prod(mesh.axis_sizes.values()), mesh.results_held)
    if bound > budget.budget_bytes:
        return smallest(), None
    least, least_choice = float("inf"), None  # of the plans the penalties find

    def penalty() -> np.ndarray:
        p = np.zeros(builder.n)
        for t, _ in budget.cuts:
            for i, coef in budget.row(t, builder.offset).items():
                p[i] += coef
        return p

    def attempt(res) -> tuple[float, bool, list[int]]:
        """The plan's peak, whether the row where it peaks joined the cuts (it was over the
        budget at a node no row covered), and the plan."""
        nonlocal least, least_choice
        choice = _choice_of(res.x, g, groups, builder.offset)
        _inputs_take_their_slices(g, strats, groups, mesh, choice)
        peak, t, copies = plan_peak(g, strats, choice, mesh)
        if peak < least:
            least, least_choice = peak, choice
        if peak > budget.budget_bytes and (t, copies) not in budget.cuts:
            budget.cuts.append((t, copies))
            return peak, True, choice
        return peak, False, choice

    best, total, last_peak = None, time.perf_counter() - t0, float("inf")
    limit_s = min(time_limit_s, PENALTY_TIME_LIMIT_S, max(PENALTY_TIME_MIN_S, PENALTY_TIME_FACTOR * start_s))
    # lam in us per budget: from an eighth of the plain plan's step time (a budget's worth of
    # bytes at the rows costs an eighth of a step), raised until a plan fits (past lam_max,
    # where memory outweighs every cost, only while that still lowers the peak).
    lam_max = max(float(np.abs(c).sum()), 1.0)
    lam = min(max(objective_us / PENALTY_STEP, 1.0), lam_max)
    for _ in range(PENALTY_SOLVES):
        res, took = _milp(c + lam * penalty(), A, lb, ub, integer, limit_s, gap=MEMORY_GAP)
        total += took
        if res.x is None:
            break
        peak, new_row, _ = attempt(res)
        slower = float(c @ res.x) / max(objective_us, 1e-9) - 1
        progress(f"memory penalty {lam:.3g} us per budget: {took:.2f}s, peak "
                 f"{peak / 2**20:.1f} MiB, {slower:+.1%} time")
        if peak <= budget.budget_bytes:
            best = res
            break
        if new_row:
            continue  # the same penalty again, now over the row where this plan peaked too
        if peak >= last_peak * 0.999 and lam >= lam_max:
            break  # a larger penalty no longer lowers the peak
        last_peak = peak
        lam *= PENALTY_STEP
    if (best is not None and float(c @ best.x) > objective_us * (1 + PENALTY_CLOSE_ENOUGH)
            and not any(n.kind in LOOP_KINDS for n in g.nodes)):
        t = time.perf_counter()
        hard_limit_s = min(time_limit_s, max(HARD_ROW_MIN_S, HARD_ROW_TIME_FACTOR * start_s))
        polished = _hard_rows(builder, budget, float(c @ best.x), objective_us, hard_limit_s,
                              attempt, progress)
        total += time.perf_counter() - t
        if polished is not None:
            best = polished
    if best is not None:
        return (least, least_choice), (_choice_of(best.x, g, groups, builder.offset),
                                       float(c @ best.x), total)
    t = time.perf_counter()
    found = smallest()
    total += time.perf_counter() - t
    if found[0] < least:
        least, least_choice = found
    if least > budget.budget_bytes:
        return (least, least_choice), None
    x = builder.point(least_choice)
    return (least, least_choice), (least_choice, float("nan") if x is None else float(c @ x),
                                   total)


def _hard_rows(builder: IlpBuilder, budget: BudgetRows, cutoff_us: float, objective_us: float,
               time_limit_s: float, attempt, progress):
    """The cheapest plan under the memory rows of ``budget.cuts`` as hard constraints and
    faster than ``cutoff_us``, each solve adding rows where its plan is over the budget, for
    at most :data:`HARD_ROW_SOLVES` solves in ``time_limit_s`` all told; None when none
    fits. The penalty solves price every byte at every row, and the plans between a
    penalty's last plan over the budget and its first under it are out of their reach (not
    on the convex hull): on the 2-layer realistic GPT at 90% of its fastest peak the
    penalties go from 0.9% slower than the plain plan (over the budget) to 31.6% slower, and
    the rows as constraints find one 11.8% slower that fits."""
    left_s = time_limit_s
    for _ in range(HARD_ROW_SOLVES):
        if left_s < 1.0:
            return None
        c, A, lb, ub, integer = builder.matrices(
            (budget.row(t, builder.offset), -np.inf, budget.rhs(copies))
            for t, copies in budget.cuts)
        res, took = _milp(c, A, lb, ub, integer, left_s, gap=MEMORY_GAP,
                          cutoff=cutoff_us * (1 - 1e-6))
        left_s -= took
        rows = len(budget.cuts)
        if res.x is None:
            progress(f"memory rows as constraints ({rows}): {took:.2f}s, none faster found")
            return None
        peak, _, choice = attempt(res)
        progress(f"memory rows as constraints ({rows}): {took:.2f}s, peak "
                 f"{peak / 2**20:.1f} MiB, {float(c @ res.x) / objective_us - 1:+.1%} time")
        if peak <= budget.budget_bytes:
            return res
        budget.cuts += [cut for cut in peaks_over(builder.g, builder.strats, choice, builder.mesh,
                                                  budget.budget_bytes, HARD_ROW_NEW_ROWS)
                        if cut not in budget.cuts]
        if len(budget.cuts) == rows:
            return None  # over the budget where a row already is: the rows cannot say more
    return None


def _smallest_peak(graph: Graph, strats, groups: Groups, mesh: MeshContext,
                   budget: BudgetRows, time_limit_s: float, start: list[int]
                   ) -> tuple[int, list[int]]:
    """(peak, choice) of the plan with the least peak found: minimize M over the memory rows
    (each <= M), starting from the rows of ``budget.cuts`` (when there are none, the one where
    plan ``start`` peaks), and adding (to ``budget.cuts``) the row where each plan found
    peaks, as long as that lowers the peak."""
    b = IlpBuilder(graph, strats, groups, mesh)
    b.add_groups()
    m = b._new_vars(1, False)
    b.cost[m] = 1.0
    best: tuple[int, list[int]] | None = None
    cuts = budget.cuts  # the rows found here serve the caller's later solves too
    if not cuts:
        cuts.append(plan_peak(graph, strats, start, mesh)[1:])
    for _ in range(MAX_ROUNDS):
        b.rows = b.rows[:len(groups.sizes)] + [
            ({**budget.row(t, b.offset), m: -1.0}, -np.inf, budget.rhs(copies) - 1.0)
            for t, copies in cuts]
        c, A, lb, ub, integer = b.matrices()
        upper = np.ones(b.n)
        upper[m] = np.inf
        res, _ = _milp(c, A, lb, ub, integer, time_limit_s, upper, gap=MEMORY_GAP)
        if res.x is None:
            break
        choice = _choice_of(res.x, graph, groups, b.offset)
        _inputs_take_their_slices(graph, strats, groups, mesh, choice)
        peak, t, copies = plan_peak(graph, strats, choice, mesh)
        if best is None or peak < best[0]:
            best = (peak, choice)
        if (t, copies) in cuts:
            break
        cuts.append((t, copies))
    assert best is not None, "the min-peak ILP has no constraint that can fail"
    return best


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


#: What shrinks each part of a peak, for the InfeasiblePlanError message.
_ADVICE = {
    "activations and temporaries": "a smaller batch or sequence, or rematerialization",
    "optimizer state": "a lower-precision or stateless optimizer",
    "results": "the state the step returns (on XLA:CPU results are held for the whole call)",
}


def over_budget_error(graph, strats, groups, mesh, budget_bytes: float, input_labels,
                      time_limit_s: float, solution: Solution, tried: str = "",
                      advice: str = "") -> InfeasiblePlanError:
    """The error for a program no plan of which fits ``budget_bytes`` (``solution``: the plan
    found without it): the smallest peak found (the solve's, or a min-peak ILP's when the
    solve did not look for one) and what dominates it. ``tried``: what else was tried, said in
    the message (rematerialization, say); ``advice``: a sentence more on what to do."""
    if solution.least_peak_choice is not None:
        peak, choice = solution.least_peak_bytes, solution.least_peak_choice
    else:
        budget = BudgetRows(graph, strats, groups, mesh, budget_bytes)
        peak, choice = _smallest_peak(graph, strats, groups, mesh, budget, time_limit_s,
                                      solution.choice)
    parts = breakdown(graph, strats, choice, mesh, input_labels)
    detail = ", ".join(f"{name} {_gib(size)}" for name, size in parts if size)
    top = parts[0][0]
    error = InfeasiblePlanError(
        f"no sharding plan fits `memory_budget` = {_gib(budget_bytes)} per device{tried}: the "
        f"smallest peak autopar found is {_gib(peak)} per device, dominated by {top} "
        f"({detail}). Raise `memory_budget`, plan on more devices, or shrink {top} "
        f"({_ADVICE.get(top, 'smaller or lower-precision arrays')}).{advice}")
    error.smallest_peak_bytes = peak
    error.peak_breakdown = parts
    return error


def _inputs_take_their_slices(graph: Graph, strats, groups: Groups, mesh: MeshContext,
                              choice: list[int]) -> None:
    """An argument whose every consumer slices it to the same spec (a free local slice) is
    given that spec itself. The time is the same, and the argument then takes less memory
    per device; the ILP sees the two as a tie."""
    users = graph.consumers()
    tied = {groups.group_of[n.id] for n in graph.nodes if n.kind is not NodeKind.INPUT}
    for n in graph.input_nodes:
        if groups.group_of[n] in tied:
            continue  # tied to other nodes (a state output): keep the group's choice
        vid = graph.nodes[n].outs[0]
        wanted = {strats[w][choice[w]].in_specs[pos] for w, pos in users.get(vid, ())}
        if len(wanted) != 1:
            continue
        dst = wanted.pop()
        src = strats[n][choice[n]].out_specs[0]
        if dst is None or dst == src:
            continue
        steps = mesh.reshard(src, dst, graph.values[vid])
        match = [i for i, st in enumerate(strats[n]) if st.out_specs[0] == dst]
        if match and all(step.kind is None for step in steps):
            choice[n] = match[0]


def greedy(graph: Graph, strats, groups: Groups, mesh: MeshContext) -> list[int]:
    """Each group, in node order, takes its cheapest strategy given the choices made so far."""
    picked: dict[int, int] = {}
    for node in graph.nodes:
        g = groups.group_of[node.id]
        if g in picked:
            continue
        best, best_cost = 0, float("inf")
        for i in range(groups.sizes[g]):
            cost = 0.0
            for n in groups.members[g]:
                s = strats[n][groups.index_map[n][i]]
                cost += s.cost_s * graph.nodes[n].trip_count
                for pos, vid in enumerate(graph.nodes[n].ins):
                    if vid is None:
                        continue
                    u, k = graph.producer[vid]
                    gu = groups.group_of[u]
                    if gu in picked:
                        src = strats[u][groups.index_map[u][picked[gu]]].out_specs[k]
                        cost += mesh.reshard_time_s(src, s.in_specs[pos], graph.values[vid])
            if cost < best_cost:
                best, best_cost = i, cost
        picked[g] = best
    return [int(groups.index_map[n][picked[groups.group_of[n]]]) for n in range(len(graph.nodes))]
