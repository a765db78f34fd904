"""Contractions: dot_general and convolution.

A split batch or free dimension needs no communication; a split contracting dimension leaves a
partial sum on every device, reduced over the axis (all-reduce, or reduce-scatter when the
result is split over that axis). Flops count 2 per multiply-add, as XLA's cost analysis does.
"""

import math

from jax import lax

from autopar.passes.rules import DimMap, Reduce, RuleContext, register

_CONTRACTION = dict(contraction=True, reducing=True)


def dot_flops(ctx: RuleContext, *, dimension_numbers, **_) -> float:
    (lc, _), _ = dimension_numbers
    return 2.0 * math.prod(ctx.out_shapes[0]) * math.prod(ctx.in_shapes[0][d] for d in lc)


def matmul_dims(local_in_shapes, *, dimension_numbers, **_) -> tuple[int, int, int]:
    """(M, N, K) of one device's dot_general: rows, columns and contraction length (batch
    dims are separate matmuls)."""
    (lc, rc), (lb, rb) = dimension_numbers
    lhs, rhs = local_in_shapes[0], local_in_shapes[1]
    m = math.prod(lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb)
    n = math.prod(rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb)
    k = math.prod(lhs[d] for d in lc)
    return m, n, k


def conv_flops(ctx: RuleContext, *, dimension_numbers, **_) -> float:
    rhs = ctx.in_shapes[1]
    rhs_spec = dimension_numbers[1]
    window = math.prod(rhs[d] for d in rhs_spec[2:])
    return 2.0 * math.prod(ctx.out_shapes[0]) * window * rhs[rhs_spec[1]]


@register(lax.dot_general_p, flops=dot_flops, matmul_dims=matmul_dims, library=True,
          **_CONTRACTION)
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


@register(lax.conv_general_dilated_p, flops=conv_flops, **_CONTRACTION)
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


#: Names of this family's primitives, for passes/propagate.py until it asks op_info.
