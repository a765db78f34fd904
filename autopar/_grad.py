"""``autopar.value_and_grad`` and ``autopar.grad``: drop-in replacements for jax's that mark the
loss for pipelining.

Outside a pipelining context (:func:`autopar._pipeline.pipelining`) they are
``jax.value_and_grad`` / ``jax.grad``. Inside one they compute the same value and gradients
with the loss's layer stack pipelined over the context's mesh
(:mod:`autopar.passes.stages`), and count the call on the context.

Example::

    loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax

from autopar._pipeline import active
from autopar.errors import ArgumentError
from autopar.passes import attention_match
from autopar.passes.stages import emit, prepare


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   holomorphic: bool = False, allow_int: bool = False) -> Callable:
    """Like ``jax.value_and_grad`` (same arguments and results), pipelined inside a
    pipelining context.

    Arguments:
        fun: the loss, ``fun(*args) -> scalar`` (or ``(scalar, aux)`` with ``has_aux``).
        argnums: which positional arguments to differentiate (int or tuple of ints).
        has_aux, holomorphic, allow_int: as in ``jax.value_and_grad``.

    Returns:
        ``f(*args, **kwargs) -> (value, grads)`` (``((value, aux), grads)`` with ``has_aux``).
    """
    plain = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, holomorphic=holomorphic,
                               allow_int=allow_int)

    def unpipelined(*args, **kwargs):
        if not attention_match.active():
            return plain(*args, **kwargs)
        # autopar is tracing the step: attention in the loss becomes one planned node
        return jax.value_and_grad(attention_match.with_attention(functools.partial(fun, **kwargs)),
                                  argnums=argnums, has_aux=has_aux, holomorphic=holomorphic,
                                  allow_int=allow_int)(*args)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        context = active()
        if context is None:
            return unpipelined(*args, **kwargs)
        context.calls += 1
        if context.settings is None:   # only marking: plan() asks whether the step can pipeline
            return unpipelined(*args, **kwargs)
        if holomorphic or allow_int:
            raise ArgumentError("`holomorphic` and `allow_int` are not supported by a pipelined "
                                "`autopar.value_and_grad`; leave them False.")
        fun_args = functools.partial(fun, **kwargs)
        pipelined = _pipelined(fun_args, args, argnums, has_aux, context)
        return jax.value_and_grad(pipelined, argnums=argnums, has_aux=has_aux)(*args)

    return wrapped


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         holomorphic: bool = False, allow_int: bool = False) -> Callable:
    """Like ``jax.grad``, pipelined inside a pipelining context (see :func:`value_and_grad`).

    Arguments:
        fun: the loss, ``fun(*args) -> scalar`` (or ``(scalar, aux)`` with ``has_aux``).
        argnums, has_aux, holomorphic, allow_int: as in ``jax.grad``.

    Returns:
        ``f(*args, **kwargs) -> grads`` (``(grads, aux)`` with ``has_aux``).
    """
    both = value_and_grad(fun, argnums=argnums, has_aux=has_aux, holomorphic=holomorphic,
                          allow_int=allow_int)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        value, grads = both(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def _pipelined(fun: Callable, args: tuple, argnums, has_aux: bool, context) -> Callable:
    """``fun`` with the same inputs and outputs, its layer stack pipelined."""
    flat, tree = jax.tree.flatten(args)
    picked = {argnums} if isinstance(argnums, int) else set(argnums)
    arg_index = [i for i, arg in enumerate(args) for _ in jax.tree.leaves(arg)]
    is_param = [i in picked for i in arg_index]
    _check_batch_argnums(context.settings.batch_argnums, picked, len(args))
    out_tree = []

    def flat_fun(*leaves):
        out = fun(*jax.tree.unflatten(tree, leaves))
        out_leaves, treedef = jax.tree.flatten(out)
        out_tree[:] = [treedef]
        return out_leaves

    prep = prepare.prepare(flat_fun, flat, is_param, arg_index, context.request(),
                           context.mesh, has_aux, context.plan_layer, context.plan_post)
    context.chosen.append(prep.choice())
    run = emit.pipelined(prep, context.mesh)

    def pipelined(*new_args):
        outs = run(*jax.tree.leaves(new_args))
        return jax.tree.unflatten(out_tree[0], list(outs))

    return pipelined


def _check_batch_argnums(batch_argnums, picked: set[int], n_args: int) -> None:
    """``Pipeline(batch_argnums=...)`` names positional arguments of the loss that are not
    differentiated."""
    if batch_argnums is None:
        return
    beyond = [i for i in batch_argnums if i >= n_args]
    if beyond:
        raise ArgumentError(
            f"`Pipeline(batch_argnums={batch_argnums})` names argument {beyond[0]}, but the "
            f"loss is called with {n_args} positional arguments (numbered from 0); name "
            "those that hold the batch.")
    both = sorted(picked & set(batch_argnums))
    if both:
        raise ArgumentError(
            f"`Pipeline(batch_argnums={batch_argnums})` names argument {both[0]}, which the "
            "loss is differentiated by (its `argnums`); a batch argument is split into "
            "microbatches and is not differentiated. Name only the arguments that hold the "
            "batch.")
