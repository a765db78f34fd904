"""Reductions and scans along a dimension."""

from autopar.passes.rules import DimMap, Reduce, RuleContext, register

_KIND = {"reduce_sum": Reduce.SUM, "reduce_max": Reduce.MAX, "reduce_min": Reduce.MIN,
         "reduce_prod": Reduce.PROD, "reduce_and": Reduce.ANY, "reduce_or": Reduce.ANY,
         "reduce_xor": Reduce.ANY}


def _kept(rank, axes):
    return [d for d in range(rank) if d not in axes]


def _reduce_rule(kind):
    def rule(ctx: RuleContext, *, axes, **_):
        kept = _kept(len(ctx.in_shapes[0]), axes)
        maps = [DimMap((d,), (kept.index(d),)) for d in kept]
        return maps + [DimMap((d,), (kind,)) for d in axes]
    return rule


for _prim, _kind in _KIND.items():
    register(_prim)(_reduce_rule(_kind))


@register("argmax", "argmin")
def arg_reduce(ctx: RuleContext, *, axes, **_):
    # A split reduced dimension would need an index offset per shard: not offered.
    kept = _kept(len(ctx.in_shapes[0]), axes)
    return [DimMap((d,), (kept.index(d),)) for d in kept]


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative(ctx: RuleContext, *, axis, **_):
    return [DimMap((d,), (d,)) for d in range(len(ctx.in_shapes[0])) if d != axis]


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")
def reduce_window(ctx: RuleContext, *, window_dimensions, window_strides, **_):
    rank = len(ctx.in_shapes[0])
    n_in = len(ctx.in_shapes)
    return [DimMap((d,) * n_in if n_in == 1 else (d,) + (None,) * (n_in - 1),
                   (d,) * len(ctx.out_shapes))
            for d in range(rank) if window_dimensions[d] == 1 and window_strides[d] == 1]


@register("select_and_scatter_add", "select_and_gather_add")
def select_window(ctx: RuleContext, *, window_dimensions, window_strides, **_):
    rank = len(ctx.out_shapes[0])
    return [DimMap((d,) * len(ctx.in_shapes), (d,))
            for d in range(rank) if window_dimensions[d] == 1 and window_strides[d] == 1]
