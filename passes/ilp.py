"""The ILP's model (pass 6, solve, builds it here; ``passes.highs`` solves it).

Formulation (Alpa's intra-op ILP, with resharding edges compressed by spec class):

* Variables. One binary one-hot vector ``s_g`` per *group* of nodes (a node alone, or nodes
  tied together: a follower merged into the op it follows by ``passes.cluster``, or a state
  output tied to the input it replaces). Node ``n`` in group ``g`` takes strategy
  ``map_n[i]`` when ``s_g[i] = 1``. Built by :meth:`IlpBuilder.add_groups`.
* ``sum(s_g) = 1`` for every group (:meth:`IlpBuilder.add_groups`).

The objective is the estimate's step time: the makespan of the plan's simulated timeline,
where collectives overlap the compute that does not wait for them
(``passes.estimate.plan_makespan``), through the same cost functions. A makespan is not
linear, so the overlap enters as a linear approximation around a reference plan
(``passes.estimate.hidden_comm``, given as ``hidden``): each node's reductions, each combiner
group's latency and each move into a reader are charged only what exceeds the time the
reference's timeline hides of them there, whatever strategy is taken. For the reference itself
the objective is its makespan; for a plan far from it, an approximation, exact only in the
serial bound. ``passes.solve`` solves first without a reference (every collective charged in
full, but a collective matmul's only as far as its own pieces leave it exposed), then builds
the ILP around its plan, and solves it again unless that plan is proven optimal. Where that
plan takes a collective matmul, the same again with them charged in full too
(``rings_in_full``) gives the plan it competes with.

* Node costs. ``sum_i s_g[i] * sum_{n in g} trips_n * (compute + reduction bytes)(map_n[i])``,
  where compute counts the flops each device really does (replicated work is not free)
  (:meth:`IlpBuilder.add_node_costs`).
* Reduction latency. Reductions XLA's combiner merges (``estimate.combiner_key``: one kind,
  devices, trip count and depth) pay one latency: a ``y >= `` each group's variables that make
  such a reduction costs it once (:meth:`IlpBuilder.add_group_latencies`).
* Edge costs. For an edge from node u (group a) to node w (group b), the cost of resharding u's
  result into the spec w needs depends only on the pair (u's out spec, w's in spec). Group a's
  strategies fall into classes by u's out spec, group b's by w's in spec, and a continuous
  ``e[p, q] >= 0`` per class pair satisfies ``sum_q e[p, q] = sum_{i in p} s_a[i]`` and
  ``sum_p e[p, q] = sum_{j in q} s_b[j]``. With one-hot ``s`` this forces ``e`` to the one pair
  chosen, so ``sum e[p, q] * R[p, q]`` is the exact resharding cost. Edges within a group, or
  with only one class on a side, are linear in ``s`` and need no ``e``
  (:meth:`IlpBuilder.add_edges`, :meth:`IlpBuilder._transport`).
* Shared moves. A value read in one spec by several groups moves once: per spec pair, a
  ``m >= `` each reader's indicator of that pair carries its cost
  (:meth:`IlpBuilder._add_shared_value`); a reader with more than ``MAX_SHARED_VALUE_PAIRS``
  pairs is charged alone (an over-estimate), except that around a reference that served it by
  another reader's move, a pair no dearer than the reference's is free. A reader's strategy
  whose rewrite returns the value moved to a spec (``Rewrite.keeps``: a collective matmul
  that keeps the operand it gathers) pays the move into that spec for the others: its
  variables ``k`` enter as ``m >= indicator - k`` (:meth:`IlpBuilder._kept_credits`).
* Preferences. Among plans the costs cannot tell apart, one whose nodes take the strategies
  the caller prefers (``preferences``: node -> a penalty per strategy, e.g. the batch on the
  mesh axis named ``data``): a cost of at most :data:`PREFERENCE` of the largest cost per
  unit, so far below any real difference (:meth:`IlpBuilder.add_preferences`).
* Large edges. When the two sides have more than ``MAX_EXACT_EDGE_PAIRS`` spec pairs (most
  tensors on a 3-D mesh), the same construction runs once per mesh axis over the dimension that
  axis splits on each side, with the cost of moving that axis alone: an approximation of the
  joint cost, scaled so that the reference's pair costs what its joint move costs.

Costs are in microseconds so HiGHS (``passes.highs``) sees well-scaled numbers.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse

from autopar.passes.dedup import Groups
from autopar.passes.estimate import (Hidden, combined_latency_s, combiner_key,
                                     without_latency_s)
from autopar.passes.ir import Graph
from autopar.passes.reductions import reduction_depths
from autopar.passes.strategies import MeshContext, RewriteKind, Strategy

_US = 1e6
# An edge whose two sides have more distinct spec pairs than this is priced axis by axis.
MAX_EXACT_EDGE_PAIRS = 625
# A value read by several groups is priced once per target spec through indicator variables
# of each reader's spec pair; a reader with more pairs than this is priced alone (more would
# make the LP relaxation fractional and the solve many times slower).
MAX_SHARED_VALUE_PAIRS = 64
#: A preference's cost per unit of penalty: this share of the largest cost, and at most
#: :data:`PREFERENCE_OF_BOUND` of the objective's lower bound (each group at its cheapest).
#: Above ``passes.highs.TIE_BREAK`` (the random tie breaks), far below a real difference.
PREFERENCE = 1e-5
PREFERENCE_OF_BOUND = 1e-5
#: The collective matmuls (``passes.overlap.collective_matmul``): rewrites whose ring steps
#: run beside their own compute.
RINGS = frozenset({RewriteKind.ALL_GATHER_MATMUL, RewriteKind.MATMUL_REDUCE_SCATTER})


class IlpBuilder:
    """The ILP of one graph: variables, costs (:attr:`cost`) and rows (:attr:`rows`), built by
    :meth:`build`; :meth:`matrices` gives them to the solver."""

    def __init__(self, graph: Graph, strats: list[list[Strategy]], groups: Groups,
                 mesh: MeshContext, preferences: dict | None = None,
                 hidden: Hidden | None = None, like: IlpBuilder | None = None,
                 rings_in_full: bool = False):
        """``hidden``: the reference plan's overlap (see the module docstring); ``like``: a
        builder of the same graph, strategies and groups whose structure and prices this one
        reuses (the ILP around a reference is built after the one without); both number their
        group variables alike, as :meth:`build` adds the groups first. ``rings_in_full``:
        without a reference, a collective matmul's steps are charged in full, as every
        reduction is there (:data:`RINGS`), so that its plan is the one the serial ILP
        takes without them."""
        self.g, self.strats, self.groups, self.mesh = graph, strats, groups, mesh
        self.preferences = preferences or {}
        self.rings_in_full = rings_in_full and hidden is None
        self.hidden = hidden or Hidden({}, {}, {}, {})
        # What does not depend on the reference: prices and the latency and value structure.
        self._memo: dict = {} if like is None else like._memo
        self.offset: dict[int, int] = {}
        self.n = 0
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []
        self._edge_cache: dict = self._memo.setdefault("edges", {})
        # (group u, group w, u's class keys, w's class keys) -> [classes, classes, R]: edges
        # between the same two groups and classes share their e variables (see _transport).
        self._pending: dict = {}
        self.transports: list[tuple] = []  # every e block: (first var, Q, groups, keys, classes)
        self.latencies: list[tuple[int, list[int]]] = []  # (y, the x it bounds): see below
        # (m, the readers' indicators it bounds, the variables that pay it instead): a value's
        # move paid once (_add_shared_value)
        self.shared: list[tuple[int, list[dict[int, float]], dict[int, float]]] = []
        self._indicator_blocks: dict = {}  # (gu, gw, src keys, dst keys) -> first e variable
        self._strategy_cache: dict[tuple, float] = self._memo.setdefault("strategies", {})
        self._step_cache: dict = self._memo.setdefault("steps", {})

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
        self.add_preferences()
        return self

    def add_preferences(self) -> None:
        """Each preferred node's penalty of each of its strategies, at a cost per unit far
        below the ILP's own (:data:`PREFERENCE`): a tie break between plans."""
        if not self.preferences:
            return
        cost = np.array(self.cost)
        bound = sum(float(cost[self.offset[g]:self.offset[g] + size].min())
                    for g, size in self.groups.sizes.items())
        unit = min(PREFERENCE * max(1.0, float(np.abs(cost).max(initial=0.0))),
                   PREFERENCE_OF_BOUND * max(1.0, bound))
        for n, penalty in self.preferences.items():
            g = self.groups.group_of[n]
            for i, j in enumerate(self.groups.index_map[n]):
                self.cost[self.offset[g] + i] += unit * penalty(self.strats[n][j])

    def add_groups(self) -> None:
        for g, size in self.groups.sizes.items():
            self.offset[g] = self.new_vars(size, True)
            self.rows.append(({self.offset[g] + i: 1.0 for i in range(size)}, 1.0, 1.0))

    def add_node_costs(self) -> None:
        """Each strategy's compute and its reductions' bytes; their latencies are charged per
        combiner group (:meth:`add_group_latencies`). Nodes of one color in one group (copies
        of a layer) are priced once, times their count."""
        group_of, color = self.groups.group_of, self.groups.color
        classes: dict = {}
        for n in range(len(self.g.nodes)):
            key = n if color is None else (group_of[n], color[n])
            rep, count, hidden = classes.get(key, (n, 0, 0.0))
            classes[key] = (rep, count + 1, hidden + self.hidden.reductions.get(n, 0.0))
        for n, count, hidden in classes.values():
            node, strats, g = self.g.nodes[n], self.strats[n], group_of[n]
            for i, j in enumerate(self.groups.index_map[n]):
                comm_s = max(0.0, self._comm_s(strats[j]) * node.trip_count * count - hidden)
                self.cost[self.offset[g] + i] += (
                    strats[j].compute_s * node.trip_count * count + comm_s) * _US

    def _comm_s(self, st: Strategy) -> float:
        """A strategy's reductions without their latency, or a rewrite's exposed steps (with
        ``rings_in_full``, a collective matmul's steps in full, latency in)."""
        key = (id(st), self.rings_in_full)
        if key not in self._strategy_cache:
            if st.rewrite is None:
                comm_s = sum(self._step_s(step) for step in st.collectives)
            elif self.rings_in_full and st.rewrite.kind in RINGS:
                comm_s = sum(step.time_s(self.mesh.levels) for step in st.collectives)
            else:
                comm_s = st.comm_s  # its exposed communication, latency in
            self._strategy_cache[key] = comm_s
        return self._strategy_cache[key]

    def _step_s(self, step) -> float:
        if step not in self._step_cache:
            self._step_cache[step] = (step.time_s(self.mesh.levels) if step.kind is None else
                                      without_latency_s(step, self.mesh.levels))
        return self._step_cache[step]

    def add_group_latencies(self) -> None:
        """One latency per combiner group of reductions (``estimate.combiner_key``), as the
        estimate charges it: per key, a variable ``y`` at least the sum of each group's
        strategy variables whose node makes such a reduction, costing that latency once."""
        cost_of: dict[tuple, float] = {}
        for key, step, rows in self._latency_keys():
            latency_s = combined_latency_s(step, self.mesh.levels) * key[4]
            cost_of[rows] = (cost_of.get(rows, 0.0)
                             + max(0.0, latency_s - self.hidden.latencies.get(key, 0.0)) * _US)
        for rows, cost in cost_of.items():
            y = self.new_vars(1, False)
            self.latencies.append((y, sorted({x for _, xs in rows for x in xs})))
            self.cost[y] = cost
            # A group takes one strategy: y >= the sum of its variables that make the step.
            self.rows += [({y: 1.0, **{x: -1.0 for x in xs}}, 0.0, np.inf) for _, xs in rows]

    def _latency_keys(self) -> list[tuple]:
        """[(combiner key, a step of it, rows)], rows holding per group the variables whose
        node makes such a reduction. Keys of equal rows (the reductions of copies of a layer, at
        other depths) share one y carrying their latencies together: the ILP's size does not
        grow with depth."""
        if "latency_keys" not in self._memo:
            depths = reduction_depths(self.g)
            xs_of: dict[tuple, dict[int, set[int]]] = {}  # key -> group -> its variables
            steps: dict[tuple, object] = {}
            reducing: dict[int, list] = {}  # a strategy list (by id) -> its reductions
            for g, members in self.groups.members.items():
                for n in members:
                    made = _reductions(self.strats[n], reducing)
                    if not made:
                        continue
                    trips = self.g.nodes[n].trip_count
                    variables: dict[int, list[int]] = {}  # n's strategy -> the group's
                    for i, j in enumerate(self.groups.index_map[n].tolist()):
                        variables.setdefault(j, []).append(self.offset[g] + i)
                    for j, step in made:
                        if j in variables:
                            key = combiner_key(step, trips, depths[n])
                            steps.setdefault(key, step)
                            xs_of.setdefault(key, {}).setdefault(g, set()).update(variables[j])
            self._memo["latency_keys"] = [
                (key, steps[key], tuple(sorted((g, tuple(sorted(xs)))
                                               for g, xs in by_group.items())))
                for key, by_group in xs_of.items()]
        return self._memo["latency_keys"]

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

    def _cost_matrix_us(self, src_classes, dst_classes, value) -> np.ndarray:
        """[[:meth:`_cost_us` of (a, b) for b in dst_classes] for a in src_classes], for one
        trip; kept per classes and value shape (copies of a layer share one)."""
        key = (tuple(src_classes), tuple(dst_classes), value.shape, value.itemsize,
               value.recomputable)
        cache = self._memo.setdefault("cost matrices", {})
        if key not in cache:
            cache[key] = np.array([[self._cost_us(a, b, value, 1) for b in dst_classes]
                                   for a in src_classes])
        return cache[key]

    def edge_counts(self) -> tuple[int, int]:
        """(graph edges, edges priced: each class of values' distinct readers)."""
        return self._edge_counts

    def add_edges(self) -> None:
        """Resharding costs, one value at a time: a value moved into one spec for several
        consumers is charged once (XLA computes the move once), as the estimate charges it."""
        classes = self.value_classes()
        self._edge_counts = (sum(len(w.ins) - w.ins.count(None) for w in self.g.nodes),
                             sum(len(readers) for _, readers, _, _ in classes))
        for (u, k), readers, count, hidden in classes:
            if len(readers) == 1:
                self._add_edge(u, k, *readers[0], count, hidden[0])
            else:
                self._add_shared_value(u, k, readers, count, hidden)
        self._flush_transports()

    def value_classes(self):
        """[((u, k), [(w, pos)], count, [(hidden s, whole s)])]: one value per class of
        structurally identical values (copies of a layer share one), its readers with one per
        group and in-spec list (they choose alike), how many values the class holds, and per
        reader what the reference plan's timeline hides of the moves into it, summed over the
        class (``passes.estimate.Hidden.reshards``)."""
        out = []
        for uk, readers, members in self._value_structure():
            hidden = [[0.0, 0.0] for _ in readers]
            for vid, moves in members:
                for w, r in moves:
                    hidden[r][0] += self.hidden.reshards.get((w, vid), 0.0)
                    hidden[r][1] += self.hidden.reshard_totals.get((w, vid), 0.0)
            out.append((uk, readers, len(members), [tuple(h) for h in hidden]))
        return out

    def _value_structure(self) -> list[tuple]:
        """[((u, k), [(w, pos)], [(value, [(reader node, index into the readers)])])]: the
        classes of :meth:`value_classes`, with each member value's reader nodes (a move is
        keyed by its reader node)."""
        if "values" in self._memo:
            return self._memo["values"]
        group_of, color = self.groups.group_of, self.groups.color
        readers: dict[int, list] = {}
        for w_node in self.g.nodes:
            for pos, vid in enumerate(w_node.ins):
                if vid is not None:
                    readers.setdefault(vid, []).append((w_node.id, pos))
        out: dict = {}
        for vid, edges in readers.items():
            u, k = self.g.producer[vid]
            place = {(w, pos): (w, pos) if color is None else (group_of[w], color[w], pos)
                     for w, pos in edges}
            key = (u, k) if color is None else (
                group_of[u], color[u], k, tuple(sorted(place.values())))
            if key not in out:
                distinct: dict = {}
                reader_of = {}
                for w, pos in edges:
                    dst = tuple(self.strats[w][j].in_specs[pos]
                                for j in self.groups.index_map[w])
                    distinct.setdefault((group_of[w], dst), (w, pos))
                    reader_of[place[w, pos]] = list(distinct).index((group_of[w], dst))
                out[key] = ((u, k), list(distinct.values()), [], reader_of)
            first = {}
            for w, pos in edges:
                first.setdefault(w, pos)
            out[key][2].append((vid, [(w, out[key][3][place[w, pos]])
                                      for w, pos in first.items()]))
        self._memo["values"] = [(uk, rs, members) for uk, rs, members, _ in out.values()]
        return self._memo["values"]

    def _add_edge(self, u, k, w, pos, count: int = 1, hidden=(0.0, 0.0),
                  shared: bool = False) -> None:
        """The move of ``(u, k)`` into reader ``(w, pos)``, less what the reference plan's
        timeline hides of it (``hidden``: (hidden s, whole s), see :meth:`value_classes`).
        ``shared``: the value has other readers, so where the reference moved nothing for this
        one but its pair costs something, another reader's move served it, and a pair no
        dearer is free."""
        gu, gw, src, dst, value, trip = self._edge_matrix(u, k, w, pos)
        trip *= count
        hidden_us = hidden[0] * _US
        ref = self._reference_pair(u, k, w, pos)
        if shared and ref is not None and hidden[1] == 0.0:
            hidden_us = self._cost_us(*ref, value, trip)

        def cost(a, b):
            return max(0.0, self._cost_us(a, b, value, trip) - hidden_us)
        if gu == gw:
            for i, (a, b) in enumerate(zip(src, dst)):
                self.cost[self.offset[gu] + i] += cost(a, b)
            return
        if len(set(src)) * len(set(dst)) <= MAX_EXACT_EDGE_PAIRS:
            self._transport(gu, gw, src, dst, lambda src_classes, dst_classes:
                            self._cost_matrix_us(src_classes, dst_classes, value) * trip,
                            hidden_us=hidden_us)
            return
        # Too many spec pairs: price the move axis by axis (see the module docstring), scaled
        # so that the reference's pair costs what it costs jointly, less what is hidden.
        scale = 1.0
        if ref is not None:
            by_axes = sum(self._axis_cost_us(axis, ref[0].place_of(axis), ref[1].place_of(axis),
                                             value, trip) for axis in self.mesh.axis_names)
            if by_axes > 0:
                scale = cost(*ref) / by_axes
        for axis in self.mesh.axis_names:
            self._transport(
                gu, gw, [a.place_of(axis) for a in src], [b.place_of(axis) for b in dst],
                lambda src_places, dst_places, axis=axis: np.array(
                    [[self._axis_cost_us(axis, p, q, value, trip) for q in dst_places]
                     for p in src_places]), scale=scale)

    def _reference_pair(self, u, k, w, pos):
        """(u's out spec, w's in spec) in the reference plan (``Hidden.choice``), or None."""
        ref = self.hidden.choice
        if not ref:
            return None
        return self.strats[u][ref[u]].out_specs[k], self.strats[w][ref[w]].in_specs[pos]

    def _add_shared_value(self, u, k, readers, count: int, hidden) -> None:
        """Value ``(u, k)`` read by several groups: per (source spec, target spec) pair, a
        variable ``m >= `` each reader's indicator of that pair (:meth:`_pair_indicators`) pays
        the move once, less what the reference plan's timeline hides of the moves into those
        readers (``hidden``, per reader). Readers whose pairs are too many to list are priced
        alone, axis by axis."""
        pairs: dict = {}   # (src spec, dst spec) -> [(indicator, trip, hidden s)]
        for (w, pos), moved in zip(readers, hidden):
            indicators = self._pair_indicators(u, k, w, pos)
            if indicators is None:
                self._add_edge(u, k, w, pos, count, moved, shared=True)
                continue
            trip = self.g.nodes[w].edge_trip(pos)
            for pair, indicator in indicators.items():
                pairs.setdefault(pair, []).append((indicator, trip, moved[0]))
        value = self.g.values[self.g.nodes[u].outs[k]]
        credits = self._kept_credits(readers)
        for (a, b), uses in pairs.items():
            whole = self._cost_us(a, b, value, uses[0][1] * count)
            if whole == 0.0:   # not on what is hidden: see _transport
                continue
            cost = max(0.0, whole - sum(h for _, _, h in uses) * _US)
            credit = credits.get(b, {})
            if len(uses) == 1 and not credit:
                for var, coef in uses[0][0].items():
                    self.cost[var] += cost * coef
                continue
            m = self.new_vars(1, False)
            self.cost[m] = cost
            self.shared.append((m, [indicator for indicator, _, _ in uses], credit))
            for indicator, _, _ in uses:
                row = {m: 1.0, **credit}
                for var, coef in indicator.items():
                    row[var] = row.get(var, 0.0) - coef
                self.rows.append((row, 0.0, np.inf))

    def _kept_credits(self, readers) -> dict:
        """Target spec -> the variables (as a linear expression) of the readers' strategies
        whose rewrite returns the value moved to that spec (``Rewrite.keeps``): taken, they
        pay that move for the value's other readers."""
        out: dict = {}
        for w, pos in readers:
            keeps = self._keeps(w)
            if not keeps:
                continue
            base = self.offset[self.groups.group_of[w]]
            for i, j in enumerate(self.groups.index_map[w]):
                for p, spec in keeps.get(int(j), ()):
                    if p == pos:
                        out.setdefault(spec, {})[base + i] = 1.0
        return out

    def _keeps(self, w) -> dict[int, tuple]:
        """Strategy index -> its rewrite's ``keeps``, for node ``w``'s strategies that keep
        something; memoized by strategy list (the copies of a layer share one)."""
        memo = self._memo.setdefault("keeps", {})
        own = self.strats[w]
        if id(own) not in memo:
            memo[id(own)] = {j: s.rewrite.keeps for j, s in enumerate(own)
                             if s.rewrite is not None and s.rewrite.keeps}
        return memo[id(own)]

    def _pair_indicators(self, u, k, w, pos) -> dict | None:
        """(u's out spec, w's in spec) -> a linear expression of the ILP's variables that is 1
        when the two groups' choices make that pair, else 0; None when the pairs are too many
        to list (:data:`MAX_SHARED_VALUE_PAIRS`)."""
        gu, gw, src, dst, _, _ = self._edge_matrix(u, k, w, pos)
        out: dict = {}
        if gu == gw:
            for i, pair in enumerate(zip(src, dst)):
                out.setdefault(pair, {})[self.offset[gu] + i] = 1.0
            return out
        src_classes, dst_classes = list(dict.fromkeys(src)), list(dict.fromkeys(dst))
        if len(src_classes) == 1:  # the pair follows w's choice alone
            for j, b in enumerate(dst):
                out.setdefault((src[0], b), {})[self.offset[gw] + j] = 1.0
            return out
        if len(dst_classes) == 1:  # ... or u's alone
            for i, a in enumerate(src):
                out.setdefault((a, dst[0]), {})[self.offset[gu] + i] = 1.0
            return out
        if len(src_classes) * len(dst_classes) > MAX_SHARED_VALUE_PAIRS:
            return None
        key = (gu, gw, tuple(src), tuple(dst))
        if key not in self._indicator_blocks:
            P, Q = len(src_classes), len(dst_classes)
            self._add_transport(gu, gw, src, dst, src_classes, dst_classes, np.zeros((P, Q)))
            self._indicator_blocks[key] = self.transports[-1][0]
        e0, Q = self._indicator_blocks[key], len(dst_classes)
        return {(a, b): {e0 + p * Q + q: 1.0} for p, a in enumerate(src_classes)
                for q, b in enumerate(dst_classes)}

    def _axis_cost_us(self, axis, p, q, value, trip) -> float:
        key = (axis, p, q, value.shape, value.itemsize, value.recomputable)
        if key not in self._edge_cache:
            self._edge_cache[key] = self.mesh.axis_reshard_time_s(axis, p, q, value) * _US
        return self._edge_cache[key] * trip

    def _transport(self, gu, gw, src_keys, dst_keys, matrix, scale: float = 1.0,
                   hidden_us: float = 0.0) -> None:
        """Add sum_p,q e[p,q] * R[p, q] where e is the one pair of classes (src_keys of
        group gu's choice, dst_keys of group gw's choice) the two choices fall in, and R is
        ``matrix(src classes, dst classes)`` times ``scale``, less ``hidden_us`` (at least
        0). Edges with the same groups and keys (copies of a layer boundary, a value read
        twice) add their costs into one e (:meth:`_flush_transports`). Whether e is made
        depends on ``matrix`` alone, not on what a reference plan hides (nor does any other
        variable or row), so the ILP around a reference has the constraints of the ILP
        without one, and its LP starts from that one's basis (``passes.highs``)."""
        src_classes = list(dict.fromkeys(src_keys))
        dst_classes = list(dict.fromkeys(dst_keys))
        whole = matrix(src_classes, dst_classes)
        if not whole.any():
            return
        R = np.maximum(0.0, whole * scale - hidden_us) if scale != 1.0 or hidden_us else whole
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
        for m, indicators, credit in self.shared:
            x[m] = max(0.0, max(sum(x[var] * coef for var, coef in ind.items())
                                for ind in indicators)
                       - sum(x[var] * coef for var, coef in credit.items()))
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


def _reductions(strats: list[Strategy], memo: dict[int, list]) -> list[tuple[int, object]]:
    """(strategy index, step) of each reduction XLA's combiner may merge (a collective of a
    kind, not in a rewrite) of a strategy list; ``memo``: by the list's id (the copies of a
    layer share one)."""
    if id(strats) not in memo:
        memo[id(strats)] = [(j, step) for j, s in enumerate(strats) if s.rewrite is None
                            for step in s.collectives if step.kind is not None]
    return memo[id(strats)]


def choice_of(x, graph: Graph, groups: Groups, offset: dict[int, int]) -> list[int]:
    """The plan (a strategy index per node) of the ILP's solution ``x``."""
    choice = [0] * len(graph.nodes)
    for g, members in groups.members.items():
        i = int(np.argmax(x[offset[g]:offset[g] + groups.sizes[g]]))
        for n in members:
            choice[n] = int(groups.index_map[n][i])
    return choice
