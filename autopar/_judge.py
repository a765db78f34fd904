"""A compiled program's step, simulated on a hardware profile: what ``pipeline="auto"``
referees its candidates by, and the rate ``autopar.compare`` prices a program at.

Example::

    compiled = jax.jit(step).lower(*abstract_args).compile()
    seconds = simulated_step_s(compiled, get_profile("h100"), main_dtype(step, abstract_args))
"""

from __future__ import annotations

import math

import jax
import jax.extend.core as jax_core

from autopar.cost_model.timeline import simulate


def abstract(args):
    """``args`` as ``jax.ShapeDtypeStruct`` leaves, to compile from (nothing runs)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)


def main_dtype(fn, args):
    """The dtype of the matmul operands that do most of ``fn``'s flops on ``args`` (float32
    when it has no matmul): the rate a program of ``fn`` is priced at (XLA:CPU computes bf16
    matmuls in f32, so the compiled text cannot tell)."""
    closed = jax.make_jaxpr(fn)(*args)
    flops: dict = {}
    for eqn in _eqns(closed.jaxpr):
        if eqn.primitive is jax.lax.dot_general_p:
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval
            k = math.prod(lhs.shape[d] for d in contract)
            out = math.prod(eqn.outvars[0].aval.shape)
            flops[lhs.dtype] = flops.get(lhs.dtype, 0) + 2 * out * k
    return max(flops, key=flops.get) if flops else jax.numpy.float32


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs inside it (calls, loops, branches)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax_core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def simulated_step_s(compiled, profile, dtype) -> float:
    """``compiled``'s step on ``profile`` by the simulated timeline (``cost_model.timeline``),
    as that hardware runs it: on a GPU or TPU profile every collective asynchronous, moved
    at the program's own dtype, and each all-reduce sliced per device a reduce-scatter
    (XLA:CPU compiles collectives synchronously, widens 16-bit floats to float32 and
    emulates reduce-scatters); on the CPU profile as XLA:CPU compiled it."""
    accelerator = profile.async_collectives
    return simulate(compiled.as_text(), profile, dtype, scheduled=accelerator,
                    program_dtypes=accelerator).step_time_s
