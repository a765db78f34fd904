"""The op-info registry: one :class:`OpInfo` per jax primitive, one file per family.

The registry is keyed by the ``Primitive`` object, not its name (names differ between jax
versions; objects are what the jaxpr holds). :func:`op_info` answers for a graph node: an
operation by its primitive, a boundary node (input, output, carry, ...) by its kind.

An OpInfo holds the primitive's sharding rule. A rule says how ONE mesh axis may split an
operation. It returns a list of :class:`DimMap`: for each operand, the dimension that axis
splits (or None: the operand is replicated over the axis), and for each result the dimension
it splits, None, or a :class:`Reduce` kind when each device holds a partial result that must be
reduced over the axis (a split contracting dimension, a split reduced dimension). "Replicate
over this axis" is always allowed and is not listed. ``passes.strategies`` expands these
one-axis maps over every axis of an N-D mesh. A primitive with no rule gets the replicated
fallback, named in a warning and in the report.

Families register with ``@register(lax.add_p, ..., fusible=True)`` on the rule, and add a flag
that cuts across rules with :func:`mark`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any, Callable

from autopar.passes.ir import Node, NodeKind


class Reduce(enum.Enum):
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    ANY = "any"  # logical reductions: cost like a sum


@dataclass(frozen=True)
class DimMap:
    ins: tuple[int | None, ...]
    outs: tuple[int | None | Reduce, ...]
    # For a map leaving partial results: the result dims a reduce-scatter may finish them into
    # (None: any dim no other axis splits).
    scatter_to: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RuleContext:
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]

    @property
    def out_rank(self) -> int:
        return len(self.out_shapes[0])


Rule = Callable[..., list[DimMap]]
#: (ctx, **params) -> floating-point operations of one application on the whole tensors.
Flops = Callable[..., float]


def out_elements(ctx: RuleContext, **_) -> float:
    """One flop per result element: arithmetic, as XLA's cost analysis counts it."""
    return float(sum(math.prod(s) for s in ctx.out_shapes))


@dataclass(frozen=True)
class OpInfo:
    """Everything the planner knows about one primitive (or boundary node kind)."""
    rule: Rule | None = None          # None: no rule, planned replicated
    flops: Flops = out_elements       # counted as XLA's cost analysis counts them
    free: bool = False                # data movement or bookkeeping: no compute at all
    elementwise: bool = False         # every dim splits alike on every operand (size-1 broadcast)
    fusible: bool = False             # XLA fuses it into fusible consumers
    expensive: bool = False           # transcendental: a fusion does not recompute it per reader
    library: bool = False             # starts an XLA:CPU library (YNNPACK) fusion
    library_elementwise: bool = False  # a library fusion takes it in
    in_place: bool = False            # the result is written into the first operand's buffer
    aliasing: bool = False            # the result IS its operand's buffer
    reducing: bool = False            # a reduction, as passes.reductions counts them: the
                                      # partial results it leaves need a collective of their own
    follower: bool = False            # cluster merges it into its operand's producer's decision
    same_tensor: bool = False         # operands and results are one tensor in one layout:
                                      # annotations meeting there unmet are a conflict
    forward_only: bool = False        # propagation crosses it forward before the pass-through round
    contraction: bool = False         # a dot or convolution: runs at matmul efficiency
    gather_scatter: bool = False      # XLA partitions it by its operand's sharding
    pin_param: str | None = None      # the parameter holding the sharding it pins its result to
    manual_region: bool = False       # a shard_map: its operands and results take the specs its
                                      # in_specs/out_specs name, replicated over the other axes
    # (local operand shapes, **params) -> (M, N, K) of one device's matmul, for dots
    matmul_dims: Callable[..., tuple[int, int, int]] | None = None


#: What an unregistered primitive gets: no rule (replicated), its results' elements in flops.
UNKNOWN = OpInfo()
_OPS: dict[Any, OpInfo] = {}
_BOUNDARY: dict[NodeKind, OpInfo] = {NodeKind.CONST: OpInfo(free=True)}


def register(*prims, **fields) -> Callable[[Rule], Rule]:
    """Decorator: ``rule`` (with ``fields`` of :class:`OpInfo`) for each of ``prims``, which
    are jax primitives (None, for one this jax version lacks, is skipped) or boundary
    :class:`NodeKind` s."""
    def deco(rule: Rule) -> Rule:
        for prim in prims:
            if prim is None:
                continue
            table = _BOUNDARY if isinstance(prim, NodeKind) else _OPS
            assert prim not in table, f"two rules for {prim}"
            table[prim] = OpInfo(rule=rule, **fields)
        return rule
    return deco


def mark(*prims, **fields) -> None:
    """Set ``fields`` on registered ``prims`` (None skipped): a flag that cuts across rules."""
    for prim in prims:
        if prim is not None:
            _OPS[prim] = dataclasses.replace(_OPS[prim], **fields)


def info_of(prim) -> OpInfo:
    """The OpInfo of a jax primitive (:data:`UNKNOWN` when it has none)."""
    return _OPS.get(prim, UNKNOWN)


def op_info(node: Node) -> OpInfo:
    """The OpInfo of a graph node: its primitive's, or its boundary kind's."""
    if node.kind is NodeKind.OP:
        return _OPS.get(node.primitive, UNKNOWN)
    return _BOUNDARY[node.kind]


def registered() -> dict[Any, OpInfo]:
    """Every registered primitive and its OpInfo."""
    return dict(_OPS)


def dim_maps(node: Node, ctx: RuleContext) -> list[DimMap] | None:
    """The one-axis maps of a node, or None when it has no rule (replicated fallback)."""
    rule = op_info(node).rule
    return None if rule is None else rule(ctx, **node.params)


def op_flops(node: Node, ctx: RuleContext) -> float:
    """Floating-point operations of one application of ``node``, on the whole (unsplit)
    tensors: 2 per multiply-add in contractions, one per output element for arithmetic, one
    per input element for reductions; data movement is free."""
    info = op_info(node)
    return 0.0 if info.free else info.flops(ctx, **node.params)


# The families register themselves on import.
from autopar.passes.rules import (  # noqa: E402,F401
    attention, control, dot, elementwise, gather, random, reduction, shape)
