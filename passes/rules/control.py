"""Boundary nodes of the graph (inputs, outputs, loop carries, scan slices, branch merges).

They move a value across a region boundary unchanged, so every dimension may split, the same
way on both sides; a scanned-over input and a stacked output keep their leading (iteration)
dimension whole.
"""

from autopar.passes.rules import DimMap, RuleContext, register


@register("input")
def source(ctx: RuleContext, **_):
    return [DimMap((), (d,)) for d in range(ctx.out_rank)]


@register("output")
def sink(ctx: RuleContext, **_):
    return [DimMap((d,), ()) for d in range(len(ctx.in_shapes[0]))]


@register("carry", "merge")
def same_everywhere(ctx: RuleContext, **_):
    return [DimMap((d,) * len(ctx.in_shapes), (d,)) for d in range(ctx.out_rank)]


@register("scan_in")
def scan_in(ctx: RuleContext, **_):
    return [DimMap((d + 1,), (d,)) for d in range(ctx.out_rank)]


@register("scan_out")
def scan_out(ctx: RuleContext, **_):
    return [DimMap((d,), (d + 1,)) for d in range(len(ctx.in_shapes[0]))]
