"""Collective matmul as strategies of ``dot_general``.

For a dot strategy that wants an operand replicated over a mesh axis X, another strategy takes
that operand split over X on one of its dims and gathers it in ring steps (``ppermute``), each
arrived block multiplied while the next travels: on a free dim the blocks fill the result's
slices, on a contracting dim their products add up. For a strategy whose partial sums over X
are reduce-scattered into a result dim, another strategy computes the result block by block,
each block's partial sum passed along the ring and added to while the next block multiplies.
Each has the specs of the pair it replaces at its boundary (the reshard and the dot, or the
dot and its reduce-scatter), is priced by ``cost_model.overlap`` (only the communication its
chunks do not hide is charged) and is emitted by ``passes.overlap.regions``.

A gather whose operand other ops read later (in its jaxpr or one nested in it) also writes
the blocks it receives into the gathered operand and returns it (``keep``,
``Rewrite.keeps``): a reader that wants it gathered, such as the backward pass's
weight-gradient dot reading the forward activation, takes it with no all-gather of its own
(Megatron's sequence parallelism keeps that input the same way). The ILP credits those
readers' move when the dot takes the rewrite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
from dataclasses import dataclass

from jax import lax

from autopar.cost_model import overlap
from autopar.cost_model.compute import roofline_s
from autopar.cost_model.spec import Spec, local_bytes
from autopar.passes.ir import Graph, Node, itemsize
from autopar.passes.rules import op_info
from autopar.passes.strategies import MeshContext, Rewrite, RewriteKind, Strategy

#: A rewrite must be predicted at least this much faster than the pair it replaces.
MIN_GAIN = 0.02
#: Test-only (:func:`forced`): every decomposition that divides is offered, at no cost.
_FORCED = [False]


@contextlib.contextmanager
def forced():
    """For tests: within it, every dot with a collective matmul whose chunks divide is
    offered only those, and every scanned input with a prefetch only those (priced at zero,
    ``passes.overlap.prefetch``), so that plans take them at any size."""
    _FORCED[0] = True
    try:
        yield
    finally:
        _FORCED[0] = False


class Mode(enum.Enum):
    GATHER_FREE = "gather free dim"              # gathered blocks fill result slices
    GATHER_CONTRACTING = "gather contracting dim"  # gathered blocks' products add up
    SCATTER = "scatter"                          # partial sums passed along, block by block


@dataclass(frozen=True)
class CollectiveMatmul:
    """How one dot is decomposed over ``axis``. Gathers: ``operand`` arrives split on ``dim``;
    its blocks fill result dim ``out_dim`` (free) or meet the other operand's contracting dim
    ``other_dim``; with ``keep``, they are also written into the gathered operand, which the
    region returns second. Scatter: the result is split on ``out_dim``, and ``slices`` names
    the operand dims that make one result block. ``in_specs``/``out_spec``: the strategy's."""
    mode: Mode
    axis: str
    bidirectional: bool
    in_specs: tuple[Spec, Spec]
    out_spec: Spec
    operand: int = -1
    dim: int = -1
    out_dim: int = -1
    other_dim: int = -1
    slices: tuple[tuple[int, int], ...] = ()
    keep: bool = False  # a gather also returns the operand it gathered

    def as_params(self) -> tuple[tuple[str, object], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))

    @classmethod
    def from_rewrite(cls, rewrite: Rewrite) -> CollectiveMatmul:
        return cls(**dict(rewrite.params))

    def gathered_spec(self) -> Spec:
        """A gather's operand spec once gathered: ``in_specs[operand]`` whole on ``dim``."""
        dims = list(self.in_specs[self.operand].dims)
        dims[self.dim] = ()
        return Spec(tuple(dims))

    @property
    def chunks(self) -> int:
        """How many pieces the chunked dim is cut into: two per device bidirectional."""
        return 2 if self.bidirectional else 1


def out_dims(dimension_numbers, ranks) -> list[list[tuple[int, int]]]:
    """Per result dim of a dot_general, the (operand, dim) pairs it comes from."""
    (lc, rc), (lb, rb) = dimension_numbers
    free = [[d for d in range(ranks[k]) if d not in (lc, rc)[k] and d not in (lb, rb)[k]]
            for k in (0, 1)]
    return ([[(0, l), (1, r)] for l, r in zip(lb, rb)] + [[(0, d)] for d in free[0]]
            + [[(1, d)] for d in free[1]])


