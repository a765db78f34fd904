"""What mesh axis names mean: axes named ``data``, ``batch``, ``dp`` or ``fsdp`` carry the
batch, and ``model``, ``tensor``, ``tp`` or ``expert`` carry model dimensions, as users of
MaxText and pod setups expect.

Among plans predicted equally fast the planner takes one that follows the names (a tie break
in the ILP, ``passes.ilp``); ``plan(batch_axes=...)`` makes the batch axes explicit: it pins
the batch's leading dim on them, and the ILP pays heavily for a layer that takes the batch
split otherwise. :func:`check` says when a plan splits the batch otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from jax import lax

from autopar._layers import Phase, input_source, node_phases
from autopar.cost_model.spec import Spec
from autopar.errors import ArgumentError

BATCH_NAMES = ("data", "batch", "dp", "fsdp")
MODEL_NAMES = ("model", "tensor", "tp", "expert")


@dataclass(frozen=True)
class AxisRoles:
    """``batch``: the axes that carry the batch; ``model``: those that carry model dims;
    ``explicit``: given as ``plan(batch_axes=...)`` rather than read from the names."""
    batch: tuple[str, ...]
    model: tuple[str, ...]
    explicit: bool

    def penalty(self, spec: Spec, dim: int = 0) -> float:
        """How far a batch value's spec is from the roles: each axis on its batch dim ``dim``
        that is not a batch axis, and each batch axis missing from it."""
        if spec.rank <= dim:
            return 0.0
        lead = spec.dims[dim]
        return float(sum(a not in self.batch for a in lead)
                     + sum(a not in lead for a in self.batch))

    def state_penalty(self, spec: Spec) -> float:
        """How far a parameter's (or other state's) spec is from the roles: half a unit per
        batch axis that splits it, so that of two equally fast plans the one that splits
        weights over the model axes is taken (ZeRO over the batch axes still wins wherever
        it is faster)."""
        return 0.5 * sum(a in self.batch for a in spec.axes)

    def to_dict(self) -> dict:
        return {"batch_axes": list(self.batch), "model_axes": list(self.model),
                "explicit": self.explicit}


def roles(axis_names: Sequence[str], batch_axes=None) -> AxisRoles:
    """The roles of a mesh's axes: ``batch_axes`` (a name or names) when given, else by name."""
    if batch_axes is None:
        return AxisRoles(tuple(a for a in axis_names if a in BATCH_NAMES),
                         tuple(a for a in axis_names if a in MODEL_NAMES), False)
    try:
        given = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    except TypeError:   # not a name nor a sequence of them
        given = ()
    unknown = [a for a in given if a not in axis_names]
    if unknown or not given or not all(isinstance(a, str) for a in given):
        raise ArgumentError(f"`batch_axes` must name axes of the mesh ({', '.join(axis_names)}),"
                            f" got {batch_axes!r}")
    return AxisRoles(given, tuple(a for a in axis_names if a not in given), True)


def state_ties(ins: Sequence[tuple[str, object]], outs: Sequence[tuple[str, object]]
               ) -> list[tuple[int, int]]:
    """(output, input) index pairs of the results that replace an argument, such as new
    parameters and optimizer state; ``ins`` and ``outs``: each leaf's key path and value
    (anything with a shape and a dtype). A result replaces the argument at its own path with
    its shape and dtype: ``(state, loss) = step(state, batch)``. Where no result sits at an
    argument's path, the step returns its first argument's new value, alone or in a structure
    of its own: a result at ``['w']`` (or a bare array) replaces ``[0]['w']`` (``[0]``), as in
    ``state = step(state)`` and ``params = update(params, grads)``."""
    by_path = {p: (i, a) for i, (p, a) in enumerate(ins)}

    def ties_at(prefix: str) -> list[tuple[int, int]]:
        found = []
        for o, (p, a) in enumerate(outs):
            i, b = by_path.get(prefix + p, (None, None))
            if i is not None and (tuple(b.shape), b.dtype) == (tuple(a.shape), a.dtype):
                found.append((o, i))
        return found

    return ties_at("") or ties_at("[0]")


def batch_leaves(traced, ties: Sequence[tuple[int, int]]) -> list[int]:
    """Flat input indices of the batch: the leaves (rank >= 1) of every argument after the
    first that no result replaces (``ties``: (output, input) pairs; new parameters and
    optimizer state replace theirs). Empty for a function of one argument."""
    per_arg = [t.num_leaves for t in traced.in_tree.children()]
    if len(per_arg) < 2:
        return []
    tied = {i for _, i in ties}
    first = per_arg[0]
    return [i for i in range(first, sum(per_arg))
            if i not in tied and len(traced.in_avals[i].shape) >= 1]


#: With ``batch_axes=`` given, a reader of the batch that takes it split otherwise costs this
#: many tie-break units (``passes.ilp.PREFERENCE``): ten times the plan's lower bound (or
#: its largest cost), a request the plan pays for. At a tenth (1e4) a small MLP on
#: ``{data: 8}`` gathered its batch and replicated every matmul, though ``batch_axes="data"``.
EXPLICIT_WEIGHT = 1e6


