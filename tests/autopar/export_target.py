"""A target for `autopar export` in the tests: a two-matrix MLP train step, from shapes."""

import jax
import jax.numpy as jnp


def mlp_step():
    def loss_fn(params, x, y):
        h = jax.nn.relu(x @ params["w1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    def train_step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss
    key = jax.random.key(0)
    params = {"w1": 0.02 * jax.random.normal(key, (512, 2048)),
              "w2": 0.02 * jax.random.normal(key, (2048, 512))}
    x = jax.random.normal(key, (512, 512))
    return train_step, (params, x, jnp.zeros((512, 512)))
