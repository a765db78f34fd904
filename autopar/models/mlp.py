"""A flax linen MLP: ``num_layers`` Dense layers with relu between them, MSE loss.

Layers alternate between the Megatron column/row names so tensor-parallel baselines apply:
layer ``2i`` is ``mlp_in_{i}`` (column-parallel) and layer ``2i+1`` is ``mlp_out_{i}``
(row-parallel). Parameters: ``params['mlp_in_0']['kernel']`` ``[in_dim, hidden]`` and so on;
the last layer maps to ``out_dim``.

Batch: ``{'x': float [batch, in_dim], 'y': float [batch, out_dim]}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from autopar.models import common


@dataclass(frozen=True)
class Config:
    batch: int = 8
    in_dim: int = 16
    hidden: int = 32
    out_dim: int = 8
    num_layers: int = 3
    dtype: Any = jnp.float32  # compute dtype
    param_dtype: Any = jnp.float32


TINY = Config()
#: Few samples, wide layers: tensor parallelism wins.
TP_FRIENDLY = Config(batch=32, in_dim=256, hidden=256, out_dim=256, num_layers=4)
#: A realistic wide MLP (compile only): batch 64, hidden 8192, bf16 compute.
TP_FRIENDLY_WIDE = Config(
    batch=64, in_dim=8192, hidden=8192, out_dim=8192, num_layers=4, dtype=jnp.bfloat16
)
#: Many samples, narrow layers: data parallelism wins.
DP_FRIENDLY = Config(batch=8192, in_dim=256, hidden=256, out_dim=256, num_layers=4)
#: The realistic MLP workload (compile only).
REALISTIC = TP_FRIENDLY_WIDE


def layer_name(i: int) -> str:
    return f"mlp_in_{i // 2}" if i % 2 == 0 else f"mlp_out_{i // 2}"


class MLP(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        c = self.config
        x = x.astype(c.dtype)
        for i in range(c.num_layers):
            width = c.out_dim if i == c.num_layers - 1 else c.hidden
            x = nn.Dense(width, dtype=c.dtype, param_dtype=c.param_dtype, name=layer_name(i))(x)
            if i != c.num_layers - 1:
                x = nn.relu(x)
        return x


def _init(config: Config):
    model = MLP(config)
    x = jnp.zeros((1, config.in_dim), config.dtype)
    return lambda: model.init(jax.random.key(0), x)["params"]


def _batch(config: Config, abstract: bool):
    rng = common.batch_rng()
    x_shape, y_shape = (config.batch, config.in_dim), (config.batch, config.out_dim)
    return {
        "x": common.random_normal(rng, x_shape, jnp.float32, abstract=abstract),
        "y": common.random_normal(rng, y_shape, jnp.float32, abstract=abstract),
    }


def _loss_fn(config: Config):
    model = MLP(config)

    def loss_fn(params, batch):
        pred = model.apply({"params": params}, batch["x"]).astype(jnp.float32)
        return jnp.mean(jnp.square(pred - batch["y"]))

    return loss_fn


def make_train_step(config: Config = TINY, *, abstract: bool = False):
    return common.linen_train_step(_init(config), _loss_fn(config), _batch(config, abstract))


def make_forward(config: Config = TINY, abstract: bool = False):
    return common.linen_forward(_init(config), _loss_fn(config), _batch(config, abstract))
