"""Conflict diagnosis: where two annotations meet at a node no strategy can serve as both want.

Priority: a user annotation is fixed before propagation starts and a propagated sharding never
replaces a fixed one, so the user wins. Where two annotations meet at a node that no strategy
can serve as both want, the value is resharded there (as XLA would, in complete mode; the
ILP's choice otherwise) and a :class:`~autopar.errors.ShardingConflictWarning` names both.
"""

from __future__ import annotations

from autopar.cost_model.spec import Spec, pspec_text
from autopar.passes.fixed import (
    Propagation,
    compatible,
    node_operands,
)
from autopar.passes.ir import Graph, NodeKind
from autopar.passes.rules import op_info


def find_conflicts(graph: Graph, strats, prop: Propagation, labels: dict[int, str]
                   ) -> list[str]:
    """Same-tensor nodes where a user annotation and another annotation (or a sharding
    propagated from one) admit no common strategy; one warning per pair of annotations. Two
    propagated shardings meeting, or two annotations one of which refines the other
    (:func:`nested`), is ordinary resharding, left to the plan without a word."""
    seen, messages = set(), []
    annotated = {o.label: prop.specs[v] for v, o in prop.origins.items() if o.user}
    for node in graph.nodes:
        if not op_info(node).same_tensor:
            continue
        wants = {}  # label -> (user, spec) of the fixed values at this node
        for vid in [v for _, v in node_operands(node)] + list(node.outs):
            if vid in prop.specs:
                origin = prop.origins[vid]
                wants.setdefault(origin.label, (origin.user, prop.specs[vid]))
        if node.kind is NodeKind.OUTPUT and node.pinned is not None and node.id in labels:
            wants.setdefault(labels[node.id], (True, node.pinned[0]))
        users = [lab for lab, (user, _) in wants.items() if user]
        if len(wants) < 2 or not users or compatible(node, strats[node.id], prop.specs):
            continue
        pair = [users[0], next(lab for lab in wants if lab != users[0])]
        if tuple(sorted(pair)) in seen or nested(*(annotated.get(lab, wants[lab][1])
                                                     for lab in pair)):
            continue
        seen.add(tuple(sorted(pair)))
        said = "; ".join(f"{lab} wants {_shown(wants[lab][1])}"
                         f"{'' if wants[lab][0] else ' (propagated)'}" for lab in pair)
        where = node.where or "the program boundary"
        messages.append(
            f"autopar: sharding annotations conflict at `{node.prim}`"
            f"{'' if where == node.prim else f' ({where})'}: {said}. A user annotation wins over a "
            "propagated one; the value is resharded where they meet. Make the two annotations "
            "agree to avoid the resharding.")
    return messages


def _shown(spec) -> str:
    """A spec as the user writes it (``P('data', None)``); a partial one as it is."""
    return pspec_text(spec.to_partition_spec()) if isinstance(spec, Spec) else str(spec)


def nested(a: Spec, b: Spec) -> bool:
    """Whether one spec refines the other: one replicates everything, or on every dim the
    coarser one's axes begin the finer one's (ZeRO's optimizer state split beyond its
    parameter). The finer is a local slice of the coarser, which a gather undoes: ordinary
    resharding, not two annotations at odds."""
    if not (isinstance(a, Spec) and isinstance(b, Spec)):   # forced mode's partial Splits
        return False
    if not a.axes or not b.axes:
        return True
    if a.rank != b.rank:
        return False
    pairs = list(zip(a.dims, b.dims))
    return (all(y[:len(x)] == x for x, y in pairs)
            or all(x[:len(y)] == y for x, y in pairs))
