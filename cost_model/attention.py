"""The price of one attention node under a strategy: time, collectives and scratch memory.

One function, :func:`attention_cost`, prices every attention strategy (batch, heads,
Ulysses, ring, and Ulysses x ring), for the ILP's strategy costs and the plan's
estimate alike (``passes.sequence_parallel`` builds the strategies from it).

* Compute: 2 matmuls forward, 5 backward (the probabilities are recomputed from the saved
  log-sum-exp), each ``2 * batch * heads * seq_q * seq_k * head_dim`` flops, split evenly over
  every axis that splits the work (no block is skipped for causality, so every device does the
  same work). The kernels run over blocks of keys and are not fused, so their score blocks go
  through HBM: :data:`SCORE_PASSES` passes of float32 scores, as a roofline.
* Ulysses over ``n`` devices: an all-to-all of each sequence-sharded operand into
  head-sharded and of each result back, ``(n-1)/n`` of its bytes on the wire.
* Causal: the lower triangle of ``b x b`` block pairs, ``(b + 1) / 2b`` of them
  (:func:`causal_share`); a causal ring alone first stripes the sequence (an all-to-all each
  way, priced as Ulysses').
* Ring over ``n`` devices: ``n - 1`` forward steps (``n`` backward, where dK/dV travel home)
  that each send the K, V and mask block (and dK, dV) to the next device while the block in
  hand is computed; a step takes the slower of the two. The collective is one
  collective-permute step carrying every step's bytes; ``compute_s`` is the rest of the
  overlapped time, so ``compute_s + comm`` is the region's time.
* Loop overhead: every step of the kernels' block loop launches :data:`KERNELS_PER_STEP`
  kernels, each at least the profile's launch overhead.
* Scratch: the score blocks of the kernel, its float32 accumulators, and the copies each
  strategy makes (Ulysses' head-sharded operands and results; the ring's blocks in flight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cost_model.collectives import CommStep
from autopar.cost_model.compute import roofline_s
from autopar.cost_model.hlo import CollectiveKind

#: float32 score-block bytes read or written per score element (forward, backward): the
#: forward writes the scores, reads them for the row max and again for exp, writes the
#: probabilities and reads them into the value matmul; the backward does that and more.
SCORE_PASSES = (5, 10)
#: Kernels one step of the kernels' loop launches (forward, backward), each paying the
#: profile's launch overhead: many small blocks cost more than few large ones.
KERNELS_PER_STEP = (8, 14)
_F32 = 4


@dataclass(frozen=True)
class AttentionShape:
    """One attention node's whole tensors: ``q [batch, seq, heads, head_dim]``, ``k``/``v
    [batch, seq, kv_heads, head_dim]``, of ``itemsize`` bytes per element, and
    ``wire_itemsize`` per element as collectives move them (None: ``itemsize``; XLA:CPU moves
    16-bit floats as float32)."""
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    backward: bool
    causal: bool = False
    wire_itemsize: int | None = None

    @property
    def wire_size(self) -> int:
        """Bytes per element of q, k, v and o as collectives move them."""
        return self.wire_itemsize or self.itemsize

    def on_wire(self, nbytes: int) -> int:
        """``nbytes`` of q, k, v or o as collectives move them."""
        return nbytes * self.wire_size // self.itemsize


@dataclass(frozen=True)
class AttentionSplit:
    """How a strategy splits it: the number of devices over batch and heads, the (axes,
    size) of Ulysses (one or more mesh axes, as one group) and the (axis, size) of the ring."""
    batch: int = 1
    heads: int = 1
    ulysses: tuple[tuple[str, ...], int] | None = None
    ring: tuple[str, int] | None = None

    @property
    def seq(self) -> int:
        """Devices the sequence is split over at the strategy's boundary."""
        return (self.ulysses[1] if self.ulysses else 1) * (
            self.ring[1] if self.ring else 1)

    @property
    def work(self) -> int:
        return self.batch * self.heads * self.seq


@dataclass(frozen=True)
class AttentionCost:
    flops: float                        # per device
    compute_s: float                    # with collectives: the node's time
    collectives: tuple[CommStep, ...]
    scratch_bytes: int


