"""Pipeline schedules and their figures, as pure functions of stages S, microbatches M and
virtual stages v (model chunks per device).

GPipe, 1F1B and the interleaved schedule run *ticks*: in each every stage runs its slot(s).
ZB-H1 runs the *slots* of a :class:`Table`: in each slot each stage runs one of F (a
microbatch's forward), B (its input gradient) or W (its weight gradient), or idles; F, B and W
take about as long (each is a matmul's worth per weight). ZB-H1 defers W to fill the bubble
(Zero Bubble, arXiv 2401.10241), capping the microbatches a stage holds between F and B at
S - s (1F1B's memory) and between F and W at S (what stage 0 holds in 1F1B; the SPMD program
sizes its buffers for the fullest stage anyway).

==============  ===============================  ==========================  ===================
schedule        trip count of the emitted loop   bubble fraction (formula)   in flight, stage s
==============  ===============================  ==========================  ===================
gpipe           M + S - 1 (forward; autodiff     (S-1) / (M+S-1)             M
                runs as many backward)
1f1b            M + 2(S-1) (one forward and one  (S-1) / (M+S-1)             S - s
                backward slot per tick)
interleaved     v*M + S - 1 (forward)            (S-1) / (v*M+S-1)           M (circular buffer)
zb-h1           3M + S - 1 slots (the table      (S-1) / (3M)                S
                may take two more)
==============  ===============================  ==========================  ===================

Bubble fractions follow GPipe (arXiv 1811.06965), Megatron (arXiv 2104.04473) and Zero
Bubble. The emitted 1F1B loop keeps stage inputs in a ring of :func:`stash_slots` = 2S - 1
entries (lockstep: the forward-to-backward distance at stage s is 2(S-1-s) ticks).
:func:`table_bubble` is the emitted loop's own idle share.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass


class Schedule(enum.Enum):
    """A pipeline schedule; the value is the name users pass to ``autopar.Pipeline``."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"


#: Schedules run from a :class:`Table` of slots, their backward split into B and W.
TABLED = frozenset({Schedule.ZB_H1})


class Op(enum.IntEnum):
    """What a stage runs in one slot of a :class:`Table`."""

    IDLE = 0
    F = 1      # forward of a microbatch (on the last stage also its loss and cotangent)
    B = 2      # input gradient: the cotangent goes to the previous stage
    W = 3      # weight gradient


@dataclass(frozen=True)
class Table:
    """A tabled schedule: ``ops[s][t]`` and ``micro[s][t]`` (the microbatch, -1 when idle) of
    stage s at slot t, and the buffer slots each stage needs: ``held`` microbatches between
    their F and W, ``waiting_f`` activations received before their F, ``waiting_b``
    cotangents before their B, ``pending_w`` between B and W. Every buffer keeps its
    microbatches contiguous (F, B and W each run in microbatch order), so microbatch i lives
    in buffer slot i mod its size."""

    ops: tuple[tuple[Op, ...], ...]
    micro: tuple[tuple[int, ...], ...]
    held: int
    waiting_f: int
    waiting_b: int
    pending_w: int

    @property
    def slots(self) -> int:
        return len(self.ops[0])


def _check(stages: int, microbatches: int, virtual: int) -> None:
    assert stages >= 1 and microbatches >= 1 and virtual >= 1, (stages, microbatches, virtual)


