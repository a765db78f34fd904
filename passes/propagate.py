"""Pass 3, propagate: GSPMD-style propagation of fixed shardings through the rule registry.

This module holds the pass entry (:func:`propagate`) and forced mode; the fixed shardings
are ``passes.fixed``, complete mode ``passes.gspmd``.

A value is *fixed* when an annotation names its sharding: an ``in_shardings`` /
``out_shardings`` hint, a ``with_sharding_constraint`` in the program, or flax partitioning
metadata (all made node pins by ``passes.annotate``). Propagation walks the graph forward (a
node's free results from its fixed operands) and backward (a node's free operands from its
fixed results), sweep after sweep until nothing changes, as XLA's sharding propagation does. It
asks each node's own strategy list, the one the ILP chooses from (``passes.strategies`` over the
rule registry), so there is one set of rules: a strategy is *compatible* with a node's fixed
values when it keeps every one of them as it is, with no resharding. State outputs tied to the
input they replace carry its sharding both ways.

Two modes:

* ``complete`` (``search=False``, plain GSPMD): predicts what XLA's own propagation makes of the
  annotations, and gives the whole plan (``passes.gspmd``).
* ``forced`` (``search=True``): only what every compatible strategy of a neighbour agrees on
  is fixed, only as *splits* (mesh axis a splits dim d), and only along one tensor (through
  elementwise ops, converts, layout changes, constraints and region boundaries, from a
  full-size value): an elementwise chain after a batch hinted over ``data`` gets "``data``
  splits dim 0", while the other axes stay free, as GSPMD refines a partially replicated
  sharding rather than keeping it replicated. Each value so fixed is
  pinned for the ILP by cutting its producer's strategies to those that keep the splits (the
  cut ``build_strategies`` applies to a hint); the ILP decides the rest.

Priority: a user annotation is fixed before propagation starts and a propagated sharding never
replaces a fixed one, so the user wins. Where two annotations meet at a node that no strategy
can serve as both want, the value is resharded there (as XLA would, in complete mode; the
ILP's choice otherwise) and a :class:`~autopar.errors.ShardingConflictWarning` names both
(``passes.conflicts``).
"""

from __future__ import annotations


from autopar.errors import ShardingConflictWarning
from autopar.errors import warn as warn_user
from autopar.cost_model.spec import Spec
from autopar.passes.conflicts import find_conflicts
from autopar.passes.fixed import (
    Propagation,
    Splits,
    admits,
    compatible,
    node_operands,
    origin_of,
    seed,
    spec_of,
    splits_of,
)
from autopar.passes.gspmd import complete_sweeps, select
from autopar.passes.ir import Graph, Node
from autopar.passes.rules import op_info
from autopar.passes.strategies import MeshContext, Strategy


def _targets(node: Node, prop: Propagation, forward: bool) -> list[tuple[str, int, int]]:
    """The values a visit may fix (free, or partially fixed in forced mode): ("out", k, vid)
    forward, ("in", pos, vid) backward."""
    if forward:
        return [("out", k, vid) for k, vid in enumerate(node.outs) if not prop.exact(vid)]
    return [("in", pos, vid) for pos, vid in node_operands(node) if not prop.exact(vid)]


def visit(node: Node, strats: list[Strategy], prop: Propagation, forward: bool,
          sources: frozenset | None = None) -> bool:
    """Forced mode: fix the splits every strategy compatible with ``node``'s fixed values
    agrees on; True when something was fixed. ``sources``: the values whose fixed shardings
    may propagate (None: all)."""
    targets = _targets(node, prop, forward)
    if not targets:
        return False
    neighbours = [v for _, v in node_operands(node)] + list(node.outs)
    known = {v: prop.specs[v] for v in neighbours
             if v in prop.specs and (sources is None or v in sources)}
    if not known:
        return False
    fits = compatible(node, strats, known, prop.compatible_cache)
    if not fits:
        return False  # a conflict: resolved when the node picks its strategy
    origin = origin_of(node, prop.specs, prop.origins)
    changed = False
    for side, pos, vid in targets:
        common = frozenset.intersection(*[splits_of(spec_of(strats[i], side, pos))
                                          for i in fits])
        old = prop.specs.get(vid)
        if common and (old is None or common != old.pairs):
            prop.fix(vid, Splits(common | (old.pairs if old else frozenset())),
                     prop.origins.get(vid, origin))
            changed = True
    return changed


