"""Shape and data-movement primitives: a dimension splits when it moves through unchanged.

Most move data and compute nothing (``free``). The layout ops (broadcast, reshape, squeeze,
transpose) and iota are fused by XLA like elementwise ops, and hand on one tensor.
"""

from jax import lax

from autopar.passes.rules import DimMap, RuleContext, register

_LAYOUT = dict(free=True, fusible=True, same_tensor=True)


@register(lax.broadcast_in_dim_p, library_elementwise=True, **_LAYOUT)
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


@register(lax.reshape_p, follower=True, library_elementwise=True, **_LAYOUT)
def reshape(ctx: RuleContext, *, new_sizes, dimensions, **_):
    if dimensions is not None:
        return []
    return [DimMap((i,), (j,)) for i, j in reshape_groups(ctx.in_shapes[0], tuple(new_sizes))]


@register(lax.squeeze_p, follower=True, library_elementwise=True, **_LAYOUT)
def squeeze(ctx: RuleContext, *, dimensions, **_):
    kept = [d for d in range(len(ctx.in_shapes[0])) if d not in dimensions]
    return [DimMap((d,), (k,)) for k, d in enumerate(kept)]


@register(lax.transpose_p, follower=True, **_LAYOUT)
def transpose(ctx: RuleContext, *, permutation, **_):
    return [DimMap((src,), (d,)) for d, src in enumerate(permutation)]


def _untouched(ctx: RuleContext, touched, n_ins: int):
    """Dims that pass through whole; the first n_ins operands are split with the result."""
    rank = ctx.out_rank
    extra = (None,) * (len(ctx.in_shapes) - n_ins)
    return [DimMap((d,) * n_ins + extra, (d,) * len(ctx.out_shapes))
            for d in range(rank) if d not in touched]


@register(lax.slice_p, free=True)
def slice_(ctx: RuleContext, **_):
    in_shape, out_shape = ctx.in_shapes[0], ctx.out_shapes[0]
    return _untouched(ctx, [d for d in range(len(in_shape)) if in_shape[d] != out_shape[d]], 1)


# Propagation crosses a dynamic slice or update forward early (passes.propagate).
@register(lax.dynamic_slice_p, free=True, forward_only=True)
def dynamic_slice(ctx: RuleContext, *, slice_sizes, **_):
    in_shape = ctx.in_shapes[0]
    return _untouched(ctx, [d for d in range(len(in_shape)) if slice_sizes[d] != in_shape[d]], 1)


@register(lax.dynamic_update_slice_p, free=True, forward_only=True, in_place=True)
def dynamic_update_slice(ctx: RuleContext, **_):
    operand, update = ctx.in_shapes[0], ctx.in_shapes[1]
    return _untouched(ctx, [d for d in range(len(operand)) if operand[d] != update[d]], 2)


@register(lax.concatenate_p, free=True)
def concatenate(ctx: RuleContext, *, dimension, **_):
    return _untouched(ctx, [dimension], len(ctx.in_shapes))


@register(lax.pad_p, free=True)
def pad(ctx: RuleContext, *, padding_config, **_):
    return _untouched(ctx, [d for d, cfg in enumerate(padding_config) if tuple(cfg) != (0, 0, 0)], 1)


@register(lax.rev_p, free=True)
def rev(ctx: RuleContext, *, dimensions, **_):
    return _untouched(ctx, list(dimensions), 1)


@register(lax.split_p, free=True)
def split(ctx: RuleContext, *, axis, **_):
    return [DimMap((d,), (d,) * len(ctx.out_shapes))
            for d in range(len(ctx.in_shapes[0])) if d != axis]


@register(lax.sort_p)
def sort(ctx: RuleContext, *, dimension, **_):
    return _untouched(ctx, [dimension], len(ctx.in_shapes))


@register(lax.top_k_p)
def top_k(ctx: RuleContext, **_):
    # XLA's partitioner gathers a top_k operand whole whatever its sharding (checked on
    # XLA:CPU), so no split is offered and the gather is priced where it happens.
    return []


@register(lax.iota_p, free=True, fusible=True)
def iota(ctx: RuleContext, **_):
    return [DimMap((), (d,)) for d in range(ctx.out_rank)]


@register(lax.stack_p)
def stack(ctx: RuleContext, *, axis, **_):
    n = len(ctx.in_shapes)
    return [DimMap((d - (d > axis),) * n, (d,)) for d in range(ctx.out_rank) if d != axis]


@register(lax.unstack_p)
def unstack(ctx: RuleContext, *, axis, **_):
    n = len(ctx.out_shapes)
    return [DimMap((d,), (d - (d > axis),) * n) for d in range(len(ctx.in_shapes[0])) if d != axis]
