"""autopar.compare prices a program at its own dtype: the one its matmuls' flops are in."""

import jax
import jax.numpy as jnp

from autopar._compare import main_dtype
from autopar.models import gpt


def test_main_dtype_is_the_matmuls_dtype():
    f32_step, f32_args = gpt.make_train_step(gpt.TINY, abstract=True)
    assert main_dtype(f32_step, f32_args) == jnp.float32
    bf16 = gpt.Config(dtype=jnp.bfloat16)  # bf16 compute, f32 parameters
    step, args = gpt.make_train_step(bf16, abstract=True)
    assert main_dtype(step, args) == jnp.bfloat16
    no_matmul = main_dtype(lambda x: jnp.sum(x * 2), (jax.ShapeDtypeStruct((4,), jnp.bfloat16),))
    assert no_matmul == jnp.float32
