"""Which ops reduce partial results, and how deep each node sits under later reductions."""

from __future__ import annotations

from autopar.passes.ir import Graph, Node, NodeKind
from autopar.passes.rules import op_info


def is_combined_reduction(node: Node, graph: Graph) -> bool:
    """Whether XLA's all-reduce combiner merges ``node``'s reductions with the program's other
    last ones, so each pays no latency of its own (one per group: the estimate's groups,
    ``IlpBuilder.add_group_latencies`` in the ILP): a reduction that no reduction to a
    non-scalar reads, directly or through other ops (depth 0 in :func:`reduction_depths`):
    a parameter's gradient (only the optimizer's elementwise update reads it, and a global
    norm's sum of squares, a reduction to a scalar), a loss or a metric. The compiled
    data-parallel MLP step sends its gradients and its loss in one all-reduce, the ResNet's
    its loss (4 bytes) in its last gradient all-reduce (6916 bytes). Reductions of
    activations (forward, or their gradients in backward) are waited on by the next layer's
    contraction and compile to all-reduces of their own (the estimate merges those of equal
    depth, ``cost_model.estimate``).

    This replaced a test by size (a reduction with as many elements as an argument), which
    took the MLP's activations, as large as its input batch, for gradients: four activation
    all-reduces priced as one latency, compiled to four."""
    return op_info(node).reducing and reduction_depths(graph)[node.id] == 0


def reduction_depths(graph: Graph) -> list[int]:
    """Per node, the most reductions to a non-scalar on a path from its results (0: none
    waits for it). Reductions of equal depth do not wait for one another: XLA's combiner can
    merge them (a batch norm's mean and mean of squares). Computed once per graph."""
    if "reductions.reduction_depths" not in graph.analyses:
        consumers, depth = graph.consumers(), [0] * len(graph.nodes)
        # Readers come after the nodes they read, except a loop's carry, which reads the
        # body's result back: that edge adds nothing (the loop's result, read after the loop,
        # carries the depth instead).
        for node in reversed(graph.nodes):
            for v in node.outs:
                for r, _ in consumers.get(v, ()):
                    depth[node.id] = max(depth[node.id],
                                         depth[r] + _waits(graph.nodes[r], graph))
        graph.analyses["reductions.reduction_depths"] = depth
    return graph.analyses["reductions.reduction_depths"]


def _waits(reader: Node, graph: Graph) -> bool:
    """Whether ``reader``'s reduction waits for the partial sums it reads to be reduced: a
    reduction to a non-scalar over a dim longer than 1. A scatter does not: it adds what it
    reads into rows, so a partial sum it reads is summed in the same all-reduce as its own
    (an embedding's gradient)."""
    info = op_info(reader) if reader.kind is NodeKind.OP else None
    if info is None or not info.reducing or info.gather_scatter:
        return False
    if not any(graph.values[o].rank for o in reader.outs):
        return False
    axes = reader.params.get("axes")
    shape = graph.values[reader.ins[0]].shape
    return axes is None or any(shape[a] > 1 for a in axes)
