"""Communication hidden behind compute: the price of work split into chunks whose transfers
overlap the chunks' compute (collective matmul, FSDP weight prefetch).

One chunk's transfer runs while the chunk before it computes, so ``n`` chunks of compute
``t / n`` with a transfer of ``t_step`` before each but the first take
``(n - 1) * max(t / n, t_step) + t / n`` (:func:`pipelined_s`); only the part beyond the
compute is exposed communication. Strategies (``passes.strategies``) and the estimate read
the same :class:`Overlapped` price.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.cost_model.collectives import CommStep
from autopar.cost_model.hardware import LevelKind
from autopar.cost_model.hlo import CollectiveKind


@dataclass(frozen=True)
class Overlapped:
    """One overlapped op, per device: its makespan, the compute inside it, the communication
    no compute hides (``total_s - compute_s``), and the transfers it runs (for wire bytes)."""
    total_s: float
    compute_s: float
    exposed_s: float
    steps: tuple[CommStep, ...]


def pipelined_s(compute_s: float, step_s: float, chunks: int) -> float:
    """The makespan of ``chunks`` equal chunks of ``compute_s`` in all, each but the first
    waiting for a transfer of ``step_s`` that overlaps the chunk before it."""
    chunk_s = compute_s / chunks
    return (chunks - 1) * max(chunk_s, step_s) + chunk_s


def permute_steps(axis: str, axis_size: int, block_bytes: int, bidirectional: bool
                  ) -> tuple[CommStep, ...]:
    """The collective-permutes that pass ``axis_size - 1`` blocks of ``block_bytes`` around the
    ring of ``axis``: one per step, or, bidirectional, half a block each way per step."""
    n = axis_size
    if bidirectional:
        half = CommStep(CollectiveKind.COLLECTIVE_PERMUTE, (axis,), n, block_bytes // 2,
                        block_bytes // 2, axis_sizes=(n,))
        return (half,) * (2 * (n - 1))
    one = CommStep(CollectiveKind.COLLECTIVE_PERMUTE, (axis,), n, block_bytes, block_bytes,
                   axis_sizes=(n,))
    return (one,) * (n - 1)


#: Kernels a ring loop runs per step besides its pieces' work (its counter's increment and
#: test, and the copy of the carried counter XLA makes), each at least one launch.
LOOP_KERNELS = 3


@dataclass(frozen=True)
class Chunked:
    """The compute of a matmul cut into pieces: one piece's matmul, the kernel that puts its
    result in place (a slice update, or an add into an accumulator), how many pieces, and the
    piece's other kernels (the converts of a block carried wider on the wire, the update of a
    kept operand)."""
    matmul_s: float
    place_s: float
    pieces: int
    other_s: tuple[float, ...] = ()


def chunked_compute_s(work: Chunked, steps: int, launch_s: float) -> float:
    """All the pieces' kernels, at least a launch each, and the ring loop's own per step."""
    per_piece_s = (max(work.matmul_s, launch_s) + max(work.place_s, launch_s)
                   + sum(max(t, launch_s) for t in work.other_s))
    return work.pieces * per_piece_s + steps * LOOP_KERNELS * launch_s


def ring_step_s(steps: tuple[CommStep, ...], axis: str, levels) -> float:
    """One ring step's transfer. Half a block each way takes half the time only where each
    direction of a link is its own (a torus, ICI) and the two neighbours differ (more than two
    devices); behind a switch (NVLink) a device's sends share its bandwidth either way."""
    step = steps[0]
    if len(steps) == 2 * (step.group_size - 1):  # bidirectional: halves
        if levels[axis].kind is not LevelKind.ICI or step.group_size <= 2:
            return dataclasses.replace(step, in_bytes=2 * step.in_bytes,
                                       out_bytes=2 * step.out_bytes).time_s(levels)
    return step.time_s(levels)


def collective_matmul(work: Chunked, axis: str, axis_size: int, block_bytes: int,
                      bidirectional: bool, levels, launch_s: float) -> Overlapped:
    """A matmul cut into ``work``'s pieces whose all-gather (or reduce-scatter) of
    ``block_bytes`` per device over ``axis`` is decomposed into ring steps, each one's transfer
    overlapping a step's pieces. Bidirectional, each step's two halves travel opposite ways
    round the ring (:func:`ring_step_s`)."""
    steps = permute_steps(axis, axis_size, block_bytes, bidirectional)
    compute_s = chunked_compute_s(work, axis_size - 1, launch_s)
    total_s = pipelined_s(compute_s, ring_step_s(steps, axis, levels), axis_size)
    return Overlapped(total_s, compute_s, total_s - compute_s, steps)


def prefetched(layer_s: float, gather: tuple[CommStep, ...], layers: int, levels
               ) -> Overlapped:
    """``layers`` iterations of ``layer_s`` each, where iteration ``i + 1``'s ``gather`` (its
    steps in turn) runs during iteration ``i`` (the first one's is exposed)."""
    gather_s = sum(step.time_s(levels) for step in gather)
    compute_s = layer_s * layers
    total_s = gather_s + pipelined_s(compute_s, gather_s, layers)
    return Overlapped(total_s, compute_s, total_s - compute_s, tuple(gather) * layers)
