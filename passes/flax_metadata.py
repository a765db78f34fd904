"""flax partitioning metadata on the example arguments, read as sharding hints (pass 2, annotate).

Three sources, found on the boxes flax leaves in a parameter tree:

* linen ``nn.with_partitioning(init, names)``: an ``nn.Partitioned`` box; ``names`` are mesh
  axes (or None), taken as they are.
* linen ``nn.with_logical_partitioning(init, names)``: an ``nn.LogicallyPartitioned`` box;
  ``names`` are logical axes, turned into mesh axes by the logical axis rules (the box's own
  ``rules``, else ``plan(..., logical_axis_rules=...)``, else flax's ``nn.logical_axis_rules``
  context) with flax's ``nn.logical_to_mesh_axes``. As in flax, a logical name no rule maps,
  or whose mesh axis an earlier dim took, stays unsharded (replicated over the mesh); with no
  rules at all the box is not a hint (flax leaves it unconstrained too), and a warning says so.
* flax nnx ``sharding=`` (``out_sharding`` in flax 0.12) on an ``nnx.Variable`` such as
  ``nnx.Param``, in the state from ``nnx.split``. As in nnx, a name with a rule (the variable's
  ``sharding_rules`` metadata, then ``logical_axis_rules``) is translated and any other name is
  a mesh axis.

With ``logical_axis_rules``, the function is also traced under those rules and the mesh, so
the ``nn.with_logical_constraint`` calls inside a model (MaxText's activation annotations,
no-ops without rules) become ``with_sharding_constraint`` annotations too.

The boxes stay in the arguments: flax unboxes them itself inside ``model.apply`` /
``nnx.merge``, and the planned program takes the same boxed pytree the user passes. A mesh axis
the mesh lacks, or one that does not divide its dim, is refused by ``passes.annotate.to_spec``
with the leaf's path, the metadata and the rules named in the message.
"""

from __future__ import annotations

import functools
import sys

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autopar.errors import (ShardingConflictWarning, ShardingHintError,
                            UnusedAnnotationWarning, warn)


def _boxes():
    """(linen AxisMetadata types, nnx Variable type); either may be missing. Only modules
    already imported are looked in: no argument can be an instance of a class whose module
    was never loaded, and importing ``flax.nnx`` for a linen program took 0.2 s of its
    planning."""
    meta, nnx = sys.modules.get("flax.core.meta"), sys.modules.get("flax.nnx")
    return ((meta.Partitioned,) if meta is not None else (),
            (nnx.Variable,) if nnx is not None else ())


def _context_rules():
    try:
        import flax.linen as nn
    except ImportError:  # pragma: no cover
        return ()
    return tuple(nn.get_logical_axis_rules())


def _linen_hint(box, rules) -> tuple[PartitionSpec | None, str]:
    import flax.linen as nn
    names = tuple(box.names)
    if not isinstance(box, nn.LogicallyPartitioned):
        return PartitionSpec(*names), f"nn.with_partitioning{names}"
    rules = tuple(box.rules or rules or _context_rules())
    where = f"nn.with_logical_partitioning{names}"
    if not rules:
        warn(f"autopar: {where} has no logical_axis_rules to map it to mesh axes; it is not "
             "used as a hint (flax leaves it unconstrained too). Pass "
             "`logical_axis_rules=[(logical, mesh_axis), ...]` to autopar.plan, or give the "
             "box its rules (`nn.with_logical_partitioning(init, names, rules=...)`).",
             UnusedAnnotationWarning)
        return None, where
    return nn.logical_to_mesh_axes(names, rules), f"{where} with logical_axis_rules"


def _nnx_hint(variable, rules) -> tuple[PartitionSpec | None, str]:
    meta = variable.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding")
    if not names:
        return None, ""
    names = tuple(names)
    table = dict(tuple(rules or ()) + tuple(meta.get("sharding_rules") or ()))
    mapped = [table.get(n, n) if isinstance(n, str) else n for n in names]
    how = " with its rules" if table else ""
    return PartitionSpec(*mapped), f"nnx sharding={names}{how}"


def metadata_hints(args, logical_axis_rules=None) -> list[tuple[PartitionSpec | None, str]]:
    """Per leaf of ``args`` (``jax.tree_util`` order): (hint or None, what it comes from)."""
    linen, variable = _boxes()
    boxed = linen + variable
    if not boxed:
        return [(None, "")] * len(jax.tree_util.tree_leaves(args))
    out = []
    for path, node in jax.tree_util.tree_flatten_with_path(
            args, is_leaf=lambda x: isinstance(x, boxed))[0]:
        n = len(jax.tree_util.tree_leaves(node)) if isinstance(node, boxed) else 1
        try:
            if isinstance(node, linen):
                hint = _linen_hint(node, logical_axis_rules)
            elif isinstance(node, variable):
                hint = _nnx_hint(node, logical_axis_rules)
            else:
                hint = (None, "")
        except (ValueError, TypeError) as e:
            raise ShardingHintError(
                f"the partitioning metadata of `args{jax.tree_util.keystr(path)}` cannot be "
                f"read as a sharding: {e}. Check its axis names and `logical_axis_rules` "
                "(pairs of (logical name, mesh axis or None)).") from None
        out += [hint] * n
    return out


def _normalized(hint, rank: int):
    from autopar.cost_model.spec import Spec
    if isinstance(hint, NamedSharding):
        hint = hint.spec
    try:
        return Spec.from_partition_spec(hint, rank)
    except (ValueError, TypeError):
        return hint  # malformed: annotate's checks report it


def merge(explicit: list, meta: list[tuple[PartitionSpec | None, str]], paths: list[str],
          ranks: list[int]) -> tuple[list, list[str]]:
    """Explicit ``in_shardings`` hints over flax metadata, leaf by leaf: the explicit hint wins
    and a disagreement warns naming both. Returns (hints, labels naming each hint's source)."""
    hints, labels = [], []
    for h, (m, what), path, rank in zip(explicit, meta, paths, ranks):
        label = f"in_shardings{path}"
        if h is None and m is not None:
            h, label = m, f"{what} on args{path}"
        elif h is not None and m is not None and _normalized(h, rank) != _normalized(m, rank):
            warn(f"autopar: in_shardings{path} = {h} disagrees with {what} -> {m} on the same "
                 "argument; the explicit in_shardings hint wins.", ShardingConflictWarning)
        hints.append(h)
        labels.append(label)
    return hints, labels


def traced_under_rules(fn, logical_axis_rules, mesh):
    """``fn`` run under flax's logical axis rules and ``mesh``, so that its
    ``nn.with_logical_constraint`` calls turn into sharding constraints when traced."""
    if not logical_axis_rules:
        return fn
    import flax.linen as nn
    rules = tuple(tuple(r) for r in logical_axis_rules)

    @functools.wraps(fn)
    def wrapped(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
            return fn(*args)
    return wrapped


def check(meta: list[tuple[PartitionSpec | None, str]], args, axis_sizes: dict[str, int]) -> None:
    """Refuse, before tracing, metadata that names a mesh axis the mesh lacks or does not
    divide its dim (ShardingHintError naming the leaf, the metadata and the rules)."""
    from autopar.passes.annotate import to_spec
    flat = jax.tree_util.tree_flatten_with_path(args)[0]
    for (hint, what), (path, leaf) in zip(meta, flat):
        if hint is not None:
            to_spec(hint, tuple(getattr(leaf, "shape", ())), axis_sizes,
                    f"{what} on args{jax.tree_util.keystr(path)}")
