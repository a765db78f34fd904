"""A flax linen BERT-like encoder with a masked-LM loss.

Token embedding ``embed`` + learned position embedding ``pos_embed``, embedding LayerNorm
``embed_ln``, then post-LayerNorm encoder blocks ``block_0``, ... (non-causal multi-head
attention with the fused ``qkv`` Dense and ``attn_out``, residual, ``ln_1``; gelu MLP
``mlp_in``/``mlp_out``, residual, ``ln_2``), and an untied output Dense ``lm_head``
``[hidden, vocab]``. The loss is softmax cross entropy over the vocabulary, averaged over the
masked positions (``batch['weights']`` is 1.0 where a token was masked).

Parameters float32, compute in ``Config.dtype``.

Batch: ``{'tokens': int32 [batch, seq] (already masked), 'targets': int32 [batch, seq],
'weights': float32 [batch, seq]}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from autopar.models import common


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    seq: int = 16
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    batch: int = 8
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    mlp_ratio: int = 4
    mask_rate: float = 0.15
    mask_token: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = Config()
#: BERT-large widths, 4 layers (compile only).
REALISTIC = Config(
    vocab=30720, seq=512, hidden=1024, heads=16, layers=4, batch=32, dtype=jnp.bfloat16
)


def _dense(config: Config, features: int, name: str) -> nn.Dense:
    return nn.Dense(features, dtype=config.dtype, param_dtype=config.param_dtype, name=name)


def _layer_norm(config: Config, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=1e-12, dtype=config.dtype, param_dtype=config.param_dtype, name=name
    )


class EncoderBlock(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        c = self.config
        b, s, _ = x.shape
        qkv = _dense(c, 3 * c.hidden, "qkv")(x).reshape(b, s, c.heads, 3, c.head_dim)
        q, k, v = qkv[:, :, :, 0, :], qkv[:, :, :, 1, :], qkv[:, :, :, 2, :]
        attn = common.attention(q, k, v, causal=False, dtype=c.dtype).reshape(b, s, c.hidden)
        x = _layer_norm(c, "ln_1")(x + _dense(c, c.hidden, "attn_out")(attn))
        h = nn.gelu(_dense(c, c.mlp_ratio * c.hidden, "mlp_in")(x))
        return _layer_norm(c, "ln_2")(x + _dense(c, c.hidden, "mlp_out")(h))


class Bert(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        x = nn.Embed(c.vocab, c.hidden, dtype=c.dtype, param_dtype=c.param_dtype, name="embed")(
            tokens
        )
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        x = x + nn.Embed(
            c.seq, c.hidden, dtype=c.dtype, param_dtype=c.param_dtype, name="pos_embed"
        )(positions)
        x = _layer_norm(c, "embed_ln")(x)
        for i in range(c.layers):
            x = EncoderBlock(c, name=f"block_{i}")(x)
        return _dense(c, c.vocab, "lm_head")(x)


def _init(config: Config):
    model = Bert(config)
    tokens = jnp.zeros((1, config.seq), jnp.int32)
    return lambda: model.init(jax.random.key(0), tokens)["params"]


def _batch(config: Config, abstract: bool):
    shape = (config.batch, config.seq)
    if abstract:
        return {
            "tokens": common.shape_struct(shape, jnp.int32),
            "targets": common.shape_struct(shape, jnp.int32),
            "weights": common.shape_struct(shape, jnp.float32),
        }
    rng = common.batch_rng()
    targets = rng.integers(1, config.vocab, size=shape, dtype=np.int32)
    masked = rng.random(size=shape) < config.mask_rate
    masked[:, 0] = True  # at least one masked position per row
    tokens = np.where(masked, np.int32(config.mask_token), targets).astype(np.int32)
    return {
        "tokens": jnp.asarray(tokens),
        "targets": jnp.asarray(targets),
        "weights": jnp.asarray(masked.astype(np.float32)),
    }


def _loss_fn(config: Config):
    model = Bert(config)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])
        return common.cross_entropy(logits, batch["targets"], batch["weights"])

    return loss_fn


def make_train_step(config: Config = TINY, *, abstract: bool = False):
    return common.linen_train_step(_init(config), _loss_fn(config), _batch(config, abstract))


def make_forward(config: Config = TINY, abstract: bool = False):
    return common.linen_forward(_init(config), _loss_fn(config), _batch(config, abstract))
