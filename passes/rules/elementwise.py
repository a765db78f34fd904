"""Elementwise primitives: every dimension splits the same way on every operand that has it.

Operands may be scalars, or have size-1 dimensions that broadcast (jax 0.10 binary ops accept
``f32[16,1024,2048] + f32[1,1,2048]``): those stay whole over the axis that splits the result.
XLA fuses them; cluster merges them into the decision of the op they follow; propagation
treats operands and result as one tensor.
"""

from jax import lax
from jax.extend.core import primitives as P

from autopar._compat import primitives
from autopar.passes.rules import DimMap, RuleContext, mark, register

# Data movement and bookkeeping: no flops and no kernel of their own.
_FREE = (lax.bitcast_convert_type_p, lax.copy_p,
         lax.stop_gradient_p, lax.select_n_p, lax.sharding_constraint_p,
         *primitives("reshard_p"))
_ARITHMETIC = (
    lax.abs_p, lax.acos_p, lax.acosh_p, lax.add_p, P.add_jaxvals_p, lax.and_p, lax.asin_p,
    lax.asinh_p, lax.atan_p, lax.atan2_p, lax.atanh_p, lax.cbrt_p, lax.ceil_p, lax.clamp_p,
    lax.complex_p, lax.conj_p, lax.cos_p, lax.cosh_p, lax.digamma_p, lax.div_p, lax.eq_p,
    lax.erf_p, lax.erf_inv_p, lax.erfc_p, lax.exp_p, lax.exp2_p, lax.expm1_p, lax.floor_p,
    lax.ge_p, lax.gt_p, lax.igamma_p, lax.imag_p, lax.integer_pow_p, lax.is_finite_p, lax.le_p,
    lax.lgamma_p, lax.log_p, lax.log1p_p, lax.logistic_p, lax.lt_p, lax.max_p, lax.min_p,
    lax.mul_p, lax.ne_p, lax.neg_p, lax.nextafter_p, lax.not_p, lax.or_p,
    lax.population_count_p, lax.pow_p, lax.real_p, lax.reduce_precision_p, lax.rem_p,
    lax.round_p, lax.rsqrt_p, lax.shift_left_p, lax.shift_right_arithmetic_p,
    lax.shift_right_logical_p, lax.sign_p, lax.sin_p, lax.sinh_p, lax.sqrt_p, lax.square_p,
    lax.sub_p, lax.tan_p, lax.tanh_p, lax.xor_p,
    *primitives("log2_p", "one_minus_square_p", "polynomial_p"))  # jax 0.12
_ELEMENTWISE = dict(elementwise=True, fusible=True, follower=True, same_tensor=True)


def elementwise(ctx: RuleContext, **_):
    out = ctx.out_shapes[0]
    return [DimMap(tuple(d if len(s) == len(out) and s[d] == out[d] else None
                         for s in ctx.in_shapes),
                   (d,) * len(ctx.out_shapes))
            for d in range(len(out)) if out[d] > 1]


register(*_ARITHMETIC, **_ELEMENTWISE)(elementwise)
register(*_FREE, free=True, **_ELEMENTWISE)(elementwise)
# A cast has no flops (XLA counts none) but is a kernel where no fusion takes it in: read by a
# convolution or a dot, it reads the source dtype and writes the new one.
register(lax.convert_element_type_p, flops=lambda ctx, **_: 0.0, **_ELEMENTWISE)(elementwise)
# A constraint pins its result to the sharding in this parameter (passes.trace).
mark(lax.sharding_constraint_p, pin_param="sharding")
mark(*primitives("reshard_p"), pin_param="dst_sharding")

# Transcendental: XLA's fusion duplicates only cheap ops, so one read by several consumers is
# kept (passes.liveness).
mark(lax.exp_p, lax.exp2_p, lax.expm1_p, lax.log_p, lax.log1p_p, lax.tanh_p, lax.logistic_p,
     lax.rsqrt_p, lax.sqrt_p, lax.cbrt_p, lax.erf_p, lax.erfc_p, lax.erf_inv_p, lax.pow_p,
     lax.atan2_p, lax.lgamma_p, lax.digamma_p, *primitives("log2_p"), expensive=True)
# YNNPACK's arithmetic: an XLA:CPU library fusion takes these in (no selects or comparisons).
mark(lax.add_p, P.add_jaxvals_p, lax.sub_p, lax.mul_p, lax.div_p, lax.max_p, lax.min_p,
     lax.pow_p, lax.integer_pow_p, lax.square_p, lax.neg_p, lax.abs_p, lax.sign_p, lax.floor_p,
     lax.ceil_p, lax.round_p, lax.exp_p, lax.expm1_p, lax.log_p, lax.log1p_p, lax.logistic_p,
     lax.rsqrt_p, lax.sqrt_p, lax.cbrt_p, lax.tanh_p, lax.sin_p, lax.cos_p,
     lax.convert_element_type_p, library_elementwise=True)


# An optimization barrier passes each operand through unchanged (passes.trace gives it one
# node per operand). It is not elementwise: XLA neither fuses across it nor lets a follower
# merge into it, and its result is its operand's buffer (passes.liveness).
register(lax.optimization_barrier_p, free=True, aliasing=True)(elementwise)

#: Names of the elementwise primitives, for passes/propagate.py until it asks op_info.
