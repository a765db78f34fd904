"""A small flax linen ResNet-ish convnet with BatchNorm.

``stem_conv`` (3x3) + ``stem_bn`` + relu, then for each stage ``i`` a residual block
``stage_{i}`` (``conv_1``/``bn_1``/relu/``conv_2``/``bn_2``, a 1x1 ``proj`` conv + ``proj_bn``
when the width changes, add, relu) followed by 2x2 average pooling (not after the last stage),
global average pooling and a Dense head ``head``; softmax cross entropy.

Because BatchNorm keeps running statistics, the train step's first argument and result are the
whole flax variables dict::

    train_step(variables, opt_state, batch) -> (new_variables, new_opt_state, loss)
    variables = {'params': ..., 'batch_stats': ...}

The optimizer state is over ``variables['params']`` only; ``batch_stats`` are replaced by the
statistics the forward pass computed (``mutable=['batch_stats']``). ``make_forward`` evaluates
in inference mode with the running statistics.

Images are NHWC. Batch: ``{'images': float32 [batch, size, size, channels],
'labels': int32 [batch]}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autopar.models import common


@dataclass(frozen=True)
class Config:
    batch: int = 8
    image_size: int = 16
    channels: int = 8
    widths: tuple[int, ...] = (16, 32)
    num_classes: int = 16
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    bn_momentum: float = 0.9


TINY = Config()
#: ImageNet-sized input, ResNet-ish widths (compile only).
REALISTIC = Config(
    batch=128,
    image_size=224,
    channels=3,
    widths=(64, 128, 256, 512),
    num_classes=1000,
    dtype=jnp.bfloat16,
)


class ResidualBlock(nn.Module):
    config: Config
    width: int

    @nn.compact
    def __call__(self, x, train: bool):
        c = self.config

        def conv(features, size, name):
            return nn.Conv(
                features,
                (size, size),
                padding="SAME",
                use_bias=False,
                dtype=c.dtype,
                param_dtype=c.param_dtype,
                name=name,
            )

        def bn(name):
            return nn.BatchNorm(
                use_running_average=not train,
                momentum=c.bn_momentum,
                dtype=c.dtype,
                param_dtype=c.param_dtype,
                name=name,
            )

        residual = x
        h = nn.relu(bn("bn_1")(conv(self.width, 3, "conv_1")(x)))
        h = bn("bn_2")(conv(self.width, 3, "conv_2")(h))
        if residual.shape[-1] != self.width:
            residual = bn("proj_bn")(conv(self.width, 1, "proj")(residual))
        return nn.relu(h + residual)


class ConvNet(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, images, train: bool):
        c = self.config
        x = images.astype(c.dtype)
        x = nn.Conv(
            c.widths[0],
            (3, 3),
            padding="SAME",
            use_bias=False,
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            name="stem_conv",
        )(x)
        x = nn.BatchNorm(
            use_running_average=not train,
            momentum=c.bn_momentum,
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            name="stem_bn",
        )(x)
        x = nn.relu(x)
        for i, width in enumerate(c.widths):
            x = ResidualBlock(c, width, name=f"stage_{i}")(x, train)
            if i != len(c.widths) - 1:
                x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(c.num_classes, dtype=c.dtype, param_dtype=c.param_dtype, name="head")(x)


def _init(config: Config):
    model = ConvNet(config)
    images = jnp.zeros((1, config.image_size, config.image_size, config.channels), config.dtype)
    return lambda: dict(model.init(jax.random.key(0), images, train=False))


def _batch(config: Config, abstract: bool):
    rng = common.batch_rng()
    shape = (config.batch, config.image_size, config.image_size, config.channels)
    return {
        "images": common.random_normal(rng, shape, jnp.float32, abstract=abstract),
        "labels": common.random_tokens(rng, (config.batch,), config.num_classes, abstract=abstract),
    }


def _loss(logits, labels):
    return common.cross_entropy(logits, labels)


def make_train_step(config: Config = TINY, *, abstract: bool = False):
    model = ConvNet(config)
    tx = common.make_optimizer()
    init = _init(config)

    def both():
        variables = init()
        return variables, tx.init(variables["params"])

    variables, opt_state = common.init_or_abstract(both, abstract=abstract)

    def train_step(variables, opt_state, batch):
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": variables["batch_stats"]},
                batch["images"],
                train=True,
                mutable=["batch_stats"],
            )
            return _loss(logits, batch["labels"]), updates["batch_stats"]

        params = variables["params"]
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return {"params": new_params, "batch_stats": batch_stats}, new_opt_state, loss

    return train_step, (variables, opt_state, _batch(config, abstract))


def make_forward(config: Config = TINY, abstract: bool = False):
    model = ConvNet(config)
    variables = common.init_or_abstract(_init(config), abstract=abstract)

    def loss_fn(variables, batch):
        logits = model.apply(variables, batch["images"], train=False)
        return _loss(logits, batch["labels"])

    return loss_fn, (variables, _batch(config, abstract))