@functools.lru_cache(maxsize=64)
def table(schedule: Schedule, stages: int, microbatches: int) -> Table:
    """The slots of a tabled schedule, from a greedy list schedule: each slot, a stage runs B
    when a cotangent waits, else F when its input has arrived and it holds fewer than S - s
    microbatches between F and B and fewer than S between F and W, else a pending W. What a
    stage sends in slot t arrives for t+1."""
    assert schedule in TABLED, schedule
    _check(stages, microbatches, 1)
    s_n, m = stages, microbatches
    f_at: dict[tuple[int, int], int] = {}
    b_at: dict[tuple[int, int], int] = {}
    done = {op: [0] * s_n for op in (Op.F, Op.B, Op.W)}   # microbatches done, in order
    ops: list[list[Op]] = [[] for _ in range(s_n)]
    micro: list[list[int]] = [[] for _ in range(s_n)]
    peaks = dict(held=0, waiting_f=0, waiting_b=0, pending_w=0)
    t = 0
    while min(done[Op.W]) < m:
        taken = []
        for s in range(s_n):
            f, b, w = done[Op.F][s], done[Op.B][s], done[Op.W][s]
            b_ready = b < f and (f_at[(s, b)] if s == s_n - 1 else b_at.get((s + 1, b), t)) < t
            f_ready = (f < m and (s == 0 or f_at.get((s - 1, f), t) < t) and f - b < s_n - s
                       and f - w < s_n)
            if b_ready:
                taken.append((Op.B, b))
            elif f_ready:
                taken.append((Op.F, f))
            elif w < b:
                taken.append((Op.W, w))
            else:
                taken.append((Op.IDLE, -1))
        for s, (op, i) in enumerate(taken):
            ops[s].append(op)
            micro[s].append(i)
            if op is not Op.IDLE:
                done[op][s] += 1
            if op is Op.F:
                f_at[(s, i)] = t
            elif op is Op.B:
                b_at[(s, i)] = t
        for s in range(s_n):
            f, b, w = done[Op.F][s], done[Op.B][s], done[Op.W][s]
            arrived_f = m if s == 0 else sum(1 for i in range(m) if f_at.get((s - 1, i), t + 1) <= t)
            arrived_b = sum(1 for i in range(m)
                            if (f_at if s == s_n - 1 else b_at).get((s if s == s_n - 1 else s + 1, i),
                                                                    t + 1) <= t)
            peaks["held"] = max(peaks["held"], f - w)
            peaks["waiting_f"] = max(peaks["waiting_f"], 0 if s == 0 else arrived_f - f)
            peaks["waiting_b"] = max(peaks["waiting_b"], arrived_b - b)
            peaks["pending_w"] = max(peaks["pending_w"], b - w)
        t += 1
        assert t <= 4 * (m + s_n) * 3, "the greedy schedule does not finish"
    return Table(ops=tuple(map(tuple, ops)), micro=tuple(map(tuple, micro)),
                 **{k: max(v, 1) for k, v in peaks.items()})


def ticks(schedule: Schedule, stages: int, microbatches: int, virtual: int = 1) -> int:
    """Trip count of the emitted loop: ticks, or a tabled schedule's slots."""
    _check(stages, microbatches, virtual)
    s, m = stages, microbatches
    if schedule is Schedule.GPIPE:
        return m + s - 1
    if schedule is Schedule.ONE_F_ONE_B:
        return m + 2 * (s - 1)
    if schedule is Schedule.INTERLEAVED:
        return virtual * m + s - 1
    return table(schedule, s, m).slots


def phases(stages: int, microbatches: int) -> list[tuple[int, int, bool, bool]]:
    """1F1B's tick loops, ``(first tick, stop, forward, backward)``: S-1 warmup ticks with
    forwards only, M steady ticks with both, S-1 cooldown ticks with backwards only (no stage
    has the other slot's work there, so it is not computed)."""
    s, m = stages, microbatches
    return [(0, s - 1, True, False), (s - 1, m + s - 1, True, True),
            (m + s - 1, m + 2 * (s - 1), False, True)]


def tick_loops(schedule: Schedule, stages: int, microbatches: int, virtual: int = 1
               ) -> list[int]:
    """Trip counts of the emitted tick loops, sorted: GPipe and interleaved run a forward and
    a backward loop of :func:`ticks` each, 1F1B one loop per phase (:func:`phases`), ZB-H1 one
    loop over its table's slots. A 1F1B phase of one tick hides its bound from XLA, which would
    inline it, so its loop's trip count is unknown to XLA and reads 0 here."""
    n = ticks(schedule, stages, microbatches, virtual)
    if schedule in (Schedule.GPIPE, Schedule.INTERLEAVED):
        loops = [n, n]
    elif schedule is Schedule.ONE_F_ONE_B:
        loops = [0 if stop - first == 1 else stop - first
                 for first, stop, _, _ in phases(stages, microbatches) if stop > first]
    else:
        loops = [n]
    return sorted(loops)


