"""Collective costs and the one redistribution planner.

Every collective is priced by the alpha-beta model on the interconnect level its mesh axes
cross: ``time = steps * alpha + wire_bytes / bandwidth``, where wire bytes are the bytes one
device sends under ring algorithms (the contract's table, :func:`wire_bytes`). A collective over
several mesh axes at once runs at the slowest of their levels, except on a TPU torus (ICI),
where it runs as one ring per torus axis in turn (see ``CommStep._torus_time_s``).

:func:`plan_redistribute` turns a pair of specs into the steps that move a tensor from one to
the other. The ILP's edge costs come from it, and nothing else derives resharding collectives.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from autopar.cost_model.hardware import LevelKind
from autopar.cost_model.hlo import CollectiveKind, wire_bytes
from autopar.cost_model.spec import Spec


def ring_steps(kind: CollectiveKind, n: int) -> int:
    if kind is CollectiveKind.COLLECTIVE_PERMUTE:
        return 1
    return 2 * (n - 1) if kind is CollectiveKind.ALL_REDUCE else n - 1


@dataclass(frozen=True)
class CommStep:
    """One collective, per device: sizes of one execution, over the group of ``axes``.

    ``kind`` None is a local slice (no communication). ``after`` is the tensor's spec once the
    step is done, when the step is part of a redistribution (emission pins it). ``combined``
    marks a collective XLA's combiner merges with others of its kind (a train step's last
    reductions, its gradients and loss, which do not wait for one another:
    ``passes.reductions.is_combined_reduction``): it pays no latency of its own.
    """
    kind: CollectiveKind | None
    axes: tuple[str, ...]
    group_size: int
    in_bytes: int
    out_bytes: int
    after: Spec | None = None
    combined: bool = False
    axis_sizes: tuple[int, ...] = ()  # size of each axis in ``axes``, when known

    @property
    def wire_bytes(self) -> float:
        if self.kind is None:
            return 0.0
        return wire_bytes(self.kind, self.in_bytes, self.out_bytes, self.group_size)

    def time_s(self, levels) -> float:
        """levels: mesh axis -> LinkLevel (bandwidth_bytes_per_s, latency_s, and the measured
        per-collective fits of that axis, which win when every axis of the group has one)."""
        if self.kind is None or (self.group_size <= 1
                                 and self.kind is not CollectiveKind.COLLECTIVE_PERMUTE):
            return 0.0
        if self._on_torus(levels):
            return self._torus_time_s(levels)
        fits = [levels[a].fit(self.kind.value) for a in self.axes]
        if all(f is not None for f in fits):  # measured by `autopar profile` on these axes
            latency, bandwidth = max(f[0] for f in fits), min(f[1] for f in fits)
        else:
            latency = max(levels[a].latency_s for a in self.axes)
            bandwidth = min(levels[a].bandwidth_bytes_per_s for a in self.axes)
        if self.combined:
            latency = 0.0
        return ring_steps(self.kind, self.group_size) * latency + self.wire_bytes / bandwidth

    def _on_torus(self, levels) -> bool:
        return (len(self.axes) > 1 and len(self.axis_sizes) == len(self.axes)
                and self.kind in _PHASED
                and all(levels[a].kind is LevelKind.ICI for a in self.axes))

    def _torus_time_s(self, levels) -> float:
        """A collective over several axes of a TPU torus runs as one ring per torus axis in
        turn, each on that axis's own links, on data that shrinks (reduce-scatter) or grows
        (all-gather) by the axis size; an all-reduce is both. The bytes sent equal the ring
        formula's over the whole group; the latency steps are sum(n_i - 1), not N - 1."""
        total_s = 0.0
        n_total = self.group_size
        phases = [CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_GATHER] \
            if self.kind is CollectiveKind.ALL_REDUCE else [self.kind]
        full = self.in_bytes if self.kind is not CollectiveKind.ALL_GATHER else self.out_bytes
        for phase in phases:
            size = full  # reduce-scatter: bytes before the phase; all-gather: after it
            order = list(zip(self.axes, self.axis_sizes))
            if phase is CollectiveKind.ALL_GATHER:
                size = full // n_total
            for axis, n in order:
                level = levels[axis]
                fit = level.fit(phase.value)
                latency, bandwidth = fit if fit else (level.latency_s, level.bandwidth_bytes_per_s)
                if phase is CollectiveKind.ALL_GATHER:
                    size *= n
                sent = wire_bytes(phase, size, size, n)
                if phase is CollectiveKind.REDUCE_SCATTER:
                    size //= n
                total_s += (0.0 if self.combined else (n - 1) * latency) + sent / bandwidth
        return total_s

    def __str__(self) -> str:
        kind = "slice" if self.kind is None else self.kind.value
        return f"{kind}({','.join(self.axes)}) {self.in_bytes}B"