def preferences(graph, leaves: Sequence[int], axis_roles: AxisRoles,
                weights: Sequence[int] = ()) -> dict:
    """The ILP's preferences (node id -> a penalty per strategy): each input by its role
    (:meth:`AxisRoles.penalty` for the batch ``leaves``, :meth:`AxisRoles.state_penalty` for
    the rest). With explicit roles, at :data:`EXPLICIT_WEIGHT`, also every reader of the
    batch by the spec it reads the batch in, and every forward matmul of an activation with
    one of the ``weights`` (flat input indices) by the activation's batch dim
    (:func:`activation_batch_dims`): so the batch stays on its axes through the layers."""
    if not axis_roles.batch:
        return {}
    batch = set(leaves)
    out = {}
    for i, node in enumerate(graph.input_nodes):
        role = axis_roles.penalty if i in batch else axis_roles.state_penalty
        out[node] = lambda st, role=role: role(st.out_specs[0])
    if not axis_roles.explicit:
        return out
    values = {graph.nodes[graph.input_nodes[i]].outs[0] for i in leaves}
    reads: dict[int, list[tuple[int, int]]] = {}   # node -> (operand, batch dim) to keep
    for reader in graph.nodes:
        reads[reader.id] = [(pos, 0) for pos, v in enumerate(reader.ins) if v in values]
    weight_nodes = {graph.input_nodes[i] for i in weights if i not in batch}
    for node, pos, dim in activation_batch_dims(graph, weight_nodes):
        if (pos, dim) not in reads[node]:   # the batch input itself, read by a matmul
            reads[node].append((pos, dim))
    for node, kept in reads.items():
        if kept and node not in out:
            out[node] = lambda st, kept=kept: EXPLICIT_WEIGHT * sum(
                axis_roles.penalty(st.in_specs[p], d) for p, d in kept
                if st.in_specs[p] is not None)
    return out


def activation_batch_dims(graph, weights: set[int]) -> list[tuple[int, int, int]]:
    """(node id, operand, dim) of the batch in the activation that each forward matmul
    multiplies with a weight (an input node in ``weights``, read through casts and scan
    slices): the activation's first dim the matmul does not sum over."""
    phases = node_phases(graph)
    out = []
    for node in graph.nodes:
        if node.primitive is not lax.dot_general_p or phases[node.id] is not Phase.FORWARD:
            continue
        sources = [input_source(graph, v, scans=True) if v is not None else None
                   for v in node.ins]
        (contract, _) = node.params["dimension_numbers"]
        for pos in (0, 1):
            if sources[1 - pos] in weights and sources[pos] not in weights:
                free = [d for d in range(len(node.in_avals[pos][0])) if d not in contract[pos]]
                if free:
                    out.append((node.id, pos, free[0]))
    return out


def pin_batch(specs: list, traced, leaves: Sequence[int], batch: tuple[str, ...],
              sizes: dict[str, int]) -> list:
    """``specs`` (a Spec or None per input leaf) with each batch leaf left free (None) split
    on its leading dim over the batch axes that divide it, in order."""
    specs = list(specs)
    for i in leaves:
        if specs[i] is not None:
            continue
        shape = traced.in_avals[i].shape
        axes, size = [], 1
        for a in batch:
            if shape[0] % (size * sizes[a]) == 0:
                axes.append(a)
                size *= sizes[a]
        specs[i] = Spec((tuple(axes),) + ((),) * (len(shape) - 1))
    return specs


#: Why a plan splits the batch as it does, by how it was made, for the note of :func:`check`.
WHY = {"searched": "as predicted faster",
       "propagated": "as the annotations propagate (search=False)",
       "exported": "as the fastest compiled program under plain jax.jit has it (exportable=True)"}


def check(graph, strats, choice, leaves: Sequence[int], axis_roles: AxisRoles,
          sizes: dict[str, int], made: str = "searched") -> dict:
    """``plan.stats["axis_roles"]``: the roles, the axes the program splits the batch over
    (the leading dim of each batch leaf as its readers take it: an input split over ``data``
    that every reader gathers is not split), and a ``note`` when a non-batch axis splits it,
    or none does, while the mesh names batch axes (``made``: how the plan was made, a key of
    :data:`WHY`)."""
    why = WHY[made]
    values = {graph.nodes[graph.input_nodes[i]].outs[0]: graph.input_nodes[i] for i in leaves}
    split: set[str] = set()
    read: set[int] = set()
    for reader in graph.nodes:
        for pos, v in enumerate(reader.ins):
            if v in values:
                read.add(v)
                spec = strats[reader.id][choice[reader.id]].in_specs[pos]
                split.update(spec.dims[0] if spec is not None and spec.rank else ())
    for v, node in values.items():   # a leaf no op reads: as it arrives
        own = strats[node][choice[node]].out_specs[0]
        split.update(own.dims[0] if v not in read and own.rank else ())
    out = {**axis_roles.to_dict(), "batch_split_over": sorted(split)}
    others = sorted(a for a in split if a not in axis_roles.batch and sizes[a] > 1)
    names = ", ".join(f"`{a}`" for a in axis_roles.batch)
    asked = "batch_axes says" if axis_roles.explicit else "the axis names say"
    if axis_roles.batch and others:
        on = " x ".join(f"{a}({sizes[a]})" for a in others)
        keep = ", ".join(repr(a) for a in axis_roles.batch)
        how = ("not only over" if split & set(axis_roles.batch) else "instead of over")
        pin = "" if axis_roles.explicit else (
            f" (batch_axes=({keep},) pins the inputs' batch there)")
        out["note"] = f"the batch is split over {on}, {how} {names} as {asked}, {why}{pin}"
    elif axis_roles.batch and not split and math.prod(sizes[a] for a in axis_roles.batch) > 1:
        out["note"] = (f"the batch is not split over {names} as {asked}: the plan gives those "
                       f"axes other work, or replicates, {why}")
    return out