def strategies(node: Node, graph: Graph, mesh: MeshContext, base: list[Strategy]
               ) -> list[Strategy]:
    """The collective-matmul strategies of a dot node, from its strategies ``base``: for each
    that leaves an all-gather before it or a reduce-scatter after it over one axis, the
    decomposed form (one- or bidirectional, the faster), when it gains :data:`MIN_GAIN`."""
    if node.primitive is not lax.dot_general_p or any(v is None for v in node.ins):
        return []
    out, seen = [], set()
    later = [_read_later(node, graph, k) for k in (0, 1)]
    for s in base:
        for cm in _decompositions(node, graph, mesh, s):
            if cm.mode is not Mode.SCATTER and later[cm.operand]:
                cm = dataclasses.replace(cm, keep=True)
            key = (cm.in_specs, cm.out_spec)
            if key in seen:
                continue
            priced = [_priced(node, graph, mesh, s, replace_bidi(cm, b)) for b in (False, True)]
            priced = [p for p in priced if p is not None]
            if priced:
                seen.add(key)
                out.append(min(priced, key=lambda st: st.cost_s))
    return out


def _read_later(node: Node, graph: Graph, pos: int) -> bool:
    """Whether operand ``pos`` of ``node`` has other readers, all ops later in its jaxpr or in
    jaxprs nested in it (where the region's second result can feed them)."""
    scopes = graph.scopes()
    mine = scopes.get(node.id)
    others = [w for w, _ in graph.consumers()[node.ins[pos]] if w != node.id]
    return mine is not None and bool(others) and all(
        w > node.id and w in scopes and scopes[w][:len(mine)] == mine for w in others)


def replace_bidi(cm: CollectiveMatmul, bidirectional: bool) -> CollectiveMatmul:
    return dataclasses.replace(cm, bidirectional=bidirectional)


def _decompositions(node: Node, graph: Graph, mesh: MeshContext, s: Strategy):
    """The collective matmuls (unpriced, one-directional) that could replace strategy ``s``."""
    dn = node.params["dimension_numbers"]
    ranks = [len(shape) for shape, _ in node.in_avals]
    outs = out_dims(dn, ranks)
    ins, res = s.in_specs, s.out_specs[0]
    for axis in mesh.axis_names:
        if (mesh.axis_sizes[axis] < 2 or axis not in res.axes
                or not _major(axis, (*ins, res))):
            continue
        if not s.collectives:
            yield from _gathers(dn, outs, ins, res, axis)
        elif len(s.collectives) == 1 and s.collectives[0].axes == (axis,):
            yield from _scatters(dn, outs, ins, res, axis)


def _major(axis: str, specs) -> bool:
    """Whether ``axis`` comes first in every dim it splits: the region, manual over ``axis``
    only, sees the blocks the plan's layout holds."""
    return all(dims[0] == axis for sp in specs for dims in sp.dims if axis in dims)


def _gathers(dn, outs, ins, res: Spec, axis: str):
    (lc, rc), (lb, rb) = dn
    for g in (0, 1):
        if axis in ins[g].axes:
            continue
        batch, contracting = (lb, rb)[g], (lc, rc)[g]
        for d, axes in enumerate(ins[g].dims):
            if axes or d in batch:
                continue
            dims = list(ins[g].dims)
            dims[d] = (axis,)
            specs = tuple(Spec(tuple(dims)) if k == g else ins[k] for k in (0, 1))
            if d in contracting:
                other = (lc, rc)[1 - g][contracting.index(d)]
                yield CollectiveMatmul(Mode.GATHER_CONTRACTING, axis, False, specs, res,
                                       operand=g, dim=d, other_dim=other)
            else:
                od = next(o for o, src in enumerate(outs) if (g, d) in src)
                yield CollectiveMatmul(Mode.GATHER_FREE, axis, False, specs, res,
                                       operand=g, dim=d, out_dim=od)


