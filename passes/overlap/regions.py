"""Emission of the collective matmuls (``passes.overlap.collective_matmul``): a
``jax.shard_map`` manual over the rewrite's axis only (the plan's other axes stay automatic,
so its shardings over them hold inside), running a ``fori_loop`` of ring steps: each step's
``ppermute`` is issued before the step's partial matmul and used by the next step, so a
latency-hiding scheduler overlaps them.

A gather that keeps its operand (``CollectiveMatmul.keep``) also writes each arrived piece
into the gathered operand and returns it second; the emitter hands it to the later readers
that want the operand gathered (``Rewrite.keeps``).

The region is differentiable: a custom VJP saves only its operands' blocks and
differentiates the plain form (all-gather then dot, or dot then reduce-scatter), where
autodiff of the loop would keep every arrived block. Importing this module registers the
emitters in ``passes.emit.REWRITES``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from autopar.cost_model.spec import Spec
from autopar.passes.emit import REWRITES
from autopar.passes.overlap.collective_matmul import CollectiveMatmul, Mode
from autopar.passes.strategies import RewriteKind


def _manual(spec: Spec, axis: str) -> PartitionSpec:
    """``spec`` over ``axis`` only (the region's in/out specs)."""
    return PartitionSpec(*[axis if axis in dims else None for dims in spec.dims])


def _auto(spec: Spec, axis: str) -> PartitionSpec:
    """``spec`` without ``axis``: how the plan splits a block inside the region."""
    return Spec(tuple(tuple(a for a in dims if a != axis) for dims in spec.dims)
                ).to_partition_spec()


def _ring(n: int, shift: int) -> list[tuple[int, int]]:
    return [(j, (j + shift) % n) for j in range(n)]


class _Ring:
    """One region's local view: the axis, its size, this device's index, the dot, and how
    the result and the kept operand are pinned over the other axes."""

    def __init__(self, cm: CollectiveMatmul, n: int, dot, pin, pin_kept, me):
        self.cm, self.n, self.dot, self.pin, self.pin_kept, self.me = (
            cm, n, dot, pin, pin_kept, me)

    def send(self, x, shift: int):
        return lax.ppermute(x, self.cm.axis, _ring(self.n, shift))

    def prod(self, chunk, other):
        return self.dot(chunk, other) if self.cm.operand == 0 else self.dot(other, chunk)


def _halves(x, dim: int, parts: int) -> list:
    size = x.shape[dim] // parts
    return [lax.slice_in_dim(x, i * size, (i + 1) * size, axis=dim) for i in range(parts)]


def _gather(ring: _Ring, a, b):
    """All-gather of the operand ``cm.operand`` (on ``cm.dim``) fused with the dot: each
    arrived piece's product fills its result slice (free dim) or is added (contracting).
    The result, and with ``cm.keep`` the gathered operand too."""
    cm, n, me = ring.cm, ring.n, ring.me
    chunk, other = (a, b) if cm.operand == 0 else (b, a)
    parts = 2 if cm.bidirectional else 1
    block = chunk.shape[cm.dim]
    size = block // parts
    free = cm.mode is Mode.GATHER_FREE

    def product(piece, src, half):
        if free:
            return ring.prod(piece, other)
        start = src * block + half * size
        return ring.prod(piece, lax.dynamic_slice_in_dim(other, start, size, cm.other_dim))

    probe = jax.eval_shape(lambda p: product(p, 0, 0), _halves(chunk, cm.dim, parts)[0])
    shape = list(probe.shape)
    if free:
        shape[cm.out_dim] *= n * parts
        acc_dtype = probe.dtype
    else:
        acc_dtype = _accumulator(probe.dtype)
    out = ring.pin(jnp.zeros(shape, acc_dtype))
    whole = list(chunk.shape)
    whole[cm.dim] *= n
    kept = ring.pin_kept(jnp.zeros(whole, chunk.dtype)) if cm.keep else None

    def add(out, piece, src, half):
        y = product(piece, src, half)
        if free:
            return lax.dynamic_update_slice_in_dim(out, y, src * block + half * size, cm.out_dim)
        return out + y.astype(acc_dtype)

    def visit(out, kept, pieces, k):
        # piece 0 (one-directional: the whole block) came from me - k, piece 1 from me + k
        sources = ((me - k) % n, (me + k) % n)
        for half, piece in enumerate(pieces):
            out = add(out, piece, sources[half], half)
            if cm.keep:
                kept = ring.pin_kept(lax.dynamic_update_slice_in_dim(
                    kept, piece, sources[half] * block + half * size, cm.dim))
        return ring.pin(out), kept

    def step(k, carry):
        out, kept, pieces = carry
        sent = tuple(ring.send(p, +1 if half == 0 else -1) for half, p in enumerate(pieces))
        return (*visit(out, kept, pieces, k), sent)

    out, kept, pieces = lax.fori_loop(0, n - 1, step,
                                      (out, kept, tuple(_halves(chunk, cm.dim, parts))))
    out, kept = visit(out, kept, pieces, n - 1)
    out = out.astype(probe.dtype)
    return (out, kept) if cm.keep else out


def _scatter(ring: _Ring, a, b):
    """The dot with its partial sums reduce-scattered into ``cm.out_dim``: the partial sum of
    each result block travels the ring, every device adding its own, and ends on its owner."""
    cm, n, me = ring.cm, ring.n, ring.me
    parts = 2 if cm.bidirectional else 1
    full = {k: (a, b)[k].shape[d] for k, d in cm.slices}
    block = next(iter(full.values())) // n
    size = block // parts

    def partial(dst, half):
        ops = [a, b]
        for k, d in cm.slices:
            ops[k] = lax.dynamic_slice_in_dim(ops[k], dst * block + half * size, size, d)
        return ring.pin(ring.dot(*ops))

    # piece 0 holds block me + k + 1 and travels down the ring; piece 1 (bidirectional)
    # holds block me - k - 1 and travels up; after n - 1 steps each holds block me
    def sources(k):
        return ((me + k + 1) % n, (me - k - 1) % n)

    def step(k, accs):
        return tuple(ring.send(acc, -1 if half == 0 else +1) + partial(sources(k)[half], half)
                     for half, acc in enumerate(accs))

    accs = tuple(partial(sources(0)[half], half) for half in range(parts))
    accs = lax.fori_loop(1, n, step, accs)
    return accs[0] if parts == 1 else jnp.concatenate(accs, axis=cm.out_dim)


def _plain(cm: CollectiveMatmul, dot, a, b):
    """What the region computes, as the collective and the dot it replaces."""
    if cm.mode is Mode.SCATTER:
        return lax.psum_scatter(dot(a, b), cm.axis, scatter_dimension=cm.out_dim, tiled=True)
    ops = [a, b]
    ops[cm.operand] = lax.all_gather(ops[cm.operand], cm.axis, axis=cm.dim, tiled=True)
    return (dot(*ops), ops[cm.operand]) if cm.keep else dot(*ops)


def _accumulator(dtype):
    """Partial products of 16-bit floats add up in float32 on the device."""
    if jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize < 4:
        return jnp.float32
    return dtype


def region(cm: CollectiveMatmul, dot, mesh, pin_spec: PartitionSpec | None):
    """The collective matmul ``cm`` as a function of the two (global) operands, for ``mesh``;
    ``dot`` is the dot_general of the local blocks, ``pin_spec`` the spec the result blocks
    keep over the other axes inside (None: no other axis, nothing to pin). With ``cm.keep``
    it returns (the result, the gathered operand)."""
    n = dict(zip(mesh.axis_names, mesh.devices.shape))[cm.axis]

    def pin(x):
        return x if pin_spec is None else lax.with_sharding_constraint(x, pin_spec)

    def pin_kept(x):
        return x if pin_spec is None else lax.with_sharding_constraint(
            x, _auto(cm.gathered_spec(), cm.axis))

    def fast(a, b, index):
        ring = _Ring(cm, n, dot, pin, pin_kept, index[0])
        return _scatter(ring, a, b) if cm.mode is Mode.SCATTER else _gather(ring, a, b)

    def backward(res, ct):
        a, b, index = res
        no_index = np.zeros(index.shape, jax.dtypes.float0)
        return (*jax.vjp(functools.partial(_plain, cm, dot), a, b)[1](ct), no_index)

    body = jax.custom_vjp(fast)
    body.defvjp(lambda a, b, index: (fast(a, b, index), (a, b, index)), backward)
    # The device's place on the ring comes in as its block of an iota: lax.axis_index lowers to
    # a partition-id that XLA's SPMD partitioner rejects once several regions share it.
    region_fn = jax.shard_map(
        body, mesh=mesh,
        in_specs=(*(_manual(sp, cm.axis) for sp in cm.in_specs), PartitionSpec(cm.axis)),
        out_specs=((_manual(cm.out_spec, cm.axis), _manual(cm.gathered_spec(), cm.axis))
                   if cm.keep else _manual(cm.out_spec, cm.axis)),
        axis_names={cm.axis}, check_vma=False)
    return lambda a, b: region_fn(a, b, jnp.arange(n, dtype=jnp.int32))


def emit(emitter, eqn, invals, rewrite) -> list:
    """The ``passes.emit.REWRITES`` emitter of both collective-matmul kinds: the result, then
    the kept operand if any."""
    cm = CollectiveMatmul.from_rewrite(rewrite)
    params = eqn.primitive.get_bind_params(eqn.params)

    def dot(a, b):
        return eqn.primitive.bind(a, b, **params)

    others = [a for a, size in zip(emitter.mesh.axis_names, emitter.mesh.devices.shape)
              if a != cm.axis and size > 1]
    pin_spec = _auto(cm.out_spec, cm.axis) if others else None
    out = region(cm, dot, emitter.mesh, pin_spec)(*invals)
    return list(out) if cm.keep else [out]


REWRITES[RewriteKind.ALL_GATHER_MATMUL] = emit
REWRITES[RewriteKind.MATMUL_REDUCE_SCATTER] = emit
