"""A GShard/Switch-style mixture-of-experts decoder in flax linen.

Token embedding ``embed``, then blocks ``block_0``, ... each with pre-LayerNorm causal
attention (``ln_1``, fused ``qkv``, ``attn_out``) and a pre-LayerNorm MoE feed-forward layer
``moe`` (``ln_2``), final LayerNorm ``ln_f`` and logits through the tied embedding.

The MoE layer (module ``moe``):

* router: ``Dense`` named ``router`` (``[hidden, experts]``, no bias, float32), softmax;
* top-k routing (``k = Config.top_k``, 2) with :func:`jax.lax.top_k`, gates renormalised over
  the k choices;
* capacity ``C = ceil(k * group_size * capacity_factor / experts)`` per expert and group; each
  token's slot in an expert comes from ``jnp.cumsum`` over the one-hot expert masks (earlier
  choices first), tokens past capacity are dropped;
* one-hot ``dispatch`` and gate-weighted ``combine`` tensors ``[G, S, E, C]`` applied with
  einsums: ``'gsec,gsm->egcm'`` in, ``'gsec,egcm->gsm'`` out;
* expert weights are plain params with a leading expert dim: ``experts_in`` ``[E, hidden,
  ffn]`` and ``experts_out`` ``[E, ffn, hidden]``, applied with ``'egcm,emf->egcf'`` and
  ``'egcf,efm->egcm'``;
* a Switch load-balancing loss ``E * sum_e f_e * P_e`` (fraction of tokens whose top-1 choice
  is e times mean router probability of e), added to the loss times ``aux_loss_coef``.

Groups are the sequences of the batch (G = batch, S = seq).

Batch: ``{'tokens': int32 [batch, seq], 'targets': int32 [batch, seq]}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from autopar.models import common


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 16
    hidden: int = 32
    ffn: int = 64
    heads: int = 4
    layers: int = 1
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 2.0
    batch: int = 8
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    aux_loss_coef: float = 0.01

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def capacity(self) -> int:
        return int(math.ceil(self.top_k * self.seq * self.capacity_factor / self.experts))


TINY = Config()
REALISTIC = Config(
    vocab=32768,
    seq=1024,
    hidden=2048,
    ffn=8192,
    heads=16,
    layers=2,
    experts=16,
    capacity_factor=1.25,
    batch=16,
    dtype=jnp.bfloat16,
)


def _dense(config: Config, features: int, name: str) -> nn.Dense:
    return nn.Dense(features, dtype=config.dtype, param_dtype=config.param_dtype, name=name)


def _layer_norm(config: Config, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=1e-5, dtype=config.dtype, param_dtype=config.param_dtype, name=name)


class MoELayer(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        """``x`` ``[G, S, M]`` -> (``[G, S, M]``, scalar load-balancing loss)."""
        c = self.config
        g, s, m = x.shape
        e, k, cap = c.experts, c.top_k, c.capacity
        f32 = jnp.float32

        router = nn.Dense(e, use_bias=False, dtype=f32, param_dtype=c.param_dtype, name="router")
        probs = jax.nn.softmax(router(x.astype(f32)), axis=-1)  # [G, S, E]
        gates, expert_idx = jax.lax.top_k(probs, k)  # [G, S, K]
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)

        # Switch load-balancing loss on the top-1 choice.
        top1 = jax.nn.one_hot(expert_idx[:, :, 0], e, dtype=f32)
        aux = jnp.mean(jnp.mean(top1, axis=1) * jnp.mean(probs, axis=1)) * (e * e)

        counts = jnp.zeros((g, 1, e), f32)
        dispatch = jnp.zeros((g, s, e, cap), f32)
        combine = jnp.zeros((g, s, e, cap), f32)
        for j in range(k):
            mask = jax.nn.one_hot(expert_idx[:, :, j], e, dtype=f32)  # [G, S, E]
            position = jnp.cumsum(mask, axis=1) - 1.0 + counts  # slot in the chosen expert
            counts = counts + jnp.sum(mask, axis=1, keepdims=True)
            mask = mask * (position < cap).astype(f32)
            slot = jax.nn.one_hot(position.astype(jnp.int32), cap, dtype=f32)  # [G, S, E, C]
            chosen = mask[:, :, :, None] * slot
            dispatch = dispatch + chosen
            combine = combine + gates[:, :, j][:, :, None, None] * chosen

        init = nn.initializers.lecun_normal(batch_axis=(0,))  # fan-in per expert
        w_in = self.param("experts_in", init, (e, m, c.ffn), c.param_dtype)
        w_out = self.param("experts_out", init, (e, c.ffn, m), c.param_dtype)
        expert_in = jnp.einsum("gsec,gsm->egcm", dispatch.astype(c.dtype), x.astype(c.dtype))
        h = nn.gelu(jnp.einsum("egcm,emf->egcf", expert_in, w_in.astype(c.dtype)))
        expert_out = jnp.einsum("egcf,efm->egcm", h, w_out.astype(c.dtype))
        y = jnp.einsum("gsec,egcm->gsm", combine.astype(c.dtype), expert_out)
        return y, aux


class MoEBlock(nn.Module):
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
        y, aux = MoELayer(c, name="moe")(_layer_norm(c, "ln_2")(x))
        return x + y, aux


class MoETransformer(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        embed = nn.Embed(c.vocab, c.hidden, dtype=c.dtype, param_dtype=c.param_dtype, name="embed")
        x = embed(tokens)
        aux_total = jnp.zeros((), jnp.float32)
        for i in range(c.layers):
            x, aux = MoEBlock(c, name=f"block_{i}")(x)
            aux_total = aux_total + aux
        x = _layer_norm(c, "ln_f")(x)
        return embed.attend(x), aux_total


def _init(config: Config):
    model = MoETransformer(config)
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
    model = MoETransformer(config)

    def loss_fn(params, batch):
        logits, aux = model.apply({"params": params}, batch["tokens"])
        return common.cross_entropy(logits, batch["targets"]) + config.aux_loss_coef * aux

    return loss_fn


def make_train_step(config: Config = TINY, *, abstract: bool = False):
    return common.linen_train_step(_init(config), _loss_fn(config), _batch(config, abstract))


def make_forward(config: Config = TINY, abstract: bool = False):
    return common.linen_forward(_init(config), _loss_fn(config), _batch(config, abstract))
