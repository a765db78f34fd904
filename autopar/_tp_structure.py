"""Tensor-parallel structure read from a traced program, not from parameter names.

Walking the jaxpr in program order (the forward pass comes first), each weight (a leaf of the
first argument, through casts and transposes) is classed by the first ``dot_general`` that
consumes it:

* column-parallel: its input is not split; the weight's first free dim is split, and so is
  the result's matching dim (the split then follows the values: elementwise ops, reshapes,
  transposes, reductions over other dims, dots that carry it as a batch or free dim);
* row-parallel: its input arrives split on a contracted dim; the weight's matching dim is
  split, and the result is whole again (a partial sum);
* expert: a weight dim that is a batch dim of its dot (one matrix per expert).

Column weights are kept only when their split reaches a row-parallel weight (Megatron pairs),
or, for the vocab-parallel variant, when their split dim is the vocabulary (the size of the
table an embedding lookup gathers from). A bias takes its column weight's split when the
first elementwise op it meets adds it to that weight's split result.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import jax
from jax.extend import core as jex_core

from autopar._compat import scan_counts


class Role(enum.Enum):
    COLUMN = "column"
    ROW = "row"
    BIAS = "bias"
    EMBEDDING = "embedding"


@dataclass
class Structure:
    """Per leaf of the parameters (flat index): its role and the leaf dim that role splits;
    ``expert_dims``: leaf -> its expert dim; ``vocab``: the embedding table's vocab size."""
    roles: dict[int, tuple[Role, int]] = field(default_factory=dict)
    expert_dims: dict[int, int] = field(default_factory=dict)
    vocab: int | None = None
    paired: set = field(default_factory=set)  # column and row weights of Megatron pairs
    bias_sources: dict = field(default_factory=dict)  # bias leaf -> the weights it follows
    _free_size: dict[int, int] = field(default_factory=dict)  # column leaf -> split dim size

    def megatron_dim(self, leaf: int, vocab_parallel: bool) -> int | None:
        """The leaf dim a Megatron baseline splits over the model axis, or None."""
        role = self.roles.get(leaf)
        if role is None:
            return None
        kind, dim = role
        if kind is Role.BIAS:  # as its weight is
            weights = self.bias_sources.get(leaf, ())
            return dim if any(self.megatron_dim(w, vocab_parallel) is not None
                              for w in weights) else None
        if kind is Role.EMBEDDING:
            return dim if vocab_parallel else None
        vocab_out = (leaf not in self.paired and self.vocab is not None
                     and self._free_size.get(leaf) == self.vocab)
        if kind is Role.COLUMN and vocab_out:
            return dim if vocab_parallel else None
        return dim


@dataclass(frozen=True)
class _Origin:
    leaf: int
    dims: tuple  # for each dim of the value, the leaf dim it is (or None)


@dataclass(frozen=True)
class _Tag:
    dim: int             # the value's dim split over the model axis
    sources: frozenset   # the column weights whose split it is


_TRANSPARENT = {"convert_element_type", "copy", "copy_p", "reduce_precision",
                "sharding_constraint", "optimization_barrier"}
_REDUCE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
           "reduce_and", "reduce_or"}


