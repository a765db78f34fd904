"""Megatron baselines from the traced program (autopar/_tp_structure.py), not from names: the
bundled models get what their names gave, and a model named otherwise (`query`, `Dense_0`,
an einsum weight) gets a real tensor-parallel baseline that computes what one device does."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from autopar import baselines
from autopar._mesh import as_auto_mesh
from autopar.models import gpt, llama_nnx, moe

MESH = {"data": 2, "model": 4}


@pytest.mark.parametrize("module, config", [(gpt, gpt.TINY), (gpt, gpt.TINY_SCAN),
                                            (gpt, gpt.Config(dtype=jnp.bfloat16)),  # casts
                                            (moe, moe.TINY), (llama_nnx, llama_nnx.TINY)])
@pytest.mark.parametrize("kind", ["megatron", "megatron_vocab", "expert"])
def test_the_graph_finds_what_the_names_said_on_the_bundled_models(module, config, kind):
    step, args = module.make_train_step(config, abstract=True)
    mesh = as_auto_mesh(MESH)
    by_names = baselines.baseline_shardings(kind, args, mesh)
    by_graph = baselines.baseline_shardings(kind, args, mesh, fn=step)
    assert by_graph == by_names


class _Attention(nn.Module):
    """Gemma/flax-example style names: `query`, `key`, `value`, `out`, `Dense_0`, `Dense_1`,
    and an einsum weight `q_einsum` (heads, model, head_dim)."""
    heads: int = 4
    head_dim: int = 8

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        q = nn.DenseGeneral((self.heads, self.head_dim), name="query")(x)
        k = nn.DenseGeneral((self.heads, self.head_dim), name="key")(x)
        v = nn.DenseGeneral((self.heads, self.head_dim), name="value")(x)
        w = self.param("q_einsum", nn.initializers.normal(0.02), (self.heads, d, self.head_dim))
        q = q + jnp.einsum("btd,ndh->btnh", x, w)
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(self.head_dim)
        att = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)
        x = x + nn.DenseGeneral(d, axis=(-2, -1), name="out")(att)
        h = nn.relu(nn.Dense(4 * d)(x))            # Dense_0
        return x + nn.Dense(d)(h)                   # Dense_1


def _foreign_step():
    model = _Attention()
    x = np.random.default_rng(0).normal(size=(8, 16, 32)).astype(np.float32)
    params = model.init(jax.random.key(0), x)["params"]
    tx = optax.sgd(0.1)

    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step, (params, tx.init(params), x)


def test_a_model_named_otherwise_gets_a_real_megatron_baseline():
    step, args = _foreign_step()
    mesh = as_auto_mesh(MESH)
    by_names = baselines.baseline_shardings("megatron", args, mesh)[0]
    assert all(s == P() for s in jax.tree.leaves(by_names))  # the names matched nothing
    params = baselines.baseline_shardings("megatron", args, mesh, fn=step)[0]
    assert params["query"]["kernel"] == P(None, "model", None)     # heads
    assert params["query"]["bias"] == P("model", None)
    assert params["key"]["kernel"] == P(None, "model", None)
    assert params["q_einsum"] == P("model", None, None)            # heads of the einsum
    assert params["out"]["kernel"] == P("model", None, None)       # row-parallel on heads
    assert params["Dense_0"]["kernel"] == P(None, "model")
    assert params["Dense_1"]["kernel"] == P("model", None)
    assert params["Dense_1"]["bias"] == P()
    run = baselines.jit_baseline(step, args, mesh, "megatron")
    placed = jax.device_put(args, baselines.baseline_named_shardings("megatron", args, mesh,
                                                                     fn=step))
    got, want = run(*placed), jax.jit(step)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-5)
