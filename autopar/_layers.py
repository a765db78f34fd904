"""The plan seen layer by layer, for the report: parameters, time and memory per layer.

A layer is a top-level module of the parameters (``block_0``, ``embed``, nnx ``layers[3]``,
...), named by ``passes.remat.layer_of_path`` as rematerialization names it. An operation
belongs to the layer whose name appears first in its source path (``transpose(jvp(GPT))/block_0/mlp_in`` -> ``block_0``);
operations outside every layer (the loss, the optimizer's global steps) are ``other``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import jax

from autopar.passes.estimate import plan_timeline, value_specs
from autopar.passes.liveness import value_bytes
from autopar.passes.remat import layer_of_path
from autopar.passes.sequence_parallel import attention_label

OTHER = "other"


@dataclass
class LayerRow:
    """One layer's share of the plan, per device."""
    name: str
    state_bytes: int = 0          # its parameters and optimizer state
    compute_s: float = 0.0
    comm_s: float = 0.0
    comm_bytes: float = 0.0
    collectives: int = 0
    params: list[tuple[str, object]] = field(default_factory=list)  # (path, PartitionSpec)
    attention: list[str] = field(default_factory=list)  # its attention nodes' strategies


def _past_arg_index(path: str) -> str:
    """``[1][0].mu['block_0']`` -> ``[0].mu['block_0']``: the path inside one argument."""
    return path[path.index("]") + 1:] if path.startswith("[") else path


def _layer_of_node(where: str, names: set[str]) -> str:
    for part in re.split(r"[/()]", where or ""):
        if part in names:
            return part
    return OTHER


def layer_rows(plan) -> list[LayerRow]:
    """Rows in order of first appearance among the parameters, ``other`` last."""
    graph, strats, choice, comms = plan._details
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape))
    specs = value_specs(graph, strats, choice)
    rows: dict[str, LayerRow] = {}
    shardings = jax.tree_util.tree_leaves(plan.in_shardings)
    children = plan._in_tree.children()
    n_params = children[0].num_leaves if len(children) > 1 else 0
    leaves = list(zip(plan.in_paths, graph.input_nodes, shardings))
    for path, _, sharding in leaves[:n_params]:  # the first argument: the parameters
        name = layer_of_path(_past_arg_index(path))
        if name is not None:
            rows.setdefault(name, LayerRow(name)).params.append((path, sharding.spec))
    for path, node_id, _ in leaves:  # parameters and their optimizer state
        row = rows.get(layer_of_path(_past_arg_index(path)))
        if row is not None:
            vid = graph.nodes[node_id].outs[0]
            row.state_bytes += value_bytes(graph, vid, specs[vid], sizes)
    other = LayerRow(OTHER)
    names = set(rows)

    def row_of(node) -> LayerRow:
        return rows.get(_layer_of_node(node.where, names), other)

    for node in graph.nodes:
        row_of(node).compute_s += strats[node.id][choice[node.id]].compute_s * node.trip_count
        label = attention_label(node, strats[node.id][choice[node.id]])
        if label is not None:
            row_of(node).attention.append(label)
    for c in comms:
        if c.step.wire_bytes:
            row = row_of(graph.nodes[c.node])
            row.comm_s += c.time_s * c.trips
            row.comm_bytes += c.step.wire_bytes * c.trips
            row.collectives += c.trips
    return list(rows.values()) + [other]


def memory_over_program(plan) -> tuple[int, tuple[int, ...]]:
    """(bytes held for the whole call, other live bytes at each node), per device."""
    graph, strats, choice, _ = plan._details
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape))
    on_cpu = plan.mesh.devices.flat[0].platform == "cpu"
    donated = frozenset(graph.input_nodes[i]
                        for i in flat_donation(plan._in_tree, plan.donate_argnums))
    return plan_timeline(graph, strats, choice, sizes, on_cpu, donated)


def flat_donation(in_tree, donate_argnums) -> tuple[int, ...]:
    """The flat argument leaves that ``donate_argnums`` (as in ``jax.jit``) donates."""
    if not donate_argnums:
        return ()
    if isinstance(donate_argnums, int):
        donate_argnums = (donate_argnums,)
    counts = [c.num_leaves for c in in_tree.children()]
    out, start = [], 0
    for i, c in enumerate(counts):
        if i in donate_argnums:
            out += range(start, start + c)
        start += c
    return tuple(out)
