"""Per-device memory from liveness over the planned graph.

Three kinds of buffers make up a device's memory during one call:

* **arguments**, live for the whole call (a donated argument's buffer is reused for the
  result that replaces it, so it is counted once);
* **results**, in the specs the program returns them in: a result made in that spec is
  written straight into its output buffer; one resharded on its way out is a temporary, and
  its resharded copy is the output;
* **temporaries**: every other value XLA materializes, live from the node that makes it to
  its last use, plus an operand's resharded copy from the first node that wants it in that
  spec to the last (XLA makes it once).

XLA fuses elementwise chains: a value made by an elementwise (or broadcast/reshape-like) op
whose every consumer is also such an op never reaches memory, and neither do iotas and
broadcasts of scalars. Dots, reductions, gathers, scatters, collectives and the like are
materialized.

How results are held depends on the backend. On GPU and TPU a result's buffer is live from
when it is made, so the peak is the largest sum of live buffers at any node. XLA:CPU allocates
the arguments, the results and one temp arena for the whole call (``results_held=True``; the
planner sets it when the mesh is on CPU, as it does for XLA:CPU's other differences), so its
footprint is arguments + results + the peak of live temporaries. Loop bodies count once, as
XLA keeps one iteration live.

What XLA:CPU's numbers hold (jax 0.10.2, read from its buffer assignment): its
``memory_analysis().peak_memory_in_bytes`` is arguments + outputs only, so the compiled peak
is taken as arguments + outputs - aliased + the temp arena (``cost_model.hlo.
compiled_peak_bytes``). Arguments and outputs match this model exactly (the output size also
holds the result tuple's 8-byte pointers). Two things XLA:CPU does are not modelled, and they
pull in opposite directions:

* it computes 16-bit float dots in float32, so f32 copies of bf16 operands and f32 dot results
  sit in the temp arena beside the bf16 values (on the (2, 4) MoE step: f32 logits
  ``[4, 512, 8192]`` and f32 expert activations), which GPU and TPU do not make: the model
  counts fewer temporaries than XLA:CPU keeps;
* its buffer assignment places temporaries in output buffers before their results are
  written, so not every live temporary adds to the footprint: the model counts more.

Donated outputs are argument buffers, which hold their argument until it is last read, so they
cannot take temporaries: on the (2, 4) GPT step, donating params and optimizer state makes
XLA:CPU alias all 278 MiB of outputs, as the model does, but its temp arena grows from 554 to
810 MiB, so its footprint drops by 2%, not by the 25% the model predicts: the model's 524 MiB
of temporaries fall well short of what XLA:CPU keeps once it cannot borrow output buffers.
On GPU and TPU a donated buffer's saving is real, and the model takes it.

Without donation, checked against the compiled programs of the tests' GPT, BERT, MoE and MLP
train steps at realistic shapes on 1-D and 2-D meshes, the prediction is within 10% (from 9%
under on the (2, 4) MoE step to 9% over on the MLP, whose temporaries all fit in its output
buffers; tests/cost_model/test_estimate.py bounds it at 15%).
"""

from __future__ import annotations

from passes.ir import Graph, NodeKind, recomputable
from passes.rules.elementwise import UNARY_AND_NARY
from passes.spec import local_bytes

#: Ops XLA fuses into their consumers when those are fusible too.
FUSIBLE = frozenset(UNARY_AND_NARY) | {
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "iota"}
#: Ops whose result is their operand's buffer (an optimization barrier, one node per operand):
#: no new buffer, but the operand's lives until the result's last use.
ALIASING = frozenset({"optimization_barrier"})


def value_bytes(graph: Graph, vid: int, spec, axis_sizes) -> int:
    v = graph.values[vid]
    return local_bytes(spec, v.shape, v.itemsize, axis_sizes)


def consumers(graph: Graph) -> dict[int, list]:
    users: dict[int, list] = {}
    for node in graph.nodes:
        for vid in node.ins:
            if vid is not None:
                users.setdefault(vid, []).append(node)
    return users


def last_uses(graph: Graph, users: dict[int, list]) -> dict[int, int]:
    """value -> the last node that reads it or, through :data:`ALIASING` ops, its buffer."""
    last = {vid: max(u.id for u in us) for vid, us in users.items()}
    for node in reversed(graph.nodes):
        if node.prim in ALIASING:
            for vin, vout in zip(node.ins, node.outs):
                last[vin] = max(last.get(vin, node.id), last.get(vout, node.id))
    return last


def materialized(graph: Graph, node, users: dict[int, list]) -> list[int]:
    """The values of ``node`` that XLA keeps in memory."""
    if node.prim == "iota" or node.prim in ALIASING or recomputable(graph, node):
        return []  # fused into the consumers, or an operand's buffer
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


