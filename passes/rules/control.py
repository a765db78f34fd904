"""Boundary nodes of the graph (inputs, outputs, loop carries, scan slices, branch merges).

They move a value across a region boundary unchanged, so every dimension may split, the same
way on both sides; a scanned-over input and a stacked output keep their leading (iteration)
dimension whole. They cost nothing, and all but an input (which has no operand) hand on one
tensor in one layout.
"""

from autopar._compat import primitive
from autopar.passes.ir import NodeKind
from autopar.passes.rules import DimMap, RuleContext, register


@register(NodeKind.INPUT, free=True)
def source(ctx: RuleContext, **_):
    return [DimMap((), (d,)) for d in range(ctx.out_rank)]


@register(NodeKind.OUTPUT, free=True, same_tensor=True)
def sink(ctx: RuleContext, **_):
    return [DimMap((d,), ()) for d in range(len(ctx.in_shapes[0]))]


@register(NodeKind.CARRY, NodeKind.MERGE, free=True, same_tensor=True)
def same_everywhere(ctx: RuleContext, **_):
    return [DimMap((d,) * len(ctx.in_shapes), (d,)) for d in range(ctx.out_rank)]


@register(NodeKind.SCAN_IN, free=True, same_tensor=True)
def scan_in(ctx: RuleContext, **_):
    return [DimMap((d + 1,), (d,)) for d in range(ctx.out_rank)]


@register(NodeKind.SCAN_OUT, free=True, same_tensor=True)
def scan_out(ctx: RuleContext, **_):
    return [DimMap((d,), (d + 1,)) for d in range(len(ctx.in_shapes[0]))]


@register(primitive("shard_map_p"), manual_region=True)
def manual_region(ctx: RuleContext, **_):
    """A `jax.shard_map` region (a pipeline's stages): one strategy, from its own specs
    (``passes.strategies``), so no one-axis maps."""
    return []