def attention_cost(shape: AttentionShape, split: AttentionSplit, profile, levels,
                   dtype, block_k: int) -> AttentionCost:
    """The per-device price of ``shape`` under ``split`` on ``profile`` (``levels``: mesh axis
    -> link level); ``block_k``: the keys per block of the kernel on one device."""
    s = shape
    passes = 5 if s.backward else 2
    rows = s.seq // split.seq * (split.ulysses[1] if split.ulysses else 1)
    heads = s.heads // split.heads // (split.ulysses[1] if split.ulysses else 1)
    batch = s.batch // split.batch
    blocks = max(rows // block_k, 1)
    share = causal_share(s, split, blocks)
    flops = 2.0 * passes * s.batch * s.heads * s.seq * s.seq * s.head_dim / split.work * share
    scores = s.batch * s.heads * s.seq * s.seq / split.work * share
    score_bytes = scores * _F32 * SCORE_PASSES[s.backward]
    triangular = share < 1.0
    steps_run = (blocks * (blocks + 1) // 2 if triangular else blocks) * (
        split.ring[1] if split.ring else 1)
    compute_s = roofline_s(flops, score_bytes, profile, dtype, contraction=True,
                           dims=(rows, block_k, s.head_dim))
    compute_s += steps_run * KERNELS_PER_STEP[s.backward] * profile.launch_overhead_s
    q_bytes = batch * (s.seq // split.seq) * (s.heads // split.heads) * s.head_dim * s.itemsize
    kv_bytes = q_bytes * s.kv_heads // s.heads
    mask_bytes = batch * s.seq // split.seq
    steps: list[CommStep] = []
    block = batch * heads * (block_k if triangular else rows) * block_k * _F32
    scratch = block * (5 if s.backward else 3) + q_bytes // s.itemsize * _F32 * 2
    if s.backward:
        scratch += 2 * kv_bytes // s.itemsize * _F32
    q_wire, kv_wire = s.on_wire(q_bytes), s.on_wire(kv_bytes)
    if split.ulysses:
        steps += _ulysses_steps(split.ulysses, q_wire, kv_wire, mask_bytes, s)
        moved = (3 * q_bytes + 2 * kv_bytes) if s.backward else (2 * q_bytes + kv_bytes)
        scratch += moved + (q_bytes + 2 * kv_bytes if s.backward else q_bytes)
    if split.ring and s.causal and not split.ulysses:  # striped: an all-to-all each way
        steps += _ulysses_steps(((split.ring[0],), split.ring[1]), q_wire, kv_wire,
                                mask_bytes, s)
        scratch += (3 * q_bytes + 2 * kv_bytes) if s.backward else (2 * q_bytes + kv_bytes)
    if split.ring:
        axis, n = split.ring
        per_step = 2 * kv_wire + mask_bytes
        if s.backward:
            per_step += 2 * kv_bytes // s.itemsize * _F32
        trips = n if s.backward else n - 1
        ring = CommStep(CollectiveKind.COLLECTIVE_PERMUTE, (axis,), n, per_step * trips,
                        per_step * trips, axis_sizes=(n,))
        level = levels[axis]
        step_s = level.latency_s + per_step / level.bandwidth_bytes_per_s
        block_s = compute_s / n
        total_s = block_s * (n - trips) + trips * max(block_s, step_s)
        compute_s = max(total_s - ring.time_s(levels), 0.0)
        steps.append(ring)
        scratch += 2 * per_step
    return AttentionCost(flops=flops, compute_s=compute_s, collectives=tuple(steps),
                         scratch_bytes=int(scratch))


def causal_share(shape: AttentionShape, split: AttentionSplit, blocks: int) -> float:
    """The share of the block pairs a device computes: the lower triangle of ``blocks``
    blocks under a causal mask (a Ulysses x ring hybrid computes them all)."""
    if not shape.causal or blocks <= 1 or (split.ulysses and split.ring):
        return 1.0
    return (blocks + 1) / (2 * blocks)


def _ulysses_steps(ulysses, q_bytes, kv_bytes, mask_bytes, s: AttentionShape):
    """The all-to-alls and the mask's all-gather of a Ulysses group: ``q_bytes`` and
    ``kv_bytes`` as they cross the wire (:meth:`AttentionShape.on_wire`)."""
    axes, n = ulysses
    sizes = (n,) if len(axes) == 1 else ()   # per-axis sizes: a torus prices one axis alone

    def a2a(nbytes):
        return CommStep(CollectiveKind.ALL_TO_ALL, axes, n, nbytes, nbytes, axis_sizes=sizes)
    lse_bytes = q_bytes // s.wire_size // s.head_dim * _F32
    moved = [q_bytes, kv_bytes, kv_bytes, lse_bytes]          # q, k, v in; o, lse out
    moved += [q_bytes] + ([q_bytes, q_bytes, kv_bytes, kv_bytes] if s.backward else [])
    steps = [a2a(b) for b in moved]
    steps.append(CommStep(CollectiveKind.ALL_GATHER, axes, n, mask_bytes, mask_bytes * n,
                          axis_sizes=sizes))
    return steps


def fits_heads(shape: AttentionShape, heads_split: int, ulysses: int) -> bool:
    """Whether the kv heads split evenly over the heads axes and the Ulysses axis."""
    return shape.kv_heads % (heads_split * ulysses) == 0


def split_work_exact(shape: AttentionShape, split: AttentionSplit) -> bool:
    """Whether every split divides its dimension."""
    return (shape.batch % split.batch == 0 and shape.seq % split.seq == 0
            and fits_heads(shape, split.heads, split.ulysses[1] if split.ulysses else 1)
            and math.gcd(shape.heads, split.heads) == split.heads)
