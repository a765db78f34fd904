"""FSDP weight prefetch as strategies of a scan's scanned inputs.

A scanned input (a stacked layer weight, say) split over an axis X in each iteration's slice is
gathered inside the scan body where the body wants it whole over X: on the edge into the body,
once per iteration, exposed. A prefetch strategy of the ``scan_in`` node instead hands the
body the slice already gathered over X: the emitted scan (``passes.emit``'s ``emit_scan``)
gathers iteration ``i + 1``'s slice during iteration ``i`` and carries it. Priced by
``cost_model.overlap.prefetched``: the first gather is exposed, each later one only for what
the iteration's compute does not hide; the iteration's compute is taken at its cheapest
(each body node's fastest strategy), so the hiding is not overestimated.
"""

from __future__ import annotations

from autopar.cost_model import overlap
from autopar.cost_model.hlo import CollectiveKind
from autopar.cost_model.spec import Spec
from autopar.passes.ir import Graph
from autopar.passes.overlap.collective_matmul import _FORCED as FORCED
from autopar.passes.strategies import MeshContext, Rewrite, RewriteKind, Strategy


def with_prefetch(graph: Graph, strats: list[list[Strategy]], mesh: MeshContext
                  ) -> list[list[Strategy]]:
    """``strats`` with each scanned input's prefetch strategies added after its own."""
    if not mesh.profile.async_collectives:
        return strats
    out = list(strats)
    for path, nodes in graph.region_nodes.items():
        if not nodes.get("scan_in"):
            continue
        body_s = _body_compute_s(graph, strats, path)
        for n in nodes["scan_in"]:
            node = graph.nodes[n]
            if node.pinned is None:
                extra = _prefetches(graph, node, strats[n], mesh, body_s)
                out[n] = extra if FORCED[0] and extra else strats[n] + extra
    return out


def _body_compute_s(graph: Graph, strats, path: tuple) -> float:
    """The scan body's compute over all its iterations, each node at its fastest strategy,
    per execution of the scan (nodes inside count their own trips)."""
    depth = len(path)
    total = 0.0
    outer = None
    for eqn_path, n in graph.eqn_nodes.items():
        if len(eqn_path) > depth and eqn_path[:depth] == path:
            total += min(s.compute_s for s in strats[n]) * graph.nodes[n].trip_count
    for n in graph.region_nodes[path]["scan_in"]:
        outer = graph.nodes[n].trip_count
    return total / (outer or 1)


def _prefetches(graph: Graph, node, base: list[Strategy], mesh: MeshContext, body_s: float
                ) -> list[Strategy]:
    value = graph.values[node.outs[0]]
    layers = node.in_avals[0][0][0]
    out, seen = [], set()
    for s in base:
        sliced = s.out_specs[0]
        for axis in sliced.axes:
            gathered = Spec(tuple(tuple(a for a in dims if a != axis) for dims in sliced.dims))
            steps = mesh.reshard(sliced, gathered, value)
            kinds = {step.kind for step in steps}
            if (s.in_specs[0], gathered) in seen or CollectiveKind.ALL_GATHER not in kinds \
                    or not kinds <= {None, CollectiveKind.ALL_GATHER}:
                continue
            seen.add((s.in_specs[0], gathered))
            priced = overlap.prefetched(body_s / layers, steps, layers, mesh.levels)
            out.append(Strategy(s.in_specs, (gathered,), 0.0, 0.0,
                                0.0 if FORCED[0] else priced.exposed_s,
                                tuple(st for st in priced.steps if st.kind is not None),
                                rewrite=Rewrite(RewriteKind.PREFETCH, (axis,))))
    return out
