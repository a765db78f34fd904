"""Reductions and scans along a dimension: one flop per operand element, as XLA counts them."""

import math

from jax import lax

from autopar.passes.rules import DimMap, Reduce, RuleContext, mark, register

_KIND = {lax.reduce_sum_p: Reduce.SUM, lax.reduce_max_p: Reduce.MAX,
         lax.reduce_min_p: Reduce.MIN, lax.reduce_prod_p: Reduce.PROD,
         lax.reduce_and_p: Reduce.ANY, lax.reduce_or_p: Reduce.ANY, lax.reduce_xor_p: Reduce.ANY}


def in_elements(ctx: RuleContext, **_) -> float:
    return float(math.prod(ctx.in_shapes[0]))


def _kept(rank, axes):
    return [d for d in range(rank) if d not in axes]


def _reduce_rule(kind):
    def rule(ctx: RuleContext, *, axes, **_):
        kept = _kept(len(ctx.in_shapes[0]), axes)
        maps = [DimMap((d,), (kept.index(d),)) for d in kept]
        return maps + [DimMap((d,), (kind,)) for d in axes]
    return rule


for _prim, _kind in _KIND.items():
    register(_prim, flops=in_elements)(_reduce_rule(_kind))
# Their partial results need a collective of their own (passes.reductions).
mark(*_KIND, reducing=True)
# An XLA:CPU library (YNNPACK) fusion starts at each of them (passes.liveness).
mark(lax.reduce_sum_p, lax.reduce_max_p, lax.reduce_min_p, lax.reduce_prod_p, library=True)


@register(lax.argmax_p, lax.argmin_p, flops=in_elements, reducing=True)
def arg_reduce(ctx: RuleContext, *, axes, **_):
    # A split reduced dimension would need an index offset per shard: not offered.
    kept = _kept(len(ctx.in_shapes[0]), axes)
    return [DimMap((d,), (kept.index(d),)) for d in kept]


@register(lax.cumsum_p, lax.cumprod_p, lax.cummax_p, lax.cummin_p, lax.cumlogsumexp_p,
          flops=in_elements, reducing=True)
def cumulative(ctx: RuleContext, *, axis, **_):
    return [DimMap((d,), (d,)) for d in range(len(ctx.in_shapes[0])) if d != axis]


@register(lax.reduce_window_sum_p, lax.reduce_window_max_p, lax.reduce_window_min_p,
          lax.reduce_window_p, flops=in_elements)
def reduce_window(ctx: RuleContext, *, window_dimensions, window_strides, **_):
    rank = len(ctx.in_shapes[0])
    n_in = len(ctx.in_shapes)
    return [DimMap((d,) * n_in if n_in == 1 else (d,) + (None,) * (n_in - 1),
                   (d,) * len(ctx.out_shapes))
            for d in range(rank) if window_dimensions[d] == 1 and window_strides[d] == 1]


@register(lax.select_and_scatter_add_p, lax.select_and_gather_add_p)
def select_window(ctx: RuleContext, *, window_dimensions, window_strides, **_):
    rank = len(ctx.out_shapes[0])
    return [DimMap((d,) * len(ctx.in_shapes), (d,))
            for d in range(rank) if window_dimensions[d] == 1 and window_strides[d] == 1]