def _results(graph: Graph, value_specs: dict, operand_specs: dict | None) -> list:
    """(output node, value, spec it is returned in) per result: the output node's operand spec
    when the plan reshards the value on its way out, else the value's own spec."""
    out = []
    for n in graph.output_nodes:
        vid = graph.nodes[n].ins[0] if graph.nodes[n].ins else None
        if vid is not None:
            specs = operand_specs.get(n) if operand_specs else None
            spec = specs[0] if specs and specs[0] is not None else value_specs[vid]
            out.append((n, vid, spec))
    return out


def argument_and_result_bytes(graph: Graph, value_specs: dict, axis_sizes,
                              operand_specs: dict | None = None) -> tuple[int, int]:
    """Per-device bytes of the arguments and of the results, in the specs the program takes
    and returns them in (``memory_analysis()``'s argument and output sizes)."""
    args = sum(value_bytes(graph, v, value_specs[v], axis_sizes)
               for n in graph.input_nodes for v in graph.nodes[n].outs)
    results = sum(value_bytes(graph, v, spec, axis_sizes)
                  for _, v, spec in _results(graph, value_specs, operand_specs))
    return args, results


def memory_timeline(graph: Graph, value_specs: dict, axis_sizes, donated=frozenset(),
                    results_held: bool = False, operand_specs: dict | None = None
                    ) -> tuple[int, list[int]]:
    """(bytes held for the whole call, bytes of the other live buffers at each node)."""
    users = consumers(graph)
    last_use = last_uses(graph, users)

    def size(vid, spec=None):
        return value_bytes(graph, vid, value_specs[vid] if spec is None else spec, axis_sizes)

    results = _results(graph, value_specs, operand_specs)
    # A result returned in the spec it is made in is written straight into its output buffer;
    # one resharded on the way out is a temporary, and the resharded copy is the output.
    in_place = {vid for _, vid, spec in results if spec == value_specs[vid]}
    copies_out = {n: size(vid, spec) for n, vid, spec in results if spec != value_specs[vid]}
    inputs = [(n, v) for n in graph.input_nodes for v in graph.nodes[n].outs]
    kept_args = sum(size(v) for n, v in inputs if n not in donated)
    donated_args = sum(size(v) for n, v in inputs if n in donated)
    if results_held:
        held = kept_args + max(sum(size(v, spec) for _, v, spec in results), donated_args)
    else:
        held = kept_args + donated_args
    end = len(graph.nodes)
    live = 0
    timeline = []
    frees: dict[int, int] = {}
    for node in graph.nodes:
        if node.kind is NodeKind.OUTPUT:
            if not results_held:  # the resharded copy is live from here to the end
                live += copies_out.get(node.id, 0)
        elif node.kind is not NodeKind.INPUT:
            for vid in materialized(graph, node, users):
                if results_held and vid in in_place:
                    continue
                b = size(vid)
                live += b
                die = end if vid in in_place else last_use.get(vid, node.id)
                frees[die] = frees.get(die, 0) + b
        timeline.append(live)
        live -= frees.pop(node.id, 0)
    copies = resharded_copies_bytes(graph, value_specs, operand_specs, axis_sizes)
    return held, [t + c for t, c in zip(timeline, copies)]


def resharded_copies_bytes(graph: Graph, value_specs: dict, operand_specs: dict | None,
                           axis_sizes) -> list[int]:
    """Per node, the bytes of operand copies resharded for the nodes that want them and live
    there. XLA makes one copy per (value, spec) and keeps it from its first reader to its last
    (the all-gather of a sharded weight in the forward pass serves the backward pass too); a
    broadcast of a scalar is rebuilt at each reader instead. A result's copy is its output
    buffer, counted with the results."""
    delta = [0] * (len(graph.nodes) + 1)
    if not operand_specs:
        return delta[:-1]
    spans: dict = {}  # (value, spec) -> [first reader, last reader, bytes]
    for node in graph.nodes:
        if node.kind is NodeKind.OUTPUT or node.id not in operand_specs:
            continue
        for vid, spec in zip(node.ins, operand_specs[node.id]):
            if vid is None or spec is None or spec == value_specs[vid]:
                continue
            key = (vid, spec) if not graph.values[vid].recomputable else (vid, spec, node.id)
            span = spans.setdefault(key, [node.id, node.id, 0])
            span[1] = node.id
            span[2] = value_bytes(graph, vid, spec, axis_sizes)
    for first, last, nbytes in spans.values():
        delta[first] += nbytes
        delta[last + 1] -= nbytes
    out, running = [], 0
    for d in delta[:-1]:
        running += d
        out.append(running)
    return out