def _scatters(dn, outs, ins, res: Spec, axis: str):
    """A scatter over ``axis`` into a result dim ``axis`` splits alone, the operands split
    over ``axis`` only on a contracting pair (their partial sums)."""
    (lc, rc), _ = dn
    pairs = [(l, r) for l, r in zip(lc, rc)
             if ins[0].dims[l] == (axis,) and ins[1].dims[r] == (axis,)]
    if len(pairs) != 1 or sum(axis in d for d in ins[0].dims + ins[1].dims) != 2:
        return
    for od, axes in enumerate(res.dims):
        if axes == (axis,):
            yield CollectiveMatmul(Mode.SCATTER, axis, False, (ins[0], ins[1]), res,
                                   out_dim=od, slices=tuple(outs[od]))


def _priced(node: Node, graph: Graph, mesh: MeshContext, s: Strategy, cm: CollectiveMatmul
            ) -> Strategy | None:
    """Strategy ``s`` as the collective matmul ``cm``, priced; None when the chunked dim does
    not divide into its blocks or the rewrite does not gain :data:`MIN_GAIN` over ``s`` and
    the collective it replaces."""
    n = mesh.axis_sizes[cm.axis]
    shapes = [shape for shape, _ in node.in_avals]
    out_value = graph.values[node.outs[0]]
    if cm.mode is Mode.SCATTER:
        size = out_value.shape[cm.out_dim]
        value, spec, shape = out_value, cm.out_spec, out_value.shape
    else:
        size = shapes[cm.operand][cm.dim]
        value = graph.values[node.ins[cm.operand]]
        spec, shape = cm.in_specs[cm.operand], shapes[cm.operand]
    if size % (n * cm.chunks):
        return None
    block_bytes = local_bytes(spec, shape, mesh.wire_itemsize(value), mesh.axis_sizes)
    work = _chunked(node, graph, mesh, s, cm, n * cm.chunks)
    priced = overlap.collective_matmul(work, cm.axis, n, block_bytes, cm.bidirectional,
                                       mesh.levels, mesh.profile.launch_overhead_s)
    replaced_s = s.compute_s + _replaced_comm_s(node, graph, mesh, s, cm)
    if _FORCED[0]:
        priced = overlap.Overlapped(0.0, 0.0, 0.0, priced.steps)
    elif priced.total_s > (1 - MIN_GAIN) * replaced_s:
        return None
    kind = (RewriteKind.MATMUL_REDUCE_SCATTER if cm.mode is Mode.SCATTER
            else RewriteKind.ALL_GATHER_MATMUL)
    keeps = ((cm.operand, cm.gathered_spec()),) if cm.keep else ()
    return Strategy(cm.in_specs, s.out_specs, s.flops, priced.compute_s, priced.exposed_s,
                    priced.steps, rewrite=Rewrite(kind, (cm.axis,), cm.as_params(), keeps))


def _replaced_comm_s(node: Node, graph: Graph, mesh: MeshContext, s: Strategy,
                     cm: CollectiveMatmul) -> float:
    """The communication the rewrite replaces: ``s``'s reduction, or the gather of the
    operand from the rewrite's spec to ``s``'s."""
    if cm.mode is Mode.SCATTER:
        return sum(c.time_s(mesh.levels) for c in s.collectives)
    value = graph.values[node.ins[cm.operand]]
    return mesh.reshard_time_s(cm.in_specs[cm.operand], s.in_specs[cm.operand], value)


