"""A two-matrix MLP train step (the README's quickstart model), shared by the tests: a target
for `autopar export`, and the step the summary and axis-role tests plan."""

import jax
import jax.numpy as jnp
import numpy as np


def mlp_train_step(params, x, y):
    def loss_fn(params, x, y):
        h = jax.nn.relu(x @ params["w1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def mlp_args(batch=2048, d=1024, h=4096, abstract=False):
    """(params, x, y) for :func:`mlp_train_step`: random float32 arrays, or their shapes."""
    shapes = {"w1": (d, h), "w2": (h, d), "x": (batch, d)}
    if abstract:
        s = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()}
        return {"w1": s["w1"], "w2": s["w2"]}, s["x"], s["x"]
    rng = np.random.default_rng(0)
    a = {k: rng.normal(0, 0.02, v).astype(np.float32) for k, v in shapes.items()}
    return {"w1": a["w1"], "w2": a["w2"]}, a["x"], np.zeros((batch, d), np.float32)


def mlp_step():
    return mlp_train_step, mlp_args()