def run_sweeps(graph: Graph, strats, prop: Propagation, complete: bool, ties=(),
               axis_sizes: dict | None = None) -> None:
    """Propagate to a fixed point. Complete mode: whole specs, level by level
    (``passes.gspmd.complete_sweeps``). Forced mode: the splits every compatible strategy agrees on,
    spread only along one tensor (see :func:`_one_tensor`), in forward and backward sweeps."""
    if complete:
        complete_sweeps(graph, strats, prop, ties, axis_sizes or {})
    else:
        _sweeps(graph, strats, prop)


def _one_tensor(graph: Graph, node: Node) -> frozenset | None:
    """Forced mode's reach: a same-tensor node (``op_info(node).same_tensor``) passes on the splits of
    its full-size values only. Elsewhere, or from a smaller operand (a broadcast bias or norm
    scale), keeping a sharding is not forced: an FSDP-sharded weight does not make the
    activations it meets split their features, the ILP weighs gathering it instead."""
    if not op_info(node).same_tensor:
        return frozenset()
    vids = [v for _, v in node_operands(node)] + list(node.outs)
    largest = max(graph.values[v].size for v in vids)
    return frozenset(v for v in vids if graph.values[v].size == largest)


def _sweeps(graph: Graph, strats, prop: Propagation, max_sweeps: int = 50) -> None:
    """Forced mode: forward and backward sweeps to a fixed point. A visit reads only the node's
    neighbours' fixed specs, so a node none of whose neighbours was fixed since its last visit
    in that direction is skipped: it would fix nothing new (this keeps deep models fast)."""
    nodes = graph.nodes
    reach = [_one_tensor(graph, node) for node in nodes]
    neighbours = [[v for _, v in node_operands(node)] + list(node.outs) for node in nodes]
    last = {True: [-1] * len(nodes), False: [-1] * len(nodes)}  # direction -> stamp at visit

    def sweep(order, forward: bool) -> bool:
        changed = False
        for node in order:
            newest = max((prop.fixed_at.get(v, 0) for v in neighbours[node.id]), default=0)
            if newest <= last[forward][node.id]:
                continue
            last[forward][node.id] = prop.stamp
            changed |= visit(node, strats[node.id], prop, forward, reach[node.id])
        return changed

    for _ in range(max_sweeps):
        prop.sweeps += 1
        changed = sweep(nodes, True)
        changed |= sweep(reversed(nodes), False)
        if not changed:
            return


def pin_forced(graph: Graph, strats, prop: Propagation) -> int:
    """Forced mode: cut each producer of a propagated value to the strategies that keep its
    splits, as ``build_strategies`` cuts a hinted node (a partial fix has no full spec to put in
    ``node.pinned``). Returns the number of nodes cut."""
    cut = 0
    for node in graph.nodes:
        fixed = [(k, prop.specs[v]) for k, v in enumerate(node.outs)
                 if v in prop.specs and not prop.origins[v].user]
        if not fixed or node.pinned is not None:
            continue
        kept = [s for s in strats[node.id] if all(admits(f, s.out_specs[k]) for k, f in fixed)]
        if not kept or len(kept) == len(strats[node.id]):
            continue  # fixed backward by a consumer this producer cannot serve: left to the ILP
        strats[node.id] = kept
        cut += 1
    return cut


def propagate(graph: Graph, strats: list[list[Strategy]], mesh: MeshContext,
              labels: dict[int, str], ties=(), *, complete: bool, warn: bool = True,
              extra: dict[int, Spec] | None = None) -> Propagation:
    """Run the pass. ``labels``: node id -> the annotation that pinned it (for messages);
    ``ties``: (output node, input node) pairs sharing a sharding; ``extra``: see
    ``passes.fixed.seed``.
    In forced mode ``strats`` is cut in place; in complete mode the result holds every node's
    strategy. ``warn``: warn of the conflicts found (``Propagation.conflicts``); without it
    they are not looked for (a candidate plan's propagation)."""
    prop = seed(graph, labels, extra)
    if not complete and not prop.specs:
        return prop  # forced mode moves fixed shardings only: with none, nothing moves
    run_sweeps(graph, strats, prop, complete, ties, mesh.axis_sizes)
    if warn:
        prop.conflicts = find_conflicts(graph, strats, prop, labels)
    for message in prop.conflicts:
        warn_user(message, ShardingConflictWarning)
    if complete:
        prop.choice = select(graph, strats, mesh, prop, ties)
    else:
        pin_forced(graph, strats, prop)
    return prop