def bubble_fraction(schedule: Schedule, stages: int, microbatches: int, virtual: int = 1) -> float:
    """The schedule's bubble by its published formula (0 when S = 1)."""
    _check(stages, microbatches, virtual)
    idle = stages - 1
    if schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        return idle / (microbatches + idle)
    if schedule is Schedule.INTERLEAVED:
        return idle / (virtual * microbatches + idle)
    return idle / (3 * microbatches)


def table_bubble(schedule: Schedule, stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of the emitted loop: the formula for ticked schedules; for tabled ones,
    the table's idle slots (F, B and W taken as equally long)."""
    if schedule not in TABLED:
        return bubble_fraction(schedule, stages, microbatches, virtual)
    return 1 - 3 * microbatches / table(schedule, stages, microbatches).slots


def in_flight(schedule: Schedule, stages: int, microbatches: int, stage: int) -> int:
    """Microbatches whose activations stage ``stage`` (0-based) holds at its peak."""
    _check(stages, microbatches, 1)
    assert 0 <= stage < stages, (stage, stages)
    if schedule in (Schedule.GPIPE, Schedule.INTERLEAVED):
        return microbatches
    if schedule is Schedule.ONE_F_ONE_B:
        return min(stages - stage, microbatches)
    t = table(schedule, stages, microbatches)
    held = peak = 0
    for op in t.ops[stage]:
        held += (op is Op.F) - (op is Op.W)
        peak = max(peak, held)
    return peak


def stash_slots(stages: int) -> int:
    """Entries of the emitted 1F1B loop's ring of stage inputs: 2S - 1."""
    return 2 * stages - 1


def slots(schedule: Schedule, stages: int, microbatches: int, virtual: int = 1
          ) -> list[list[str]]:
    """What each stage runs at each tick or slot of the emitted loops, for the schedule's
    chart: ``slots(...)[s][t]`` is ``"F3"`` (forward of microbatch 3), ``"B3"`` (its backward;
    for tabled schedules its input gradient), ``"W3"`` (its weight gradient), ``"F3 B0"``
    (both, 1F1B), ``"F3.1"`` (interleaved: round 1), or ``""`` (idle). GPipe's and the
    interleaved schedule's backward ticks (autodiff of the forward loop) follow their forward
    ticks, in reverse."""
    _check(stages, microbatches, virtual)
    if schedule in TABLED:
        t = table(schedule, stages, microbatches)
        return [["" if op is Op.IDLE else f"{op.name}{i}" for op, i in zip(o, mi)]
                for o, mi in zip(t.ops, t.micro)]
    s_n, m = stages, microbatches
    n = ticks(schedule, s_n, m, virtual)
    rows = []
    for s in range(s_n):
        row = []
        for t in range(n):
            if schedule is Schedule.ONE_F_ONE_B:
                f, b = t - s, t - 2 * (s_n - 1) + s
                row.append(" ".join(x for x, ok in ((f"F{f}", 0 <= f < m), (f"B{b}", 0 <= b < m))
                                    if ok))
            elif schedule is Schedule.INTERLEAVED and virtual > 1:
                k = t - s
                row.append(f"F{k % m}.{k // m}" if 0 <= k < m * virtual else "")
            else:
                row.append(f"F{t - s}" if 0 <= t - s < m else "")
        if schedule is not Schedule.ONE_F_ONE_B:   # the backward loop, reversed
            row += [x.replace("F", "B") for x in reversed(row)]
        rows.append(row)
    return rows
