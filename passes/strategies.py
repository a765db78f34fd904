"""Pass 5, strategies: every node's candidate shardings on the mesh, with their costs.

The rule registry says how one mesh axis may split an op (:mod:`passes.rules`). Here each mesh
axis picks one of those maps, or "replicate", and the product over the axes gives the node's
strategies; shardings a dimension cannot take evenly are dropped. A map that leaves a partial
result offers two ways to finish it: all-reduce (the result is whole over that axis) or
reduce-scatter into a result dimension. Each strategy carries its compute and communication
cost; resharding between strategies is the ILP's edge cost (``cost_model.collectives``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
from dataclasses import dataclass

import jax
import numpy as np
from jax.extend import core as jcore

from autopar._compat import scan_counts
from autopar.errors import ShardingHintError, warn
from autopar.cost_model.collectives import CommStep, plan_redistribute, reduce_step, ring_steps
from autopar.cost_model.compute import memory_bound_s, roofline_s
from autopar.cost_model.hlo import CollectiveKind
from autopar.passes import dedup
from autopar.passes.reductions import is_combined_reduction
from autopar.passes.ir import Graph, Node, NodeKind, Value, itemsize, recomputable
from autopar.passes.trace import CALLS, call_body
from autopar.passes.rules import (DimMap, Reduce, RuleContext, dim_maps, op_flops,
                                  op_info)
from autopar.cost_model.spec import Spec, local_bytes, spec_fits
from autopar.errors import UnsupportedPrimitiveWarning


def wire_itemsize(dtype, upcast_16bit: bool) -> int:
    """Bytes per element of a ``dtype`` array as collectives move it; ``upcast_16bit``:
    16-bit floats move as float32 (XLA:CPU)."""
    size = itemsize(dtype)
    if upcast_16bit and size == 2 and jax.dtypes.issubdtype(dtype, np.floating):
        return 4
    return size


@dataclass(frozen=True)
class MeshContext:
    """The mesh as the planner sees it: axes in order, their sizes and interconnect levels,
    and what the compiling backend does differently from a GPU/TPU (XLA:CPU lowers
    reduce-scatter as all-reduce plus a slice, moves 16-bit floats through collectives as
    float32, computes 16-bit dots in float32 on jaxlib 0.10, and holds result buffers for the
    whole call), so that predictions match what it compiles."""
    axis_names: tuple[str, ...]
    axis_sizes: dict
    levels: dict
    profile: object
    emulated_reduce_scatter: bool = False
    upcast_16bit_collectives: bool = False
    dots_in_f32: bool = False  # 16-bit float dots read float32 copies, write float32 (jaxlib 0.10)
    results_held: bool = False  # result buffers live for the whole call (cost_model/memory.py)
    attention: str | None = None  # a strategy every attention node must take (plan option)

    @functools.cached_property
    def sizes_items(self):
        return tuple(self.axis_sizes.items())

    def wire_itemsize(self, value: Value) -> int:
        """Bytes per element of ``value`` as collectives move it."""
        return self.dtype_wire_itemsize(value.dtype)

    def dtype_wire_itemsize(self, dtype) -> int:
        """Bytes per element of a ``dtype`` array as collectives move it."""
        return wire_itemsize(dtype, self.upcast_16bit_collectives)

    def dot_itemsize(self, dtype) -> int:
        """Bytes per element of a dot operand or result of ``dtype`` as the backend computes
        the dot: float32 for a 16-bit float where :attr:`dots_in_f32`."""
        return wire_itemsize(dtype, self.dots_in_f32)

    def reshard(self, src: Spec, dst: Spec, value: Value) -> tuple[CommStep, ...]:
        if value.recomputable or src == dst:
            return ()
        return plan_redistribute(src, dst, value.shape, self.wire_itemsize(value),
                                 self.sizes_items)

    def reshard_time_s(self, src: Spec, dst: Spec, value: Value) -> float:
        return sum(step.time_s(self.levels) for step in self.reshard(src, dst, value))

    def axis_reshard_time_s(self, axis: str, src_place, dst_place, value: Value) -> float:
        """The time to move one mesh axis from ``src_place`` to ``dst_place``
        (:meth:`Spec.place_of`: its dim and the axes before it there, or None: replicated), as
        if the other axes split the tensor too (used where the joint cost is too costly to
        list). In the same dim after other axes, the axis holds other blocks, and is priced as
        gathered (then sliced, which is free): ``S(model)`` to ``S(data,model)`` (the Llama's
        attention mask on (4, 2)) was free here and 77 us as planned."""
        src_dim = None if src_place is None else src_place[0]
        dst_dim = None if dst_place is None else dst_place[0]
        if src_place != dst_place and src_dim == dst_dim:
            dst_dim = None

        def one(d):
            return Spec(tuple((axis,) if i == d else () for i in range(value.rank)))
        others = math.prod(n for a, n in self.axis_sizes.items() if a != axis)
        total = 0.0
        for step in self.reshard(one(src_dim), one(dst_dim), value):
            if step.kind is not None:
                level = self.levels[axis]
                total += (ring_steps(step.kind, step.group_size) * level.latency_s
                          + step.wire_bytes / others / level.bandwidth_bytes_per_s)
        return total


class RewriteKind(enum.Enum):
    """How a node is emitted when its strategy does not run the primitive as it is
    (``passes.emit.REWRITES`` maps each kind to its emitter)."""
    # passes.overlap.collective_matmul: an operand gathered, or the partial sums scattered,
    # in ring steps each overlapping a chunk's matmul
    ALL_GATHER_MATMUL = "all-gather matmul"
    MATMUL_REDUCE_SCATTER = "matmul reduce-scatter"
    # passes.overlap.prefetch: a scanned input gathered one iteration ahead (emit_scan)
    PREFETCH = "prefetch"
    ULYSSES_ATTENTION = "ulysses"   # passes.sequence_parallel: all-to-all sequence <-> heads
    RING_ATTENTION = "ring"         # passes.sequence_parallel: K/V blocks rotated by ppermute


@dataclass(frozen=True)
class Rewrite:
    """A strategy's emission as a ``jax.shard_map`` region instead of the primitive: its kind,
    the mesh axes the region is manual over, kind-specific settings, and the operands it
    returns moved."""
    kind: RewriteKind
    axes: tuple[str, ...]
    params: tuple[tuple[str, object], ...] = ()
    #: (operand position, spec): operands the region also returns moved to that spec, so that
    #: a later reader of the value in that spec (in the region's jaxpr or one nested in it)
    #: takes it with no move
    keeps: tuple[tuple[int, Spec], ...] = ()


@dataclass(frozen=True)
class Strategy:
    """One way to run a node. With a ``rewrite``, ``collectives`` run beside the node's own
    compute: ``comm_s`` is the part no compute hides, and is what the ILP and the estimate
    charge (the collectives still count for wire bytes)."""
    in_specs: tuple[Spec | None, ...]   # None for a literal operand
    out_specs: tuple[Spec, ...]
    flops: float                        # per device, one run
    compute_s: float
    comm_s: float
    collectives: tuple[CommStep, ...]   # reductions of partial results
    rewrite: Rewrite | None = None      # None: the primitive, its values pinned
    scratch_bytes: int = 0              # per device, held while it runs besides its results

    @property
    def comm_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.collectives)

    @property
    def cost_s(self) -> float:
        return self.compute_s + self.comm_s

    def label(self) -> str:
        ins = ",".join("lit" if s is None else str(s) for s in self.in_specs)
        outs = ",".join(str(s) for s in self.out_specs)
        red = "".join(f" +{c}" for c in self.collectives)
        if self.rewrite is not None:
            red = f" [{self.rewrite.kind.value}({','.join(self.rewrite.axes)})]"
        return f"{outs} <- {ins}{red}"


def _specs_from(assign, ranks, axis_names):
    """assign[axis] is the dim split by that axis per tensor; -> Specs (axes in mesh order)."""
    specs = []
    for t, rank in enumerate(ranks):
        dims = [[] for _ in range(rank)]
        for axis, dims_of in zip(axis_names, assign):
            d = dims_of[t]
            if isinstance(d, int):
                dims[d].append(axis)
        specs.append(Spec(tuple(tuple(d) for d in dims)))
    return specs


def _finishes(partial_axes, spec: Spec, maps_by_id):
    """Ways to finish the partial axes: None (all-reduce) or a result dim (reduce-scatter).
    Only a dim no other axis splits can take a scatter, so the axis order stays the mesh order
    that every other strategy uses, and only a dim the rule allows (DimMap.scatter_to)."""
    free = [d for d, axes in enumerate(spec.dims) if not axes]
    options = []
    for _, source in partial_axes:
        allowed = maps_by_id[source].scatter_to
        options.append([None] + [d for d in free if allowed is None or d in allowed])
    return itertools.product(*options)


def expand(maps: list[DimMap], ctx: RuleContext, mesh: MeshContext):
    """All (in_specs, out_specs, partial) the one-axis maps give on the whole mesh.

    partial: per result, ((axis, source), ...) for the axes holding partial results, where
    source identifies the one-axis map (so the operand dimension) the partial sum comes from.
    """
    n_in, n_out = len(ctx.in_shapes), len(ctx.out_shapes)
    replicate = DimMap((None,) * n_in, (None,) * n_out)
    maps_by_id = {id(m): m for m in maps}
    seen = set()
    for choice in itertools.product([replicate] + maps, repeat=len(mesh.axis_names)):
        assign = [m.ins + m.outs for m in choice]
        ranks = [len(s) for s in ctx.in_shapes] + [len(s) for s in ctx.out_shapes]
        specs = _specs_from(assign, ranks, mesh.axis_names)
        shapes = list(ctx.in_shapes) + list(ctx.out_shapes)
        if not all(spec_fits(s, shp, mesh.axis_sizes) for s, shp in zip(specs, shapes)):
            continue
        in_specs, out_specs = specs[:n_in], specs[n_in:]
        partial = [[(axis, id(m)) for axis, m in zip(mesh.axis_names, choice)
                    if isinstance(m.outs[k], Reduce)] for k in range(n_out)]
        split = math.prod(mesh.axis_sizes[a] for a, m in zip(mesh.axis_names, choice)
                          if m is not replicate)
        for finishes in itertools.product(*[list(_finishes(p, out_specs[k], maps_by_id))
                                            for k, p in enumerate(partial)]):
            if mesh.emulated_reduce_scatter and any(
                    len({d for d in fin if d is not None}) > 1 for fin in finishes):
                continue  # XLA:CPU lowers these inconsistently; GPU/TPU keep them
            final = []
            ok = True
            for k, (spec, fin) in enumerate(zip(out_specs, finishes)):
                dims = [list(d) for d in spec.dims]
                for (axis, _), d in zip(partial[k], fin):
                    if d is not None:
                        dims[d].append(axis)
                dims = [tuple(sorted(d, key=mesh.axis_names.index)) for d in dims]
                spec_k = Spec(tuple(dims))
                ok = ok and spec_fits(spec_k, ctx.out_shapes[k], mesh.axis_sizes)
                final.append(spec_k)
            key = (tuple(in_specs), tuple(final))
            if not ok or key in seen:
                continue
            seen.add(key)
            yield tuple(in_specs), tuple(final), partial, finishes, split, out_specs


def _collectives(partial, finishes, pre_specs, node: Node, graph: Graph, mesh: MeshContext,
                 combined: bool):
    """Reductions of partial results. Axes whose partial sums come from the same split operand
    dimension reduce together: those finished into one result dim in one reduce-scatter, those
    finished whole in one all-reduce; axes from different operand dims reduce separately, as
    XLA's partitioner does. Where the backend emulates reduce-scatter (XLA:CPU), each group is
    one all-reduce of the whole partial result."""
    steps = []
    for k, (p, fin) in enumerate(zip(partial, finishes)):
        if not p:
            continue
        value = graph.values[node.outs[k]]
        local = (math.prod(pre_specs[k].local_shape(value.shape, mesh.axis_sizes))
                 * mesh.wire_itemsize(value))
        groups: dict = {}
        for (axis, source), d in zip(p, fin):
            key = source if mesh.emulated_reduce_scatter else (source, d)
            groups.setdefault(key, (d, []))[1].append(axis)
        scatters = [(d, ax) for d, ax in groups.values() if d is not None
                    and not mesh.emulated_reduce_scatter]
        reduces = [ax for d, ax in groups.values() if d is None or mesh.emulated_reduce_scatter]
        for _, axes in scatters:
            steps.append(reduce_step(CollectiveKind.REDUCE_SCATTER, tuple(axes), local,
                                     mesh.axis_sizes, combined))
            local = steps[-1].out_bytes
        steps += [reduce_step(CollectiveKind.ALL_REDUCE, tuple(axes), local, mesh.axis_sizes,
                              combined) for axes in reduces]
    return tuple(steps)


@dataclass(frozen=True)
class FusionIO:
    """Which of a node's operands and results cross a kernel boundary (XLA fuses elementwise
    and layout ops into their consumers, and into reductions): the bytes its kernel reads
    and writes from memory. None: every operand and result (a kernel of its own)."""
    ins: tuple[bool, ...]
    outs: tuple[bool, ...]


def _fuses(info) -> bool:
    return info.fusible and not info.reducing


def _source(graph: Graph, vid: int) -> Node:
    """The node that computes ``vid``, through free ops (reshapes, broadcasts: no kernel)."""
    node = graph.nodes[graph.producer[vid][0]]
    while node.kind is NodeKind.OP and op_info(node).free and node.ins and node.ins[0] is not None:
        node = graph.nodes[graph.producer[node.ins[0]][0]]
    return node


def _readers(graph: Graph, vid: int, consumers: dict) -> list[Node]:
    """The nodes that read ``vid``, through free ops."""
    out = []
    for w, _ in consumers.get(vid, ()):
        node = graph.nodes[w]
        if node.kind is NodeKind.OP and op_info(node).free and node.outs:
            out += _readers(graph, node.outs[0], consumers)
        else:
            out.append(node)
    return out


def fusion_io(graph: Graph, node: Node, consumers: dict) -> FusionIO | None:
    """The :class:`FusionIO` of ``node``: for a fusible or reducing op that is not free, an
    operand is read from memory unless a fusible op computed it, and a fusible op's result is
    written unless every reader fuses it (fusible or reducing ops); free ops (layout) are seen
    through. None for the rest."""
    info = op_info(node)
    if node.kind is not NodeKind.OP or info.free or not (info.fusible or info.reducing):
        return None

    def fused(n: Node) -> bool:
        return n.kind is NodeKind.OP and (_fuses(op_info(n)) or op_info(n).reducing)

    ins = tuple(vid is not None and not (_source(graph, vid).kind is NodeKind.OP
                                         and _fuses(op_info(_source(graph, vid))))
                for vid in node.ins)
    outs = []
    for vid in node.outs:
        readers = _readers(graph, vid, consumers)
        outs.append(not _fuses(info) or not readers or not all(fused(r) for r in readers))
    return FusionIO(ins, tuple(outs))


def fills_its_operand(graph: Graph, node: Node) -> bool:
    """Whether ``node`` writes in place into a buffer that a broadcast of a scalar fills (a
    scatter-add into zeros, a gradient's usual form): XLA writes the fill as a kernel of its
    own, whose bytes the in-place op pays here."""
    if node.kind is not NodeKind.OP or not op_info(node).in_place or not node.ins \
            or node.ins[0] is None:
        return False
    return recomputable(graph, graph.nodes[graph.producer[node.ins[0]][0]])


def _fused_bytes(io: FusionIO, node: Node, graph: Graph, in_specs, out_specs,
                 sizes: dict) -> float:
    """Per-device bytes the node's kernel moves under ``io`` in these specs."""
    total = 0.0
    for keep, spec, (shape, dtype) in zip(io.ins, in_specs, node.in_avals):
        if keep:
            total += local_bytes(spec or Spec.replicated(len(shape)), shape, itemsize(dtype),
                                 sizes)
    for keep, spec, vid in zip(io.outs, out_specs, node.outs):
        if keep:
            v = graph.values[vid]
            total += local_bytes(spec, v.shape, v.itemsize, sizes)
    return total


#: Primitives that list their own strategies (rewrites such as sequence-parallel attention):
#: primitive -> ``(node, graph, mesh) -> [Strategy]``, filled by the modules that own them.
STRATEGY_BUILDERS: dict = {}


def node_strategies(node: Node, graph: Graph, mesh: MeshContext,
                    io: FusionIO | None = None) -> tuple[list[Strategy], bool]:
    """(strategies, is_fallback) for one node; ``io``: its :func:`fusion_io` (None: it moves
    every operand and result)."""
    if node.kind is NodeKind.OP and node.primitive in STRATEGY_BUILDERS:
        return STRATEGY_BUILDERS[node.primitive](node, graph, mesh), False
    in_shapes = tuple(shape for shape, _ in node.in_avals)
    out_shapes = tuple(graph.values[v].shape for v in node.outs)
    ctx = RuleContext(in_shapes, out_shapes)
    info = op_info(node)
    if info.manual_region:
        return [_manual_region_strategy(node, graph, mesh)], False
    if node.kind is NodeKind.CONST:
        maps, fallback = [], False
    else:
        maps = dim_maps(node, ctx)
        fallback = maps is None
        maps = maps or []
    flops = op_flops(node, ctx)
    dtype = graph.values[node.outs[0]].dtype if node.outs else None
    moved = sum(math.prod(s) * itemsize(d) for s, d in node.in_avals) + sum(
        graph.values[v].nbytes for v in node.outs)
    combined = is_combined_reduction(node, graph)
    fill = fills_its_operand(graph, node)
    out = []
    for in_specs, out_specs, partial, finishes, split, pre in expand(maps, ctx, mesh):
        in_specs = tuple(None if node.ins[i] is None and node.kind is NodeKind.OP else s
                         for i, s in enumerate(in_specs))
        steps = _collectives(partial, finishes, pre, node, graph, mesh, combined)
        f = flops / split
        dims = None
        if info.matmul_dims is not None:
            dims = info.matmul_dims([
                shape if sp is None else sp.local_shape(shape, mesh.axis_sizes)
                for sp, shape in zip(in_specs, in_shapes)], **node.params)
        moved_local = moved / split if io is None else _fused_bytes(
            io, node, graph, in_specs, out_specs, mesh.axis_sizes)
        if info.contraction or io is None:  # a dot runs at its matmul efficiency
            compute_s = roofline_s(f, moved_local, mesh.profile, dtype,
                                   contraction=info.contraction, dims=dims) if flops else 0.0
        else:
            compute_s = memory_bound_s(f, moved_local, mesh.profile, dtype)
        if fill:
            compute_s += memory_bound_s(0.0, local_bytes(in_specs[0], in_shapes[0], itemsize(
                node.in_avals[0][1]), mesh.axis_sizes), mesh.profile, dtype)
        out.append(Strategy(in_specs, out_specs, f, compute_s,
                            sum(s.time_s(mesh.levels) for s in steps), steps))
    assert out, f"no strategy for {node.prim}: replicate is always possible"
    return out, fallback


def _manual_region_strategy(node: Node, graph: Graph, mesh: MeshContext) -> Strategy:
    """The one strategy of a `jax.shard_map` region: operands and results in the specs its
    ``in_specs``/``out_specs`` give over its manual axes and, over the others, in the spec
    its body holds them in on entry or exit (a sharding constraint applied to the operand
    itself, or producing the result: what a pipeline stage's plan asks), else replicated.
    Its collectives are the sums its body ends with (:func:`_region_sums`); its compute and
    the rest of its communication are not priced here (a pipeline's are added to the
    estimate by its caller)."""
    entry, exit_ = _body_constraints(node.params["jaxpr"])
    ins = tuple(None if vid is None else _merged(pspec, entry.get(i), len(shape))
                for i, (vid, pspec, (shape, _)) in enumerate(zip(node.ins, node.params["in_specs"],
                                                                node.in_avals)))
    outs = tuple(_merged(pspec, exit_.get(i), graph.values[v].rank)
                 for i, (v, pspec) in enumerate(zip(node.outs, node.params["out_specs"])))
    steps = _region_sums(node.params["jaxpr"], mesh)
    return Strategy(ins, outs, 0.0, 0.0, sum(s.time_s(mesh.levels) for s in steps), steps)


#: Primitives that sum over mesh axes inside a manual region.
_SUMS = frozenset({"psum", "psum_invariant"})


def _region_sums(body, mesh: MeshContext) -> tuple[CommStep, ...]:
    """The all-reduces of the sums at the top level of a region's body, run once a call (a
    pipeline's: the loss, the stack input's cotangent and the gradients of what the stages
    share, summed over the stage axis). An operand counts at its size over the axes the body
    does not hold manual (the region's view: replicated over them), split as a sharding
    constraint on the sum's result, if any, splits it."""
    jaxpr = getattr(body, "jaxpr", body)
    constrained = {eqn.invars[0]: eqn.params["sharding"].spec for eqn in jaxpr.eqns
                   if eqn.primitive.name == "sharding_constraint"
                   and hasattr(eqn.params["sharding"], "spec")}
    steps = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _SUMS:
            continue
        axes = tuple(a for a in eqn.params["axes"] if a in mesh.axis_sizes)
        if not axes:   # over positional axes only (vmap's): no mesh axis, nothing moves
            continue
        for operand, result in zip(eqn.invars, eqn.outvars, strict=True):
            shape = tuple(operand.aval.shape)
            spec = Spec.from_partition_spec(constrained.get(result), len(shape))
            nbytes = local_bytes(spec, shape, itemsize(operand.aval.dtype), mesh.axis_sizes)
            steps.append(reduce_step(CollectiveKind.ALL_REDUCE, axes, nbytes, mesh.axis_sizes))
    return tuple(steps)


def _body_constraints(body) -> tuple[dict[int, object], dict[int, object]]:
    """(operand index -> the PartitionSpec a sharding constraint on it gives, result index ->
    the one of the constraint producing it) in a region's body. An operand constrained
    nowhere at the top of the body takes the first constraint on it inside a loop or call it
    enters whole (a loop's constant, a call's argument: the backward region of an autodiffed
    pipeline reads a stage's weights so, held where each tick runs the stage)."""
    jaxpr = getattr(body, "jaxpr", body)
    ins = {v: i for i, v in enumerate(jaxpr.invars)}
    outs = {v: i for i, v in enumerate(jaxpr.outvars) if not isinstance(v, jcore.Literal)}
    entry, exit_ = {}, {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "sharding_constraint":
            continue
        spec = getattr(eqn.params["sharding"], "spec", None)
        if eqn.invars[0] in ins:
            entry.setdefault(ins[eqn.invars[0]], spec)
        if eqn.outvars[0] in outs:
            exit_[outs[eqn.outvars[0]]] = spec
    for var, i in ins.items():
        if i not in entry:
            spec = _first_constraint(jaxpr, var)
            if spec is not None:
                entry[i] = spec
    return entry, exit_


#: How deep :func:`_first_constraint` follows an operand into nested loops and calls.
_MAX_NESTING = 4


def _first_constraint(jaxpr, var, depth: int = 0):
    """The spec of the first sharding constraint on ``var`` in ``jaxpr``, following it into
    the loops and calls it enters whole (:func:`_entered`); None if there is none."""
    for eqn in jaxpr.eqns:
        for position, v in enumerate(eqn.invars):
            if v is not var:
                continue
            if eqn.primitive.name == "sharding_constraint":
                return getattr(eqn.params["sharding"], "spec", None)
            inner = _entered(eqn, position) if depth < _MAX_NESTING else None
            if inner is not None:
                spec = _first_constraint(inner[0], inner[0].invars[inner[1]], depth + 1)
                if spec is not None:
                    return spec
    return None


def _entered(eqn, position: int):
    """(sub-jaxpr, its operand index) where ``eqn``'s operand ``position`` enters whole: a
    ``scan``'s or ``while``'s loop constant, or the argument of a call that tracing inlines
    (:data:`.trace.CALLS`: jit, checkpoint, custom derivatives); None otherwise (a scanned
    slice, a carry, a branch, a nested region)."""
    name, params = eqn.primitive.name, eqn.params
    if name == "scan":
        found = (params["jaxpr"], position) if position < scan_counts(params)[0] else None
    elif name == "while":
        first = params["cond_nconsts"]
        found = ((params["body_jaxpr"], position - first)
                 if first <= position < first + params["body_nconsts"] else None)
    elif eqn.primitive in CALLS:
        found = (call_body(eqn)[0], position)
    else:
        found = None
    if found is None:
        return None
    sub = getattr(found[0], "jaxpr", found[0])
    return (sub, found[1]) if len(sub.invars) > found[1] else None


def _merged(manual, auto, rank: int) -> Spec:
    """The spec of manual ``PartitionSpec`` ``manual`` with ``auto``'s axes after it per dim."""
    a = Spec.from_partition_spec(manual, rank)
    if auto is None:
        return a
    b = Spec.from_partition_spec(auto, rank)
    return Spec(tuple(x + y for x, y in zip(a.dims, b.dims, strict=True)))


def build_strategies(graph: Graph, mesh: MeshContext, keys: list[tuple] | None = None
                     ) -> tuple[list[list[Strategy]], dict]:
    """Strategies for every node, and the primitives that fell back to replicated.

    ``keys``: :func:`passes.dedup.node_keys` of the graph (computed when left out). Nodes with
    equal keys (the copies of a repeated layer) share one strategy list, built once.
    """
    all_strats, fallbacks = [], {}
    keys = dedup.node_keys(graph) if keys is None else keys
    built: dict[tuple, tuple[list[Strategy], bool]] = {}
    consumers = graph.consumers()
    for node, key in zip(graph.nodes, keys):
        if recomputable(graph, node):
            for vid in node.outs:
                graph.values[vid] = dataclasses.replace(graph.values[vid], recomputable=True)
        io = fusion_io(graph, node, consumers)
        key = (key, io, fills_its_operand(graph, node))
        if key not in built:
            built[key] = node_strategies(node, graph, mesh, io)
        strats, fallback = built[key]
        if node.pinned is not None:
            kept = _pin(strats, node.pinned)
            if not kept:
                raise ShardingHintError(
                    f"cannot keep the sharding {', '.join(map(str, node.pinned))} pinned on "
                    f"`{node.prim}` at {node.where or 'the program boundary'}: no strategy of "
                    "that op produces it. Pin a sharding of a dimension the op keeps whole.")
            strats = kept
        all_strats.append(strats)
        if fallback:
            fallbacks[node.prim] = fallbacks.get(node.prim, 0) + 1
    for prim, count in sorted(fallbacks.items()):
        warn(f"autopar: no sharding rule for primitive `{prim}` ({count} use(s)); planned "
             "replicated. The plan is correct but may be slow there.",
             UnsupportedPrimitiveWarning)
    return all_strats, fallbacks


def _pin(strats: list[Strategy], pinned: tuple[Spec, ...]) -> list[Strategy]:
    return [s for s in strats if (s.out_specs or s.in_specs) == pinned]
