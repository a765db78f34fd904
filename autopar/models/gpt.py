"""A flax linen GPT-2 style decoder.

Token embedding ``embed`` (``[vocab, hidden]``) + learned position embedding ``pos_embed``
(``[seq, hidden]``), pre-LayerNorm blocks (``ln_1``, causal multi-head attention with the fused
``qkv`` Dense ``[hidden, 3*hidden]`` and ``attn_out`` ``[hidden, hidden]``, ``ln_2``, gelu MLP
``mlp_in`` ``[hidden, 4*hidden]`` / ``mlp_out`` ``[4*hidden, hidden]``), final LayerNorm
``ln_f`` and logits through the tied token embedding (``embed.attend``); softmax cross entropy.

The fused qkv output is laid out heads-major (``[..., heads, 3, head_dim]``), so sharding its
output dim Megatron-style gives each shard whole heads with their q, k and v.

Blocks are an unrolled Python loop of ``block_0``, ``block_1``, ... or, with
``scan_layers=True``, one ``nn.scan`` module ``blocks`` whose params have a leading layer axis
(``params['blocks']['qkv']['kernel']`` is ``[layers, hidden, 3*hidden]``).

Precision follows MaxText: parameters (and optimizer state) float32, compute in
``Config.dtype`` (float32 for TINY, bfloat16 for REALISTIC); attention softmax and the loss in
float32.

Batch: ``{'tokens': int32 [batch, seq], 'targets': int32 [batch, seq]}``.
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
    vocab: int = 128
    seq: int = 16
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    batch: int = 8
    dtype: Any = jnp.float32  # compute dtype
    param_dtype: Any = jnp.float32
    mlp_ratio: int = 4
    scan_layers: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = Config()
TINY_SCAN = Config(scan_layers=True)
REALISTIC = Config(
    vocab=32768, seq=1024, hidden=2048, heads=16, layers=4, batch=16, dtype=jnp.bfloat16
)
REALISTIC_SCAN = Config(
    vocab=32768,
    seq=1024,
    hidden=2048,
    heads=16,
    layers=4,
    batch=16,
    dtype=jnp.bfloat16,
    scan_layers=True,
)


def _dense(config: Config, features: int, name: str) -> nn.Dense:
    return nn.Dense(features, dtype=config.dtype, param_dtype=config.param_dtype, name=name)


def _layer_norm(config: Config, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=1e-5, dtype=config.dtype, param_dtype=config.param_dtype, name=name)


class Block(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        c = self.config
        b, s, _ = x.shape
        h = _layer_norm(c, "ln_1")(x)
        qkv = _dense(c, 3 * c.hidden, "qkv")(h).reshape(b, s, c.heads, 3, c.head_dim)
        q, k, v = qkv[:, :, :, 0, :], qkv[:, :, :, 1, :], qkv[:, :, :, 2, :]
        attn = common.attention(q, k, v, causal=True, dtype=c.dtype).reshape(b, s, c.hidden)
        x = x + _dense(c, c.hidden, "attn_out")(attn)
        h = _layer_norm(c, "ln_2")(x)
        h = nn.gelu(_dense(c, c.mlp_ratio * c.hidden, "mlp_in")(h))
        return x + _dense(c, c.hidden, "mlp_out")(h)


class ScanBlock(Block):
    """``Block`` with the ``(carry, out)`` signature ``nn.scan`` needs."""

    def __call__(self, x):  # type: ignore[override]
        return super().__call__(x), None


class GPT(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        embed = nn.Embed(c.vocab, c.hidden, dtype=c.dtype, param_dtype=c.param_dtype, name="embed")
        pos_embed = nn.Embed(
            c.seq, c.hidden, dtype=c.dtype, param_dtype=c.param_dtype, name="pos_embed"
        )
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        x = embed(tokens) + pos_embed(positions)
        if c.scan_layers:
            blocks = nn.scan(
                ScanBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=c.layers,
            )(c, name="blocks")
            x, _ = blocks(x)
        else:
            for i in range(c.layers):
                x = Block(c, name=f"block_{i}")(x)
        x = _layer_norm(c, "ln_f")(x)
        return embed.attend(x)


def _init(config: Config):
    model = GPT(config)
    tokens = jnp.zeros((1, config.seq), jnp.int32)
    return lambda: model.init(jax.random.key(0), tokens)["params"]


def _batch(config: Config, abstract: bool):
    rng = common.batch_rng()
    shape = (config.batch, config.seq)
    return {
        "tokens": common.random_tokens(rng, shape, config.vocab, abstract=abstract),
        "targets": common.random_tokens(rng, shape, config.vocab, abstract=abstract),
    }


def _loss_fn(config: Config):
    model = GPT(config)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])
        return common.cross_entropy(logits, batch["targets"])

    return loss_fn


def make_train_step(config: Config = TINY, *, abstract: bool = False, tx=None,
                    value_and_grad=jax.value_and_grad):
    """(train_step, (params, opt_state, batch)); ``tx`` an optax optimizer (default Adam);
    ``value_and_grad``: ``autopar.value_and_grad`` marks the loss, so that a plan may cut the
    scanned layers (``scan_layers=True``) into pipeline stages."""
    return common.linen_train_step(_init(config), _loss_fn(config), _batch(config, abstract),
                                   tx, value_and_grad=value_and_grad)


def make_forward(config: Config = TINY, abstract: bool = False):
    return common.linen_forward(_init(config), _loss_fn(config), _batch(config, abstract))