def _chunked(node: Node, graph: Graph, mesh: MeshContext, s: Strategy, cm: CollectiveMatmul,
             pieces: int) -> overlap.Chunked:
    """``s``'s matmul cut into ``pieces`` along the chunked dim, each at the roofline of its
    own dims (it reads the whole uncut operand again), and the kernels placing its result:
    a slice written (free gather), or an accumulator read and written (float32 for 16-bit
    floats: contracting gather), or, for each piece after a direction's first (scatter), the
    arrived partial sum read as the wire carries it, added to the piece as the dot wrote it
    and written (and, bidirectional, the result's two halves joined); and slicing its
    operand piece where the piece is cut from a block held whole (in float32 where XLA:CPU
    computes 16-bit dots in float32, ``MeshContext.dots_in_f32``); for a block that
    collectives move in a wider type (``MeshContext.wire_itemsize``: XLA:CPU carries bf16
    as float32), its converts before it is sent and after it arrives (a scatter's partial
    sum: before it is sent); and, where the operand is kept, the update writing each piece
    there."""
    local = [sp.local_shape(shape, mesh.axis_sizes)
             for sp, (shape, _) in zip(s.in_specs, node.in_avals)]
    cut = [(cm.operand, cm.dim)] if cm.mode is not Mode.SCATTER else list(cm.slices)
    if cm.mode is Mode.GATHER_CONTRACTING:
        cut.append((1 - cm.operand, cm.other_dim))
    for k, d in cut:
        local[k] = tuple(x // pieces if i == d else x for i, x in enumerate(local[k]))
    out = graph.values[node.outs[0]]
    out_bytes = math.prod(s.out_specs[0].local_shape(out.shape, mesh.axis_sizes)) * out.itemsize
    if cm.mode is Mode.SCATTER:
        out_bytes *= mesh.axis_sizes[cm.axis]  # the partial sums, before they are scattered
    piece_bytes = out_bytes / pieces if cm.mode is not Mode.GATHER_CONTRACTING else out_bytes
    moved = sum(math.prod(sh) * itemsize(dt) for sh, (_, dt) in zip(local, node.in_avals))
    dims = op_info(node).matmul_dims(local, **node.params)
    matmul_s = roofline_s(s.flops / pieces, moved + piece_bytes, mesh.profile, out.dtype,
                          contraction=True, dims=dims)
    other = []
    if cm.mode is Mode.SCATTER:
        added = (pieces - cm.chunks) / pieces  # the share of pieces that add an arrived sum
        elems = piece_bytes / out.itemsize
        wire = mesh.wire_itemsize(out)
        place_bytes = added * elems * (mesh.dot_itemsize(out.dtype) + wire + out.itemsize)
        if cm.bidirectional:  # the two halves of the result block concatenated
            place_bytes += 2 * out_bytes / mesh.axis_sizes[cm.axis] / pieces
        if wire != out.itemsize:
            other.append(added * elems * (out.itemsize + wire))
    else:
        place_bytes = {Mode.GATHER_FREE: 2 * piece_bytes,
                       Mode.GATHER_CONTRACTING: 2 * out_bytes * max(4 // out.itemsize, 1)
                       + out_bytes}[cm.mode]
    # An operand piece cut out of a block the device holds whole is a dynamic-slice kernel,
    # read and written once: the scatter's slices, the other operand of a contracting gather,
    # and an arriving block where it arrives in two chunks.
    sliced = [(k, d) for k, d in cut
              if cm.mode is Mode.SCATTER or k != cm.operand or cm.chunks > 1]
    place_bytes += sum(2 * math.prod(local[k]) * mesh.dot_itemsize(node.in_avals[k][1])
                       for k, _ in sliced)
    if cm.mode is not Mode.SCATTER:
        value = graph.values[node.ins[cm.operand]]
        piece = math.prod(local[cm.operand]) * value.itemsize
        widened = mesh.wire_itemsize(value) / value.itemsize
        if widened != 1:
            other += [piece * (1 + widened)] * 2
        if cm.keep:
            other.append(2 * piece)
    hbm = mesh.profile.achieved_hbm_bytes_per_s
    return overlap.Chunked(matmul_s, place_bytes / hbm, pieces, tuple(b / hbm for b in other))


def with_collective_matmuls(graph: Graph, strats: list[list[Strategy]], mesh: MeshContext
                            ) -> list[list[Strategy]]:
    """``strats`` with each dot node's collective-matmul strategies added after its own
    (nodes that share a strategy list share the extended one; pinned nodes keep theirs)."""
    if not mesh.profile.async_collectives:
        return strats
    extended: dict[int, list[Strategy]] = {}
    out = []
    for node, own in zip(graph.nodes, strats):
        if node.pinned is not None or node.primitive is not lax.dot_general_p:
            out.append(own)
            continue
        if id(own) not in extended:
            extra = strategies(node, graph, mesh, own)
            extended[id(own)] = extra if _FORCED[0] and extra else own + extra
        out.append(extended[id(own)])
    return out