class _Walker:
    def __init__(self):
        self.origin: dict = {}
        self.tag: dict = {}
        self.s = Structure()
        self.tentative: dict[int, tuple[Role, int]] = {}
        self.paired: set[int] = set()
        self.bias_of: dict[int, tuple[int, frozenset]] = {}
        self.seen_elementwise: set[int] = set()
        self.tables: dict[int, tuple[int, int]] = {}  # gathered from: leaf -> (dim, size)

    # ----- values
    def get(self, table, atom):
        return table.get(atom) if isinstance(atom, jex_core.Var) else None

    def walk(self, jaxpr) -> None:
        for eqn in jaxpr.eqns:
            self.eqn(eqn)

    def eqn(self, eqn) -> None:
        name = eqn.primitive.name
        for out in eqn.outvars:  # a jaxpr walked again (a shared call body): forget the last
            self.tag.pop(out, None)
            self.origin.pop(out, None)
        if name == "dot_general":
            return self.dot(eqn)
        if name == "gather":
            return self.gather(eqn)
        if name == "scan":
            return self.scan(eqn)
        if name == "cond":
            return self.cond(eqn)
        inner = _inner(eqn)
        if inner is not None and len(inner.invars) == len(eqn.invars):
            return self.call(inner, eqn.invars, eqn.outvars)
        self.origins(eqn, name)
        self.tags(eqn, name)

    def call(self, inner, invars, outvars) -> None:
        self._bind(invars, inner.invars)
        self.walk(inner)
        self._bind(inner.outvars, outvars)

    def _bind(self, srcs, dsts) -> None:
        for src, dst in zip(srcs, dsts):
            for table in (self.origin, self.tag):
                v = self.get(table, src)
                if v is not None:
                    table[dst] = v
                elif isinstance(dst, jex_core.Var):
                    table.pop(dst, None)

    def scan(self, eqn) -> None:
        p = eqn.params
        body = p["jaxpr"].jaxpr
        n_consts, n_carry = scan_counts(p)
        for i, (outer, var) in enumerate(zip(eqn.invars, body.invars)):
            o, t = self.get(self.origin, outer), self.get(self.tag, outer)
            if i >= n_consts + n_carry:  # xs: the body sees one slice of the leading dim
                o = o and _Origin(o.leaf, o.dims[1:])
                t = t and (_Tag(t.dim - 1, t.sources) if t.dim > 0 else None)
            self.origin.pop(var, None)
            self.tag.pop(var, None)
            if o:
                self.origin[var] = o
            if t:
                self.tag[var] = t
        self.walk(body)
        for i, (var, outer) in enumerate(zip(body.outvars, eqn.outvars)):
            t = self.get(self.tag, var)
            if t and i >= n_carry:  # ys: stacked along a new leading dim
                t = _Tag(t.dim + 1, t.sources)
            if t:
                self.tag[outer] = t

    def cond(self, eqn) -> None:
        for branch in eqn.params["branches"]:
            self.call(branch.jaxpr, eqn.invars[1:], eqn.outvars)

    # ----- weights through casts and transposes
    def origins(self, eqn, name) -> None:
        o = self.get(self.origin, eqn.invars[0]) if eqn.invars else None
        if o is None or len(eqn.outvars) != 1:
            return
        out = eqn.outvars[0]
        if name in _TRANSPARENT:
            self.origin[out] = o
        elif name == "transpose":
            self.origin[out] = _Origin(o.leaf, tuple(o.dims[d] for d in eqn.params["permutation"]))
        elif name == "broadcast_in_dim":
            dims = [None] * len(out.aval.shape)
            for src, dst in enumerate(eqn.params["broadcast_dimensions"]):
                dims[dst] = o.dims[src]
            self.origin[out] = _Origin(o.leaf, tuple(dims))
        elif name == "squeeze":
            gone = set(eqn.params["dimensions"])
            self.origin[out] = _Origin(o.leaf, tuple(d for i, d in enumerate(o.dims)
                                                     if i not in gone))
        elif name == "reshape":  # only size-1 dims added or dropped: the others keep their leaf
            big_in = [d for d, n in zip(o.dims, eqn.invars[0].aval.shape) if n != 1]
            big_out = [i for i, n in enumerate(out.aval.shape) if n != 1]
            if [n for n in eqn.invars[0].aval.shape if n != 1] == [out.aval.shape[i]
                                                                   for i in big_out]:
                dims = [None] * len(out.aval.shape)
                for i, d in zip(big_out, big_in):
                    dims[i] = d
                self.origin[out] = _Origin(o.leaf, tuple(dims))

    # ----- the split, as it follows the values
    def tags(self, eqn, name) -> None:
        ins = [self.get(self.tag, v) for v in eqn.invars]
        src = next((i for i, x in enumerate(ins) if x is not None), None)
        if src is None:
            return self.first_elementwise(eqn, None)
        t = ins[src]
        both = frozenset().union(*(x.sources for x in ins if x is not None and x.dim == t.dim))
        t = _Tag(t.dim, both)  # gate * up: both columns feed what follows
        for out in eqn.outvars:
            moved = _moved(eqn, name, eqn.invars[src], out, t.dim)
            if moved is not None:
                self.tag[out] = _Tag(moved, t.sources)
        self.first_elementwise(eqn, t)

    def first_elementwise(self, eqn, t) -> None:
        """A bias: the first elementwise op a weight meets, beside a column's split result."""
        shapes = {tuple(v.aval.shape) for v in eqn.invars if hasattr(v, "aval")}
        if (len(eqn.invars) < 2 or len(eqn.outvars) != 1  # a cast or a copy is not a use
                or tuple(eqn.outvars[0].aval.shape) not in shapes):
            return
        for v in eqn.invars:
            o = self.get(self.origin, v)
            if o is None or o.leaf in self.seen_elementwise:
                continue
            self.seen_elementwise.add(o.leaf)
            if t is not None and o.leaf not in self.tentative and t.dim < len(o.dims):
                if o.dims[t.dim] is not None and self.get(self.tag, v) is None:
                    self.bias_of[o.leaf] = (o.dims[t.dim], t.sources)

    def gather(self, eqn) -> None:
        o = self.get(self.origin, eqn.invars[0])
        if o is None:
            return self.tags(eqn, "gather")
        indexed = eqn.params["dimension_numbers"].start_index_map
        if indexed and o.dims[indexed[0]] is not None:
            self.tables[o.leaf] = (o.dims[indexed[0]], eqn.invars[0].aval.shape[indexed[0]])

    def dot(self, eqn) -> None:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars
        lo, ro = self.get(self.origin, lhs), self.get(self.origin, rhs)
        out = eqn.outvars[0]
        if (lo is None) == (ro is None):  # two activations (or two weights)
            tag = _dot_tag(self.get(self.tag, lhs), self.get(self.tag, rhs), lhs, rhs,
                           (lc, rc), (lb, rb))
            if tag is not None:
                self.tag[out] = tag
            return
        w_is_lhs = lo is not None
        w, o, a = (lhs, lo, rhs) if w_is_lhs else (rhs, ro, lhs)
        wc, ac = (lc, rc) if w_is_lhs else (rc, lc)
        wb, ab = (lb, rb) if w_is_lhs else (rb, lb)
        rank_w = len(w.aval.shape)
        w_free = [d for d in range(rank_w) if d not in wc and d not in wb]
        a_free_n = len(a.aval.shape) - len(ac) - len(ab)

        def out_pos(wdim):  # where a weight dim lands in the result
            if wdim in wb:
                return list(wb).index(wdim)
            base = len(wb) + (0 if w_is_lhs else a_free_n)
            return base + w_free.index(wdim)

        for d in wb:
            if o.dims[d] is not None:
                self.s.expert_dims.setdefault(o.leaf, o.dims[d])
        known = self.tentative.get(o.leaf)
        if known is not None:
            wdim = next((i for i, d in enumerate(o.dims) if d == known[1]), None)
            if wdim is not None and wdim not in wc:
                self.tag[out] = _Tag(out_pos(wdim), frozenset({o.leaf}))
            return
        at = self.get(self.tag, a)
        if at is not None and at.dim in ac:
            wdim = wc[list(ac).index(at.dim)]
            if o.dims[wdim] is not None:
                self.tentative[o.leaf] = (Role.ROW, o.dims[wdim])
                self.paired |= set(at.sources) | {o.leaf}
            return
        wdim = next((d for d in w_free if o.dims[d] is not None), None)
        if wdim is None:
            return
        self.tentative[o.leaf] = (Role.COLUMN, o.dims[wdim])
        self.s._free_size[o.leaf] = w.aval.shape[wdim]
        self.tag[out] = _Tag(out_pos(wdim), frozenset({o.leaf}))

    def finish(self) -> Structure:
        s = self.s
        if self.tables:  # the vocabulary: the largest table an embedding lookup reads
            s.vocab = max(size for _, size in self.tables.values())
            for leaf, (dim, size) in self.tables.items():
                if size == s.vocab:
                    s.roles[leaf] = (Role.EMBEDDING, dim)
        s.paired = self.paired
        for leaf, (kind, dim) in self.tentative.items():
            vocab_out = s.vocab is not None and s._free_size.get(leaf) == s.vocab
            if kind is Role.ROW or leaf in self.paired or vocab_out:
                s.roles.setdefault(leaf, (kind, dim))
        for leaf, (dim, sources) in self.bias_of.items():
            if leaf not in s.roles and any(s.roles.get(src, (None,))[0] is Role.COLUMN
                                           for src in sources):
                s.roles[leaf] = (Role.BIAS, dim)
                s.bias_sources[leaf] = frozenset(src for src in sources if src in s.roles)
        return s


