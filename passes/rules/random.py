"""Random number primitives. Bits are generated per shard (jax's partitionable threefry), so
the result may be split any way while the key stays whole."""

from jax.extend.core import primitives as P

from autopar._compat import primitives
from autopar.passes.rules import DimMap, RuleContext, register


@register(P.random_bits_p, P.threefry2x32_p)
def random_bits(ctx: RuleContext, **_):
    if len(ctx.out_shapes) == 1 and not ctx.in_shapes[0]:
        return [DimMap((None,), (d,)) for d in range(ctx.out_rank)]
    # threefry2x32 is elementwise over its four operands.
    rank = ctx.out_rank
    return [DimMap(tuple(d if len(s) == rank else None for s in ctx.in_shapes),
                   (d,) * len(ctx.out_shapes)) for d in range(rank)]


@register(*primitives("random_wrap_p", "random_unwrap_p", "random_clone_p"), P.random_seed_p,
          P.random_fold_in_p, P.random_split_p)
def key_ops(ctx: RuleContext, **_):
    return []  # keys are tiny: kept replicated
