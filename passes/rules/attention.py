"""Attention (``passes.attention``'s primitives): split the batch, or the heads (tensor
parallel; the kv heads split too, so grouped-query heads stay with their kv head).

These one-axis maps serve propagation. The planner's strategies for attention, which add the
query-sequence split and the sequence-parallel rewrites (Ulysses, ring), come from
``passes.sequence_parallel``, priced by ``cost_model.attention``.
"""

from autopar.passes.attention import attention_bwd_p, attention_fwd_p
from autopar.passes.rules import DimMap, RuleContext, register


def attention_flops(ctx: RuleContext, **_) -> float:
    """2 flops per multiply-add of the score and value matmuls (5 of them backward)."""
    b, s, h, d = ctx.in_shapes[0]
    matmuls = 5 if len(ctx.in_shapes) > 4 else 2
    return 2.0 * matmuls * b * h * s * ctx.in_shapes[1][1] * d


@register(attention_fwd_p, flops=attention_flops, contraction=True)
def attention_fwd(ctx: RuleContext, **_):
    # operands q, k, v, kv_mask; results o [b, s, h, d], lse [b, h, s]
    return [DimMap((0, 0, 0, 0), (0, 0)), DimMap((2, 2, 2, None), (2, 1))]


@register(attention_bwd_p, flops=attention_flops, contraction=True)
def attention_bwd(ctx: RuleContext, **_):
    # operands q, k, v, kv_mask, o, lse, do; results dq, dk, dv
    return [DimMap((0,) * 7, (0, 0, 0)), DimMap((2, 2, 2, None, 2, 1, 2), (2, 2, 2))]