def _inner(eqn):
    """The jaxpr of a call-like equation (jit, custom_jvp/vjp, remat, closed_call), or None."""
    p = eqn.params
    inner = p.get("jaxpr", p.get("call_jaxpr", p.get("fun_jaxpr")))
    if inner is None:
        return None
    return getattr(inner, "jaxpr", inner)


def _moved(eqn, name, src, out, dim) -> int | None:
    """Where dim ``dim`` of ``src`` lands in ``out`` through ``eqn``, or None (gone)."""
    in_shape, out_shape = tuple(src.aval.shape), tuple(out.aval.shape)
    if name == "transpose":
        return list(eqn.params["permutation"]).index(dim)
    if name == "broadcast_in_dim":
        return eqn.params["broadcast_dimensions"][dim]
    if name in _REDUCE or name == "squeeze":
        axes = eqn.params.get("axes", eqn.params.get("dimensions", ()))
        return None if dim in axes else dim - sum(a < dim for a in axes)
    if name == "reshape":
        before = math.prod(in_shape[:dim])
        for j in range(len(out_shape)):
            if math.prod(out_shape[:j]) == before and out_shape[j] > 1:
                return j
        return None
    if len(in_shape) == len(out_shape) and dim < len(out_shape):
        return dim
    return None


def _dot_tag(lt, rt, lhs, rhs, contract, batch) -> _Tag | None:
    """The split of a dot of two activations: a batch or free dim carries it on."""
    (lc, rc), (lb, rb) = contract, batch
    l_free = [d for d in range(len(lhs.aval.shape)) if d not in lc and d not in lb]
    r_free = [d for d in range(len(rhs.aval.shape)) if d not in rc and d not in rb]
    for t, c, b, free, base in ((lt, lc, lb, l_free, len(lb)),
                                (rt, rc, rb, r_free, len(lb) + len(l_free))):
        if t is None or t.dim in c:
            continue
        sources = t.sources | (lt.sources if lt else frozenset()) | (rt.sources if rt
                                                                     else frozenset())
        pos = list(b).index(t.dim) if t.dim in b else base + free.index(t.dim)
        return _Tag(pos, sources)
    return None


def structure_of_jaxpr(closed, num_params: int) -> Structure:
    """The tensor-parallel structure of a closed jaxpr whose first ``num_params`` inputs are
    the parameters' leaves."""
    w = _Walker()
    for i, var in enumerate(closed.jaxpr.invars[:num_params]):
        w.origin[var] = _Origin(i, tuple(range(len(var.aval.shape))))
    w.walk(closed.jaxpr)
    return w.finish()


def structure_of(fn, args) -> Structure:
    """The tensor-parallel structure of ``fn(*args)`` (``args[0]``: the parameters)."""
    closed = jax.make_jaxpr(fn)(*args)
    return structure_of_jaxpr(closed, len(jax.tree_util.tree_leaves(args[0])))
