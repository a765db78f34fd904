"""Communication hidden behind compute: the price of work split into chunks whose transfers
overlap the chunks' compute (collective matmul, FSDP weight prefetch).

One chunk's transfer runs while the chunk before it computes, so ``n`` chunks of compute
``t / n`` with a transfer of ``t_step`` before each but the first take
``(n - 1) * max(t / n, t_step) + t / n`` (:func:`pipelined_s`); only the part beyond the
compute is exposed communication. Strategies (``passes.strategies``) and the estimate read
the same :class:`Overlapped` price.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_model.collectives import CommStep
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


def collective_matmul(compute_s: float, axis: str, axis_size: int, block_bytes: int,
                      bidirectional: bool, levels) -> Overlapped:
    """A matmul of ``compute_s`` whose all-gather (or reduce-scatter) of ``block_bytes`` per
    device over ``axis`` is decomposed into ring steps, each one's transfer overlapping a
    chunk's matmul. Bidirectional, both halves of a step travel at once on the two directions
    of the link (``levels`` hold one direction's bandwidth)."""
    steps = permute_steps(axis, axis_size, block_bytes, bidirectional)
    total_s = pipelined_s(compute_s, steps[0].time_s(levels), axis_size)
    return Overlapped(total_s, compute_s, total_s - compute_s, steps)


def prefetched(layer_s: float, gather: CommStep, layers: int, levels) -> Overlapped:
    """``layers`` iterations of ``layer_s`` each, where iteration ``i + 1``'s ``gather`` runs
    during iteration ``i`` (the first one's is exposed): per iteration, the part of the
    gather its layer does not hide."""
    gather_s = gather.time_s(levels)
    total_s = gather_s + pipelined_s(layer_s * layers, gather_s, layers)
    compute_s = layer_s * layers
    return Overlapped(total_s, compute_s, total_s - compute_s, (gather,) * layers)
