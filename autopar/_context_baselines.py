"""Hand-written context-parallel baselines: the program a user writes for long sequences.

Every device of the mesh is one axis ``cp``. The tokens are split along the sequence over
``cp``, parameters and optimizer state are sharded ZeRO-3 style over ``cp`` (as MaxText pairs
FSDP with context parallelism), XLA's propagation shards the rest from there, and each
attention of the step's ``autopar.value_and_grad`` loss (recognized as autopar recognizes it,
``passes.attention_match``) runs as one fixed region over ``cp``:

``ulysses``
    all-to-all from sequence-sharded to head-sharded, attention over the whole sequence, and
    back (``cp`` must divide the kv heads);
``ring``
    K/V rotated around ``cp`` with an online softmax; the backward rotates again.

The regions are those of ``passes.sequence_parallel``, with no choice left to a planner.

Example::

    compiled = compile_context_baseline(train_step, args, mesh, "ring")
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar._mesh import as_auto_mesh
from autopar.errors import ArgumentError
from autopar.passes import attention_match
from autopar.passes import sequence_parallel as sp
from autopar.passes.strategies import Rewrite, RewriteKind

AXIS = "cp"


class ContextBaseline(enum.Enum):
    ULYSSES = "ulysses"
    RING = "ring"


def one_axis_mesh(mesh) -> Mesh:
    """Every device of ``mesh`` (a Mesh or a dict of axis sizes) on one Auto axis ``cp``."""
    devices = as_auto_mesh(mesh).devices.reshape(-1)
    return Mesh(devices, (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def context_attention(mesh: Mesh, kind: ContextBaseline | str):
    """``(q, k, v, kv_mask, causal, scale) -> o``: attention as ``kind``'s region over
    ``mesh``'s one axis, with a custom VJP running the backward region."""
    kind = ContextBaseline(kind)
    names = (("ulysses", AXIS if kind is ContextBaseline.ULYSSES else None),
             ("ring", AXIS if kind is ContextBaseline.RING else None))
    rewrite_kind = (RewriteKind.RING_ATTENTION if kind is ContextBaseline.RING
                    else RewriteKind.ULYSSES_ATTENTION)
    rewrite = Rewrite(rewrite_kind, (AXIS,), names)

    def attend(q, k, v, kv_mask, causal, scale):
        if kind is ContextBaseline.ULYSSES and k.shape[2] % mesh.devices.size:
            raise ArgumentError(f"the ulysses baseline needs the {k.shape[2]} kv heads to be a "
                                f"multiple of the {mesh.devices.size} devices; use \"ring\".")
        reg = sp.region(mesh, rewrite, causal=causal, scale=scale, seq=q.shape[1])
        forward, backward = sp.forward_region(reg), sp.backward_region(reg)

        @jax.custom_vjp
        def run(q, k, v, kv_mask):
            return forward(q, k, v, kv_mask)[0]

        def run_fwd(q, k, v, kv_mask):
            o, lse = forward(q, k, v, kv_mask)
            return o, (q, k, v, kv_mask, o, lse)

        def run_bwd(res, do):
            return (*backward(*res, do), None)

        run.defvjp(run_fwd, run_bwd)
        mask = jnp.ones(k.shape[:2], bool) if kv_mask is None else kv_mask
        return run(q, k, v, mask)

    return attend


def context_shardings(args, mesh: Mesh):
    """PartitionSpecs for ``(params, opt_state, batch)``: ZeRO-3 over ``cp`` for the state
    (its largest dim ``cp`` divides), the batch's ``[batch, seq, ...]`` leaves split on seq."""
    def state(x):
        dims = [d for d in sorted(range(len(x.shape)), key=lambda d: -x.shape[d])
                if x.shape[d] % mesh.devices.size == 0]
        spec = [None] * len(x.shape)
        if dims:
            spec[dims[0]] = AXIS
        return PartitionSpec(*spec)

    def batch(x):
        if len(x.shape) >= 2 and x.shape[1] % mesh.devices.size == 0:
            return PartitionSpec(None, AXIS)
        return PartitionSpec()
    *head, last = args
    return (*[jax.tree.map(state, a) for a in head], jax.tree.map(batch, last))


def _check_train_step(fn, args) -> None:
    """ArgumentError unless ``fn(params, opt_state, batch)`` returns ``(params, opt_state,
    loss)``: the baselines keep the new state in the state's shardings."""
    out = jax.eval_shape(fn, *args) if len(args) == 3 else None
    structure = jax.tree.structure
    if not (isinstance(out, tuple) and len(out) == 3 and structure(out[0]) == structure(args[0])
            and structure(out[1]) == structure(args[1])):
        raise ArgumentError(
            "the context-parallel baselines (ulysses, ring) take a train step "
            "`fn(params, opt_state, batch) -> (params, opt_state, loss)`; this function's "
            "arguments or results are not of that form. Compare it with the other baselines "
            "(`kinds=` without 'ulysses' and 'ring').")


def compile_context_baseline(fn, args, mesh, kind: ContextBaseline | str):
    """``fn(params, opt_state, batch) -> (params, opt_state, loss)`` compiled as ``kind``'s
    hand-written context-parallel program on every device of ``mesh`` (nothing runs)."""
    _check_train_step(fn, args)
    cp = one_axis_mesh(mesh)
    specs = context_shardings(args, cp)
    named = jax.tree.map(lambda s: NamedSharding(cp, s), specs,
                         is_leaf=lambda s: isinstance(s, PartitionSpec))
    outs = (named[0], named[1], NamedSharding(cp, PartitionSpec()))
    with attention_match.recognizing(context_attention(cp, kind)):
        lowered = jax.jit(fn, in_shardings=named, out_shardings=outs).lower(*args)
    return lowered.compile()
