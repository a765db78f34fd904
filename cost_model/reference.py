"""A reference step time computed from what XLA compiled, on a hardware profile.

This is how plans and hand-written baselines are compared: the same formula applied to the
ground truth of each compiled program (``cost_model.hlo``), never to autopar's own estimate.
Compute time is the per-device flops at the profile's matmul rate for the program's main
dtype; communication time is the alpha-beta cost of every collective on the interconnect level
its group fits in (the innermost level whose ``devices_per_group`` holds the group).
"""

from __future__ import annotations

from autopar.cost_model.collectives import ring_steps
from autopar.cost_model.hlo import HloSummary


def _level_for(profile, group_size: int):
    for level in profile.levels:
        if level.devices_per_group is None or group_size <= level.devices_per_group:
            return level
    return profile.levels[-1]


def reference_comm_time_s(summary: HloSummary, profile) -> float:
    total = 0.0
    for c in summary.collectives:
        level = _level_for(profile, c.group_size)
        one = c.wire_bytes / c.trip_count if c.trip_count else 0.0
        total += c.trip_count * (ring_steps(c.kind, c.group_size) * level.latency_s
                                 + one / level.bandwidth_bytes_per_s)
    return total


def reference_compute_time_s(summary: HloSummary, profile, dtype) -> float:
    return summary.flops / (profile.peak_flops(dtype) * profile.matmul_efficiency)


def reference_step_time_s(summary: HloSummary, profile, dtype) -> float:
    """Compute plus communication, with no overlap assumed (as the planner assumes)."""
    return reference_compute_time_s(summary, profile, dtype) + reference_comm_time_s(summary,
                                                                                      profile)
