"""Shape and data-movement primitives: a dimension splits when it moves through unchanged."""

from autopar.passes.rules import DimMap, RuleContext, register


@register("broadcast_in_dim")
def broadcast_in_dim(ctx: RuleContext, *, shape, broadcast_dimensions, **_):
    operand = ctx.in_shapes[0]
    maps = []
    for d in range(len(shape)):
        src = broadcast_dimensions.index(d) if d in broadcast_dimensions else None
        same = src is not None and operand[src] == shape[d]
        # A new or expanded dimension: the operand stays whole, each device keeps its slice.
        maps.append(DimMap((src if same else None,) + (None,) * (len(ctx.in_shapes) - 1), (d,)))
    return maps


def reshape_groups(in_shape, out_shape):
    """Pairs (in_dim, out_dim) that may split together: the leading non-unit dims of blocks of
    dimensions whose sizes multiply to the same number on both sides."""
    pairs, i, j = [], 0, 0
    while i < len(in_shape) and j < len(out_shape):
        if in_shape[i] == 1:
            i += 1
            continue
        if out_shape[j] == 1:
            j += 1
            continue
        pairs.append((i, j))
        pin, pout = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while pin != pout:
            if pin < pout:
                pin *= in_shape[i]
                i += 1
            else:
                pout *= out_shape[j]
                j += 1
    return pairs


@register("reshape")
def reshape(ctx: RuleContext, *, new_sizes, dimensions, **_):
    if dimensions is not None:
        return []
    return [DimMap((i,), (j,)) for i, j in reshape_groups(ctx.in_shapes[0], tuple(new_sizes))]


@register("squeeze")
def squeeze(ctx: RuleContext, *, dimensions, **_):
    kept = [d for d in range(len(ctx.in_shapes[0])) if d not in dimensions]
    return [DimMap((d,), (k,)) for k, d in enumerate(kept)]


@register("expand_dims")
def expand_dims(ctx: RuleContext, *, dimensions, **_):
    out_rank = ctx.out_rank
    kept = [d for d in range(out_rank) if d not in dimensions]
    return [DimMap((k,), (d,)) for k, d in enumerate(kept)]


@register("transpose")
def transpose(ctx: RuleContext, *, permutation, **_):
    return [DimMap((src,), (d,)) for d, src in enumerate(permutation)]


def _untouched(ctx: RuleContext, touched, n_ins: int):
    """Dims that pass through whole; the first n_ins operands are split with the result."""
    rank = ctx.out_rank
    extra = (None,) * (len(ctx.in_shapes) - n_ins)
    return [DimMap((d,) * n_ins + extra, (d,) * len(ctx.out_shapes))
            for d in range(rank) if d not in touched]


@register("slice")
def slice_(ctx: RuleContext, **_):
    in_shape, out_shape = ctx.in_shapes[0], ctx.out_shapes[0]
    return _untouched(ctx, [d for d in range(len(in_shape)) if in_shape[d] != out_shape[d]], 1)


@register("dynamic_slice")
def dynamic_slice(ctx: RuleContext, *, slice_sizes, **_):
    in_shape = ctx.in_shapes[0]
    return _untouched(ctx, [d for d in range(len(in_shape)) if slice_sizes[d] != in_shape[d]], 1)


@register("dynamic_update_slice")
def dynamic_update_slice(ctx: RuleContext, **_):
    operand, update = ctx.in_shapes[0], ctx.in_shapes[1]
    return _untouched(ctx, [d for d in range(len(operand)) if operand[d] != update[d]], 2)


@register("concatenate")
def concatenate(ctx: RuleContext, *, dimension, **_):
    return _untouched(ctx, [dimension], len(ctx.in_shapes))


@register("pad")
def pad(ctx: RuleContext, *, padding_config, **_):
    return _untouched(ctx, [d for d, cfg in enumerate(padding_config) if tuple(cfg) != (0, 0, 0)], 1)


@register("rev")
def rev(ctx: RuleContext, *, dimensions, **_):
    return _untouched(ctx, list(dimensions), 1)


@register("split")
def split(ctx: RuleContext, *, axis, **_):
    return [DimMap((d,), (d,) * len(ctx.out_shapes))
            for d in range(len(ctx.in_shapes[0])) if d != axis]


@register("sort")
def sort(ctx: RuleContext, *, dimension, **_):
    return _untouched(ctx, [dimension], len(ctx.in_shapes))


@register("top_k")
def top_k(ctx: RuleContext, **_):
    # XLA's partitioner gathers a top_k operand whole whatever its sharding (checked on
    # XLA:CPU), so no split is offered and the gather is priced where it happens.
    return []


@register("iota")
def iota(ctx: RuleContext, **_):
    return [DimMap((), (d,)) for d in range(ctx.out_rank)]


@register("stack")
def stack(ctx: RuleContext, *, axis, **_):
    n = len(ctx.in_shapes)
    return [DimMap((d - (d > axis),) * n, (d,)) for d in range(ctx.out_rank) if d != axis]
