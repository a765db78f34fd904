"""Shared pieces of the example models: optimizer, train-step builder, abstract args, jaxpr tools.

Every model module builds its train step the same way::

    train_step(params, opt_state, batch) -> (new_params, new_opt_state, loss)

a pure single-device function (``jax.value_and_grad`` of the loss, then an optax update) that
the planner and the baselines jit with shardings. ``example_args`` is ``(params, opt_state,
batch)``; with ``abstract=True`` every leaf is a :class:`jax.ShapeDtypeStruct` and nothing is
computed (parameters come from :func:`jax.eval_shape` on the init function).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

#: Adam epsilon used by every example so that sharded and single-device runs compare closely.
ADAM_EPS = 1e-6
#: Learning rate of every example optimizer.
LEARNING_RATE = 1e-3


def make_optimizer(learning_rate: float = LEARNING_RATE, *, weight_decay: float = 0.0):
    """Adam (or AdamW when ``weight_decay`` > 0) with ``eps=1e-6``."""
    if weight_decay:
        return optax.adamw(learning_rate, eps=ADAM_EPS, weight_decay=weight_decay)
    return optax.adam(learning_rate, eps=ADAM_EPS)


def build_train_step(loss_fn: Callable[[Any, Any], jax.Array], tx, *,
                     value_and_grad: Callable = jax.value_and_grad) -> Callable:
    """``train_step(params, opt_state, batch)`` for a loss ``loss_fn(params, batch) -> scalar``;
    ``value_and_grad``: jax's, or ``autopar.value_and_grad`` to mark the loss for pipelining."""

    def train_step(params, opt_state, batch):
        loss, grads = value_and_grad(loss_fn)(params, batch)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return new_params, new_opt_state, loss

    return train_step


#: XLA options for compiling one-off initialisers. Backend optimisation level 0 compiles
#: flax/threefry initialisers ~5x faster on CPU (random init dominates the TINY models' set-up
#: time); values match the default compile to within an ulp and are deterministic.
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def run_init(fn: Callable[[], Any]):
    """Compile (cheaply, see :data:`INIT_COMPILER_OPTIONS`) and run a no-argument init function."""
    return jax.jit(fn).lower().compile(compiler_options=INIT_COMPILER_OPTIONS)()


def init_or_abstract(fn: Callable[[], Any], *, abstract: bool):
    """``fn()`` computed by :func:`run_init`, or with ``abstract`` only its ShapeDtypeStructs."""
    return jax.eval_shape(fn) if abstract else run_init(fn)


def init_params_and_opt(init_fn: Callable[[], Any], tx, *, abstract: bool):
    """Run (or, with ``abstract``, only shape-evaluate) ``init_fn`` and ``tx.init``."""

    def both():
        params = init_fn()
        return params, tx.init(params)

    return init_or_abstract(both, abstract=abstract)


def linen_train_step(init_fn: Callable[[], Any], loss_fn, batch, tx=None, *,
                     value_and_grad: Callable = jax.value_and_grad):
    """(train_step, (params, opt_state, batch)) for a linen model given its init, loss and
    batch; the shared body of the models' ``make_train_step``. ``tx``: an optax optimizer
    (default :func:`make_optimizer`); ``value_and_grad`` as :func:`build_train_step` takes
    it."""
    tx = make_optimizer() if tx is None else tx
    abstract = all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(batch))
    params, opt_state = init_params_and_opt(init_fn, tx, abstract=abstract)
    return (build_train_step(loss_fn, tx, value_and_grad=value_and_grad),
            (params, opt_state, batch))


def linen_forward(init_fn: Callable[[], Any], loss_fn, batch):
    abstract = all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(batch))
    return loss_fn, (init_or_abstract(init_fn, abstract=abstract), batch)


def shape_struct(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def batch_rng(seed: int = 1) -> np.random.Generator:
    """The numpy generator example batches are drawn from (host-side: no XLA compile)."""
    return np.random.default_rng(seed)


def random_tokens(rng: np.random.Generator, shape, vocab: int, *, abstract: bool, low: int = 0):
    """Integer tokens in ``[low, vocab)`` (int32), or their ShapeDtypeStruct."""
    if abstract:
        return shape_struct(shape, jnp.int32)
    return jnp.asarray(rng.integers(low, vocab, size=shape, dtype=np.int32))


def random_normal(rng: np.random.Generator, shape, dtype, *, abstract: bool):
    """Standard-normal floats, or their ShapeDtypeStruct."""
    if abstract:
        return shape_struct(shape, dtype)
    return jnp.asarray(rng.standard_normal(size=shape).astype(jnp.dtype(dtype)))


def to_abstract(tree):
    """Every array leaf of ``tree`` as a ShapeDtypeStruct."""
    return jax.tree.map(lambda x: shape_struct(np.shape(x), x.dtype), tree)


def cross_entropy(logits: jax.Array, labels: jax.Array, weights: jax.Array | None = None):
    """Mean softmax cross entropy in float32 (optionally weighted per position)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    if weights is None:
        return jnp.mean(losses)
    weights = weights.astype(jnp.float32)
    return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def causal_mask(seq: int) -> jax.Array:
    """Boolean ``[1, 1, seq, seq]`` mask, True where a query may attend to a key."""
    return jnp.tril(jnp.ones((seq, seq), dtype=jnp.bool_))[None, None, :, :]


def attention(q, k, v, *, causal: bool, dtype):
    """Multi-head dot-product attention on ``[batch, seq, heads, head_dim]`` inputs.

    Logits and softmax are computed in float32; the result is cast back to ``dtype``.
    ``k``/``v`` may have fewer heads than ``q`` only if the caller repeats them first.
    """
    head_dim = q.shape[-1]
    scale = jnp.asarray(1.0 / np.sqrt(head_dim), dtype=jnp.float32)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        mask = causal_mask(q.shape[1])
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


# ----------------------------------------------------------------------------- jaxpr tools


def _sub_jaxprs(value):
    """Jaxprs held by an equation parameter (a jaxpr, a closed jaxpr, or a sequence of them)."""
    from jax.extend import core as jex_core

    if isinstance(value, jex_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def jaxpr_primitives(jaxpr) -> set[str]:
    """Names of every primitive in ``jaxpr`` (a Jaxpr or ClosedJaxpr), recursing into sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    names: set[str] = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in _sub_jaxprs(param):
                names |= jaxpr_primitives(sub)
    return names


def primitives_of(fn: Callable, *args) -> set[str]:
    """Primitive names (recursive) of ``jax.make_jaxpr(fn)(*args)``; args may be abstract."""
    return jaxpr_primitives(jax.make_jaxpr(fn)(*args))
