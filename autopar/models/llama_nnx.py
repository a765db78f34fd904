"""A flax NNX Llama-style decoder.

Modules (attribute paths in the ``nnx.State``): ``embed`` (``nnx.Embed``, ``embedding``
``[vocab, hidden]``), ``layers`` (an ``nnx.List`` of ``Block``; state paths
``layers/<i>/...``), each block with ``attn_norm`` (RMSNorm ``scale``), ``attn`` (grouped-query
attention with bias-free ``q`` ``[hidden, heads*head_dim]``, ``k``/``v``
``[hidden, kv_heads*head_dim]``, ``o`` ``[heads*head_dim, hidden]`` and rotary position
embeddings), ``mlp_norm`` and ``mlp`` (SwiGLU: ``gate``/``up`` ``[hidden, ffn]``, ``down``
``[ffn, hidden]``); final ``norm`` and an untied ``lm_head`` ``[hidden, vocab]``.

The train step takes ``(state, opt_state, batch)`` where ``state`` is the ``nnx.State`` from
``nnx.split(model)`` (only ``nnx.Param`` variables; its leaves are ``Param`` nodes holding
arrays, so tree paths end in ``.value``) and calls ``nnx.merge(graphdef, state)`` inside.

With ``Config(annotate=True)`` params carry ``out_sharding`` metadata (flax 0.12's name for
the ``sharding`` annotation of ``nnx.with_partitioning``) with mesh axis names
``'data'``/``'model'`` (Megatron layout plus vocab-parallel embeddings); it is created with
``eager_sharding=False`` so building the model needs no mesh. Read it with
``nnx.get_partition_spec(state)``.

Parameters float32, compute in ``Config.dtype``.

Batch: ``{'tokens': int32 [batch, seq], 'targets': int32 [batch, seq]}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from autopar.models import common


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    seq: int = 16
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    layers: int = 2
    batch: int = 8
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    annotate: bool = False
    scan_layers: bool = False   # stack the blocks (nnx.vmap) and run them with nnx.scan

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = Config()
#: A Llama-style 1B-ish shape, 4 layers (compile only).
REALISTIC = Config(
    vocab=32768,
    seq=2048,
    hidden=2048,
    heads=16,
    kv_heads=4,
    ffn=5632,
    layers=4,
    batch=8,
    dtype=jnp.bfloat16,
)


def _init_with(config: Config, init, sharding):
    if config.annotate and sharding is not None:
        return nnx.with_partitioning(init, sharding, eager_sharding=False)
    return init


def _linear(config: Config, din: int, dout: int, sharding, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        din,
        dout,
        use_bias=False,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        kernel_init=_init_with(config, nnx.initializers.lecun_normal(), sharding),
        rngs=rngs,
    )


_COLUMN = (None, "model")
_ROW = ("model", None)


class RMSNorm(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        del rngs
        self.eps = config.norm_eps
        self.dtype = config.dtype
        init = _init_with(config, nnx.initializers.ones, (None,))
        self.scale = nnx.Param(init(jax.random.key(0), (config.hidden,), config.param_dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        rms = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        scale = self.scale.value.astype(jnp.float32)
        return (x32 * rms * scale[None, None, :]).astype(self.dtype)


def rope(x, theta: float):
    """Rotary position embedding on ``[batch, seq, heads, head_dim]`` (half-split layout)."""
    _, s, _, d = x.shape
    half = d // 2
    freqs = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * freqs[None, :]  # [S, half]
    sin = jnp.sin(angles)[None, :, None, :]
    cos = jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.q = _linear(c, c.hidden, c.heads * c.head_dim, _COLUMN, rngs)
        self.k = _linear(c, c.hidden, c.kv_heads * c.head_dim, _COLUMN, rngs)
        self.v = _linear(c, c.hidden, c.kv_heads * c.head_dim, _COLUMN, rngs)
        self.o = _linear(c, c.heads * c.head_dim, c.hidden, _ROW, rngs)

    def __call__(self, x):
        c = self.config
        b, s, _ = x.shape
        q = rope(self.q(x).reshape(b, s, c.heads, c.head_dim), c.rope_theta)
        k = rope(self.k(x).reshape(b, s, c.kv_heads, c.head_dim), c.rope_theta)
        v = self.v(x).reshape(b, s, c.kv_heads, c.head_dim)
        groups = c.heads // c.kv_heads
        k = jnp.repeat(k, groups, axis=2)
        v = jnp.repeat(v, groups, axis=2)
        out = common.attention(q, k, v, causal=True, dtype=c.dtype)
        return self.o(out.reshape(b, s, c.heads * c.head_dim))


class SwiGLU(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        c = config
        self.gate = _linear(c, c.hidden, c.ffn, _COLUMN, rngs)
        self.up = _linear(c, c.hidden, c.ffn, _COLUMN, rngs)
        self.down = _linear(c, c.ffn, c.hidden, _ROW, rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config, rngs)
        self.attn = Attention(config, rngs)
        self.mlp_norm = RMSNorm(config, rngs)
        self.mlp = SwiGLU(config, rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        c = config
        self.embed = nnx.Embed(
            c.vocab,
            c.hidden,
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            embedding_init=_init_with(
                c, nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0),
                ("model", None),
            ),
            rngs=rngs,
        )
        if c.scan_layers:
            @nnx.split_rngs(splits=c.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs):
                return Block(c, rngs)

            self.blocks = stacked(rngs)
        else:
            self.layers = nnx.List([Block(c, rngs) for _ in range(c.layers)])
        self.norm = RMSNorm(c, rngs)
        self.lm_head = _linear(c, c.hidden, c.vocab, _COLUMN, rngs)
        self.scan_layers = c.scan_layers

    def __call__(self, tokens):
        x = self.embed(tokens)
        if self.scan_layers:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, block):
                return block(x)

            x = run(x, self.blocks)
        else:
            for block in self.layers:
                x = block(x)
        return self.lm_head(self.norm(x))


def _split(config: Config, abstract: bool):
    """``(graphdef, state)``; with ``abstract`` the state's leaves are ShapeDtypeStructs."""
    def create():
        return Llama(config, nnx.Rngs(params=jax.random.key(0)))

    graphdef, abstract_state = nnx.split(nnx.eval_shape(create))
    if abstract:
        return graphdef, abstract_state
    # Initialise under jit (one cheap compile) rather than eagerly op by op.
    return graphdef, common.run_init(lambda: nnx.split(create())[1])


def _batch(config: Config, abstract: bool):
    rng = common.batch_rng()
    shape = (config.batch, config.seq)
    return {
        "tokens": common.random_tokens(rng, shape, config.vocab, abstract=abstract),
        "targets": common.random_tokens(rng, shape, config.vocab, abstract=abstract),
    }


def _loss_fn(graphdef):
    def loss_fn(state, batch):
        model = nnx.merge(graphdef, state)
        logits = model(batch["tokens"])
        return common.cross_entropy(logits, batch["targets"])

    return loss_fn


def make_model(config: Config = TINY) -> Llama:
    """The NNX module itself (eager, concrete params)."""
    return Llama(config, nnx.Rngs(params=jax.random.key(0)))


def make_train_step(config: Config = TINY, *, abstract: bool = False):
    tx = common.make_optimizer()
    graphdef, state = _split(config, abstract)
    opt_state = jax.eval_shape(tx.init, state) if abstract else jax.jit(tx.init)(state)
    step = common.build_train_step(_loss_fn(graphdef), tx)
    return step, (state, opt_state, _batch(config, abstract))


def make_forward(config: Config = TINY, abstract: bool = False):
    graphdef, state = _split(config, abstract)
    return _loss_fn(graphdef), (state, _batch(config, abstract))
