"""Contractions: dot_general and convolution.

A split batch or free dimension needs no communication; a split contracting dimension leaves a
partial sum on every device, reduced over the axis (all-reduce, or reduce-scatter when the
result is split over that axis).
"""

from autopar.passes.rules import DimMap, Reduce, RuleContext, register

#: The primitives of this family.
CONTRACTIONS = ("dot_general", "conv_general_dilated")


@register("dot_general")
def dot_general(ctx: RuleContext, *, dimension_numbers, **_):
    (lc, rc), (lb, rb) = dimension_numbers
    lhs_rank, rhs_rank = len(ctx.in_shapes[0]), len(ctx.in_shapes[1])
    lhs_free = [d for d in range(lhs_rank) if d not in lc and d not in lb]
    rhs_free = [d for d in range(rhs_rank) if d not in rc and d not in rb]
    maps = [DimMap((l, r), (i,)) for i, (l, r) in enumerate(zip(lb, rb))]
    maps += [DimMap((l, None), (len(lb) + i,)) for i, l in enumerate(lhs_free)]
    maps += [DimMap((None, r), (len(lb) + len(lhs_free) + i,)) for i, r in enumerate(rhs_free)]
    maps += [DimMap((l, r), (Reduce.SUM,)) for l, r in zip(lc, rc)]
    return maps


@register("conv_general_dilated")
def conv(ctx: RuleContext, *, dimension_numbers, feature_group_count, batch_group_count, **_):
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    # spec = (batch/out-feature dim, feature/in-feature dim, *spatial dims)
    maps = []
    if batch_group_count == 1:
        maps.append(DimMap((lhs_spec[0], None), (out_spec[0],)))
    if feature_group_count == 1 and batch_group_count == 1:
        maps.append(DimMap((None, rhs_spec[0]), (out_spec[1],)))
        # Scattering the partial sums into a spatial dim would need halos: batch or feature only.
        maps.append(DimMap((lhs_spec[1], rhs_spec[1]), (Reduce.SUM,),
                           scatter_to=(out_spec[0], out_spec[1])))
    return maps