_PHASED = (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER)


def group_size(axes, axis_sizes) -> int:
    return math.prod(axis_sizes[a] for a in axes)


def reduce_step(kind: CollectiveKind, axes: tuple[str, ...], local_bytes: int,
                axis_sizes: dict[str, int], combined: bool = False) -> CommStep:
    """The all-reduce or reduce-scatter of a partial result of ``local_bytes`` per device."""
    n = group_size(axes, axis_sizes)
    out = local_bytes if kind is CollectiveKind.ALL_REDUCE else local_bytes // n
    return CommStep(kind, axes, n, local_bytes, out, combined=combined,
                    axis_sizes=tuple(axis_sizes[a] for a in axes))


def _common_prefix(a: tuple, b: tuple) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def _single_move(src: Spec, dst: Spec):
    """(from_dim, to_dim, axes) when dst is src with the trailing axes of one dimension moved
    to the end of another (unsplit beyond them) dimension, the one reshard an all-to-all does."""
    changed = [d for d in range(src.rank) if src.dims[d] != dst.dims[d]]
    if len(changed) != 2:
        return None
    for d1, d2 in (changed, changed[::-1]):
        k = _common_prefix(src.dims[d1], dst.dims[d1])
        moved = src.dims[d1][k:]
        if (dst.dims[d1] == src.dims[d1][:k] and moved
                and dst.dims[d2] == src.dims[d2] + moved):
            return d1, d2, moved
    return None


def _with(spec: Spec, dim: int, axes: tuple[str, ...]) -> Spec:
    dims = list(spec.dims)
    dims[dim] = axes
    return Spec(tuple(dims))


@functools.lru_cache(maxsize=200_000)
def plan_redistribute(src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int,
                      axis_sizes_items: tuple[tuple[str, int], ...]) -> tuple[CommStep, ...]:
    """The steps that turn a tensor split as ``src`` into one split as ``dst``.

    Every step is one XLA handles directly, and emission pins each step's ``after`` spec, so the
    compiled program does exactly these collectives:

    * the trailing axes of one dimension moving to the end of another: one all-to-all;
    * otherwise, in order: free slices on dimensions whose current axes all stay (a prefix of
      their target) using axes no dimension holds yet; one all-gather per dimension of its axes
      past the common prefix with the target; then the remaining free slices.
    """
    if src == dst:
        return ()
    sizes = dict(axis_sizes_items)
    total = math.prod(shape) * itemsize

    def local(spec: Spec) -> int:
        return total // group_size(spec.axes, sizes)

    move = _single_move(src, dst)
    if move is not None:
        _, _, axes = move
        n = group_size(axes, sizes)
        return (CommStep(CollectiveKind.ALL_TO_ALL, axes, n, local(src), local(src), dst),)
    steps = []
    cur = src
    for d in range(src.rank):  # early slices: cheaper gathers later
        if dst.dims[d][:len(cur.dims[d])] == cur.dims[d] and dst.dims[d] != cur.dims[d]:
            extra = dst.dims[d][len(cur.dims[d]):]
            if not set(extra) & set(cur.axes):
                nxt = _with(cur, d, dst.dims[d])
                steps.append(CommStep(None, extra, group_size(extra, sizes), local(cur),
                                      local(nxt), nxt))
                cur = nxt
    for d in range(src.rank):
        k = _common_prefix(cur.dims[d], dst.dims[d])
        gathered = cur.dims[d][k:]
        if gathered:
            nxt = _with(cur, d, cur.dims[d][:k])
            steps.append(CommStep(CollectiveKind.ALL_GATHER, gathered,
                                  group_size(gathered, sizes), local(cur), local(nxt), nxt,
                                  axis_sizes=tuple(sizes[a] for a in gathered)))
            cur = nxt
    if cur != dst:
        extra = tuple(a for a in dst.axes if a not in cur.axes)
        steps.append(CommStep(None, extra, group_size(extra, sizes), local(cur), local(dst), dst))
    return tuple(steps)


def redistribute_time_s(src: Spec, dst: Spec, shape, itemsize, axis_sizes: dict[str, int],
                        levels) -> float:
    steps = plan_redistribute(src, dst, tuple(shape), itemsize, tuple(axis_sizes.items()))
    return sum(s.time_s(levels) for s in steps)
