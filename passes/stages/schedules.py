"""Pipeline schedules and their figures, as pure functions of stages S, microbatches M and
virtual stages v (model chunks per device).

A *tick* is one step of the emitted ``lax.scan`` in which every stage runs its slot(s):

==============  ===============================  ==========================  ===================
schedule        ticks of the emitted loop        bubble fraction             in flight, stage s
==============  ===============================  ==========================  ===================
gpipe           M + S - 1 (forward; autodiff     (S-1) / (M+S-1)             M
                runs as many backward)
1f1b            M + 2(S-1) (one forward and one  (S-1) / (M+S-1)             S - s
                backward slot per tick)
interleaved     v*M + S - 1 (forward)            (S-1) / (v*M+S-1)           M (circular buffer)
zb-h1           not emitted yet                  (S-1) / (3M)                S - s
==============  ===============================  ==========================  ===================

Bubble fractions follow GPipe (arXiv 1811.06965), Megatron (arXiv 2104.04473) and Zero Bubble
(arXiv 2401.10241, ZB-H1 at 1F1B's memory). The emitted 1F1B loop keeps stage inputs in a ring
of :func:`stash_slots` = 2S - 1 entries (lockstep: the forward-to-backward distance at stage s
is 2(S-1-s) ticks).
"""

from __future__ import annotations

import enum


class Schedule(enum.Enum):
    """A pipeline schedule; the value is the name users pass to ``autopar.Pipeline``."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"


#: Schedules :mod:`autopar.passes.stages.emit` can emit today.
EMITTED = frozenset({Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED})


def _check(stages: int, microbatches: int, virtual: int) -> None:
    assert stages >= 1 and microbatches >= 1 and virtual >= 1, (stages, microbatches, virtual)


def ticks(schedule: Schedule, stages: int, microbatches: int, virtual: int = 1) -> int | None:
    """Trip count of the emitted tick loop (None for a schedule not emitted yet)."""
    _check(stages, microbatches, virtual)
    s, m = stages, microbatches
    if schedule is Schedule.GPIPE:
        return m + s - 1
    if schedule is Schedule.ONE_F_ONE_B:
        return m + 2 * (s - 1)
    if schedule is Schedule.INTERLEAVED:
        return virtual * m + s - 1
    return None


def bubble_fraction(schedule: Schedule, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Predicted idle share of the pipeline (0 when S = 1)."""
    _check(stages, microbatches, virtual)
    idle = stages - 1
    if schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        return idle / (microbatches + idle)
    if schedule is Schedule.INTERLEAVED:
        return idle / (virtual * microbatches + idle)
    return idle / (3 * microbatches)


def in_flight(schedule: Schedule, stages: int, microbatches: int, stage: int) -> int:
    """Microbatches whose activations stage ``stage`` (0-based) holds at its peak."""
    _check(stages, microbatches, 1)
    assert 0 <= stage < stages, (stage, stages)
    if schedule in (Schedule.GPIPE, Schedule.INTERLEAVED):
        return microbatches
    return min(stages - stage, microbatches)


def stash_slots(stages: int) -> int:
    """Entries of the emitted 1F1B loop's ring of stage inputs: 2S - 1."""
    return 2 * stages - 1


def slots(schedule: Schedule, stages: int, microbatches: int, virtual: int = 1
          ) -> list[list[str]]:
    """What each stage runs at each tick of the emitted loops, for the schedule's chart:
    ``slots(...)[s][t]`` is ``"F3"`` (forward of microbatch 3), ``"B3"`` (its backward),
    ``"F3 B0"`` (both, 1F1B), ``"F3.1"`` (interleaved: round 1), or ``""`` (idle). GPipe's and
    the interleaved schedule's backward ticks (autodiff of the forward loop) follow their
    forward ticks, in reverse."""
    _check(stages, microbatches, virtual)
    s_n, m = stages, microbatches
    n = ticks(schedule, s_n, m, virtual)
    if n is None:
        raise ValueError(f"{schedule} is not emitted")
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
