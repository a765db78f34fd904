"""The sharding rule registry: one rule per primitive, one file per family.

A rule says how ONE mesh axis may split an operation. It returns a list of :class:`DimMap`:
for each operand, the dimension that axis splits (or None: the operand is replicated over the
axis), and for each result the dimension it splits, None, or a :class:`Reduce` kind when each
device holds a partial result that must be reduced over the axis (a split contracting
dimension, a split reduced dimension). "Replicate over this axis" is always allowed and is not
listed. ``passes.strategies`` expands these one-axis maps over every axis of an N-D mesh.

A primitive with no rule gets the replicated fallback, named in a warning and in the report.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable


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
_RULES: dict[str, Rule] = {}


def register(*prims: str) -> Callable[[Rule], Rule]:
    def deco(rule: Rule) -> Rule:
        for prim in prims:
            assert prim not in _RULES, f"two rules for {prim}"
            _RULES[prim] = rule
        return rule
    return deco


def dim_maps(prim: str, ctx: RuleContext, params: dict[str, Any]) -> list[DimMap] | None:
    """The one-axis maps of a primitive, or None when it has no rule (replicated fallback)."""
    rule = _RULES.get(prim)
    return None if rule is None else rule(ctx, **params)


# The families register themselves on import.
from autopar.passes.rules import (  # noqa: E402,F401
    control, dot, elementwise, gather, random, reduction, shape)
