"""Pass 2, annotate: the user's constraints become pinned shardings on graph nodes.

Sources: ``with_sharding_constraint`` calls already in the program (their ``sharding_constraint``
equations), and the in/out sharding hints given to ``autopar.plan``. A hint is always kept: the
node's strategies are cut to those with the pinned spec.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autopar.errors import ShardingHintError
from autopar.passes.ir import Graph
from autopar.passes.rules import op_info
from autopar.cost_model.spec import Spec, pspec_text, spec_fits
from autopar.passes.trace import constraint_label


def check_partition_spec(hint: PartitionSpec, where: str) -> None:
    """ShardingHintError unless each entry of ``hint`` is None, a mesh axis name or a tuple of
    them (``P(1)`` and ``P(P.UNCONSTRAINED)`` are not)."""
    for i, entry in enumerate(hint):
        names = entry if isinstance(entry, tuple) else (entry,)
        if entry is PartitionSpec.UNCONSTRAINED or any(
                n is PartitionSpec.UNCONSTRAINED for n in names):
            raise ShardingHintError(
                f"hint {pspec_text(hint)} for `{where}` leaves dim {i} P.UNCONSTRAINED, which autopar does "
                "not take: write None there (that dim unsplit), or None for the whole value to "
                "let autopar decide")
        if entry is not None and not all(isinstance(n, str) for n in names):
            raise ShardingHintError(
                f"hint {pspec_text(hint)} for `{where}`: dim {i}'s entry {entry!r} is not a mesh axis name; "
                "each entry must be None, an axis name such as 'data', or a tuple of names")


def to_spec(hint, shape, axis_sizes: dict[str, int], where: str) -> Spec | None:
    """A PartitionSpec / NamedSharding hint as a Spec on our mesh, checked; None = free."""
    if hint is None:
        return None
    if isinstance(hint, NamedSharding):
        hint = hint.spec
    if not isinstance(hint, PartitionSpec):
        raise ShardingHintError(f"hint for `{where}` is of type {type(hint).__name__}: give a "
                                "PartitionSpec, a NamedSharding or None")
    check_partition_spec(hint, where)
    for entry in hint:   # an unknown axis first: it is the likelier mistake than the rank
        for axis in (entry if isinstance(entry, tuple) else (entry,)):
            if axis is not None and axis not in axis_sizes:
                raise ShardingHintError(
                    f"hint {pspec_text(hint)} for `{where}` names mesh axis `{axis}`, which the "
                    f"mesh lacks; its axes are {list(axis_sizes)}")
    try:
        spec = Spec.from_partition_spec(hint, len(shape))
    except ValueError as e:
        raise ShardingHintError(f"hint {pspec_text(hint)} for `{where}` (shape {tuple(shape)}): {e}") from None
    if len(set(spec.axes)) != len(spec.axes):
        raise ShardingHintError(f"hint {pspec_text(hint)} for `{where}` uses a mesh axis twice")
    order = list(axis_sizes)
    for d in spec.dims:
        if list(d) != sorted(d, key=order.index):
            raise ShardingHintError(
                f"hint {pspec_text(hint)} for `{where}` splits one dim over {d}, against the mesh's axis "
                f"order {tuple(order)}; autopar plans multi-axis dims in mesh order: write "
                f"{tuple(sorted(d, key=order.index))}, or reorder the mesh axes")
    if not spec_fits(spec, tuple(shape), axis_sizes):
        bad = [d for d in range(len(shape)) if shape[d] % spec.shards(d, axis_sizes)]
        d = bad[0]
        n = spec.shards(d, axis_sizes)
        raise ShardingHintError(
            f"hint {pspec_text(hint)} for `{where}` splits dim {d} of size {shape[d]} over {n} devices, which "
            f"does not divide it. Use axes whose sizes divide {shape[d]}, or pad dim {d} to "
            f"{-(-shape[d] // n) * n}.")
    return spec


def _is_hint(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding))


def _children(x) -> list:
    return jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]


def _describe(x) -> str:
    if isinstance(x, dict):
        return f"a {type(x).__name__} with keys {sorted(map(str, x))}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__}"


def _mismatch(hints, target, path=(), thing: str = "argument") -> tuple[tuple, str] | None:
    """The first place where a hint tree is not a prefix of ``target``: (key path, why);
    ``thing``: what the tree holds (an argument, a result)."""
    if _is_hint(hints):
        return None
    if isinstance(target, int):  # an argument leaf (the dummy tree holds 0s)
        return path, f"the hint is {_describe(hints)} where the {thing} is one array"
    # at the root, the tree is all the arguments (results) at once
    are = f"the {thing} is" if path else f"the {thing}s are"
    if type(hints) is not type(target):
        return path, f"the hint is {_describe(hints)} where {are} {_describe(target)}"
    ours, theirs = _children(hints), _children(target)
    if [k for k, _ in ours] != [k for k, _ in theirs]:
        return path, f"the hint is {_describe(hints)} where {are} {_describe(target)}"
    for (key, h), (_, t) in zip(ours, theirs):
        found = _mismatch(h, t, path + key, thing)
        if found:
            return found
    return None


def flatten_hints(hints, tree, what: str) -> list:
    """Broadcast a hint pytree, or a prefix of it, over the leaves of ``tree`` (a treedef)."""
    if hints is None:
        return [None] * tree.num_leaves
    dummy = jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves)
    try:
        per_leaf = jax.tree_util.tree_map(
            lambda h, sub: _Repeated(h, len(jax.tree_util.tree_leaves(sub))), hints, dummy,
            is_leaf=_is_hint)
    except (ValueError, TypeError) as e:
        thing = "result" if what.startswith("out") else "argument"
        found = _mismatch(hints, dummy, thing=thing)
        where = (f": {e}" if not found else f": {found[1]}" if not found[0]
                 else f" at `{what}{jax.tree_util.keystr(found[0])}`: {found[1]}")
        raise ShardingHintError(f"`{what}` does not match the {thing}s it hints{where}. Give "
                                f"a pytree shaped like the {thing}s (or a prefix of it) of "
                                "PartitionSpec, NamedSharding or None.") from None
    out = []
    for repeated in jax.tree_util.tree_leaves(per_leaf):   # a _Repeated is a leaf
        out += [repeated.hint] * repeated.count
    return out


@dataclasses.dataclass(frozen=True)
class _Repeated:
    """One hint and the count of leaves it covers (not a list: hints may hold lists)."""
    hint: object
    count: int


def annotate(graph: Graph, in_specs: list[Spec | None], out_specs: list[Spec | None],
             axis_sizes: dict[str, int], in_labels: list[str] | None = None,
             out_labels: list[str] | None = None) -> dict[int, str]:
    """Pin the hinted inputs and outputs and every ``with_sharding_constraint``. Returns, per
    pinned node, the annotation it comes from (``in_labels`` / ``out_labels`` name the hinted
    leaves, e.g. ``in_shardings[0]['w']``), for propagation's messages."""
    labels: dict[int, str] = {}
    for nodes, specs, names, what in ((graph.input_nodes, in_specs, in_labels, "in_shardings"),
                                      (graph.output_nodes, out_specs, out_labels,
                                       "out_shardings")):
        for i, (node_id, spec) in enumerate(zip(nodes, specs)):
            if spec is not None:
                graph.nodes[node_id].pinned = (spec,)
                labels[node_id] = names[i] if names else f"{what} leaf {i}"
    for node in graph.nodes:
        if op_info(node).pin_param is not None and node.pinned is not None:
            shape = graph.values[node.outs[0]].shape
            labels[node.id] = constraint_label(node)
            node.pinned = (to_spec(node.pinned[0], shape, axis_sizes, labels[node.id]),)
    return labels
