"""Elementwise primitives: every dimension splits the same way on every operand that has it.

Operands may be scalars, or have size-1 dimensions that broadcast (jax 0.10 binary ops accept
``f32[16,1024,2048] + f32[1,1,2048]``): those stay whole over the axis that splits the result.
"""

from autopar.passes.rules import DimMap, RuleContext, register

UNARY_AND_NARY = (
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "cbrt", "ceil", "clamp", "complex", "conj", "convert_element_type", "copy", "copy_p", "cos",
    "cosh", "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor",
    "ge", "gt", "igamma", "imag", "integer_pow", "is_finite", "le", "lgamma", "log", "log1p",
    "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or",
    "population_count", "pow", "real", "reduce_precision", "rem", "round", "rsqrt",
    "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin",
    "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor", "sharding_constraint",
    "reshard",
    "bitcast_convert_type",
)


@register(*UNARY_AND_NARY)
def elementwise(ctx: RuleContext, **_):
    out = ctx.out_shapes[0]
    return [DimMap(tuple(d if len(s) == len(out) and s[d] == out[d] else None
                         for s in ctx.in_shapes),
                   (d,) * len(ctx.out_shapes))
            for d in range(len(out)) if out[d] > 1]


# An optimization barrier passes each operand through unchanged (passes.trace gives it one
# node per operand). It is not in UNARY_AND_NARY: XLA neither fuses across it nor lets a
# follower merge into it, and its result shares its operand's buffer (cost_model.memory).
register("optimization_barrier")(elementwise)
