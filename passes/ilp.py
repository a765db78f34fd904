"""The ILP's model (pass 6, solve, builds it here; ``passes.highs`` solves it).

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

Costs are in microseconds so HiGHS (``passes.highs``) sees well-scaled numbers.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse

from autopar.cost_model.collectives import CommStep
from autopar.passes.dedup import Groups
from autopar.passes.ir import Graph
from autopar.passes.strategies import MeshContext, Strategy

_US = 1e6
# An edge whose two sides have more distinct spec pairs than this is priced axis by axis.
MAX_EXACT_EDGE_PAIRS = 400


class IlpBuilder:
    """The ILP of one graph: variables, costs (:attr:`cost`) and rows (:attr:`rows`), built by
    :meth:`build`; :meth:`matrices` gives them to the solver."""

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

    def new_vars(self, k: int, integer: bool) -> int:
        """Add ``k`` variables of cost 0 (integral or not); the index of the first."""
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
            self.offset[g] = self.new_vars(size, True)
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
        once, as the estimate charges it (``cost_model.estimate``), so a lone combined
        reduction pays its latency in the ILP as in the estimate."""
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
            y = self.new_vars(1, False)
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
        e0 = self.new_vars(P * Q, False)
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


def choice_of(x, graph: Graph, groups: Groups, offset: dict[int, int]) -> list[int]:
    """The plan (a strategy index per node) of the ILP's solution ``x``."""
    choice = [0] * len(graph.nodes)
    for g, members in groups.members.items():
        i = int(np.argmax(x[offset[g]:offset[g] + groups.sizes[g]]))
        for n in members:
            choice[n] = int(groups.index_map[n][i])
    return choice
