"""Per-device memory from liveness over the planned graph.

Three kinds of buffers make up a device's memory during one call:

* **arguments**, live for the whole call (a donated argument's buffer is reused for the
  result that replaces it, so it is counted once);
* **results**;
* **temporaries**: every other value XLA materializes, live from the node that makes it to
  its last use.

XLA fuses elementwise chains: a value made by an elementwise (or broadcast/reshape-like) op
whose every consumer is also such an op never reaches memory, and neither do iotas and
broadcasts of scalars. Dots, reductions, gathers, collectives and the like are materialized.

How results are held depends on the backend. XLA:CPU allocates the arguments, the results and
one temp arena for the whole call, so its footprint is arguments + results + the peak of live
temporaries (``results_held=True``; the planner sets it when the mesh is on CPU, as it does for
the other XLA:CPU differences). On GPU and TPU a result's buffer is live from when it is made,
so the peak is the largest sum of live buffers at any node. Loop bodies count once, as XLA
keeps one iteration live.

Checked against ``compiled.memory_analysis()`` (see ``cost_model.hlo.compiled_peak_bytes``) on
the tests' GPT, BERT, MoE and MLP train steps at realistic shapes on 1-D and 2-D meshes: within
10% (tests/cost_model/test_estimate.py).
"""

from __future__ import annotations

from passes.ir import Graph, NodeKind, recomputable
from passes.rules.elementwise import UNARY_AND_NARY
from passes.spec import local_bytes

#: Ops XLA fuses into their consumers when those are fusible too.
FUSIBLE = frozenset(UNARY_AND_NARY) | {
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "iota"}


def value_bytes(graph: Graph, vid: int, spec, axis_sizes) -> int:
    v = graph.values[vid]
    return local_bytes(spec, v.shape, v.itemsize, axis_sizes)


def _consumers(graph: Graph) -> dict[int, list]:
    users: dict[int, list] = {}
    for node in graph.nodes:
        for vid in node.ins:
            if vid is not None:
                users.setdefault(vid, []).append(node)
    return users


def _materialized(graph: Graph, node, users: dict[int, list]) -> list[int]:
    """The values of ``node`` that XLA keeps in memory."""
    if node.prim == "iota" or recomputable(graph, node):  # fused into the consumers
        return []
    if node.kind is NodeKind.OP and node.prim in FUSIBLE:
        return [vid for vid in node.outs
                if not all(u.kind is NodeKind.OP and u.prim in FUSIBLE
                           for u in users.get(vid, ()))]
    return list(node.outs)


def peak_memory_bytes(graph: Graph, value_specs: dict, axis_sizes, donated=frozenset(),
                      results_held: bool = False, operand_specs: dict | None = None) -> int:
    """Per-device peak bytes of the planned graph (see the module docstring).

    ``donated``: input node ids whose buffers the results may reuse. ``results_held``: the
    backend holds result buffers for the whole call (XLA:CPU). ``operand_specs``: node id ->
    the specs its operands are resharded to; a resharded copy is a temporary live while the
    node runs.
    """
    held, live = memory_timeline(graph, value_specs, axis_sizes, donated, results_held,
                                 operand_specs)
    return held + max(live, default=0)


def memory_timeline(graph: Graph, value_specs: dict, axis_sizes, donated=frozenset(),
                    results_held: bool = False, operand_specs: dict | None = None
                    ) -> tuple[int, list[int]]:
    """(bytes held for the whole call, bytes of the other live buffers at each node)."""
    users = _consumers(graph)
    results = {graph.nodes[n].ins[0] for n in graph.output_nodes
               if graph.nodes[n].ins and graph.nodes[n].ins[0] is not None}
    last_use = {vid: max(u.id for u in us) for vid, us in users.items()}

    def size(vid):
        return value_bytes(graph, vid, value_specs[vid], axis_sizes)

    inputs = [(n, v) for n in graph.input_nodes for v in graph.nodes[n].outs]
    kept_args = sum(size(v) for n, v in inputs if n not in donated)
    donated_args = sum(size(v) for n, v in inputs if n in donated)
    if results_held:
        held = kept_args + max(sum(size(v) for v in results), donated_args)
    else:
        held = kept_args + donated_args
    end = len(graph.nodes)
    live = 0
    timeline = []
    frees: dict[int, int] = {}
    for node in graph.nodes:
        if node.kind is not NodeKind.INPUT:
            for vid in _materialized(graph, node, users):
                if results_held and vid in results:
                    continue
                b = size(vid)
                live += b
                die = end if vid in results else last_use.get(vid, node.id)
                frees[die] = frees.get(die, 0) + b
        timeline.append(live + _resharded_copies_bytes(graph, node, value_specs, operand_specs,
                                                       axis_sizes))
        live -= frees.pop(node.id, 0)
    return held, timeline


def _resharded_copies_bytes(graph: Graph, node, value_specs, operand_specs, axis_sizes) -> int:
    if not operand_specs or node.id not in operand_specs:
        return 0
    total = 0
    for vid, spec in zip(node.ins, operand_specs[node.id]):
        if vid is not None and spec is not None and spec != value_specs[vid]:
            total += value_bytes(graph, vid, spec, axis_sizes)
    return total
