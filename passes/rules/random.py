"""Random number primitives. Bits are generated per shard (jax's partitionable threefry), so
the result may be split any way while the key stays whole."""

from autopar.passes.rules import DimMap, RuleContext, register


@register("random_bits", "threefry2x32")
def random_bits(ctx: RuleContext, **_):
    if len(ctx.out_shapes) == 1 and not ctx.in_shapes[0]:
        return [DimMap((None,), (d,)) for d in range(ctx.out_rank)]
    # threefry2x32 is elementwise over its four operands.
    rank = ctx.out_rank
    return [DimMap(tuple(d if len(s) == rank else None for s in ctx.in_shapes),
                   (d,) * len(ctx.out_shapes)) for d in range(rank)]


@register("random_wrap", "random_unwrap", "random_seed", "random_fold_in", "random_split")
def key_ops(ctx: RuleContext, **_):
    return []  # keys are tiny: kept replicated
