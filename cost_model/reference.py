"""A reference step time computed from what XLA compiled, on a hardware profile.

This is how plans and hand-written baselines are compared: the same formula applied to the
ground truth of each compiled program (``cost_model.hlo``), never to autopar's own estimate.
Compute time is the per-device flops at the profile's matmul rate for the program's main
dtype; communication time is the alpha-beta cost of every collective on its interconnect level.

A collective's level is the innermost one whose ``devices_per_group`` holds each of its groups
within one block of that many consecutive device ids (all members share
``id // devices_per_group``, how jax numbers the GPUs of a node); the unbounded outermost level
holds any group. Groups name partition ids, which are positions in the mesh's flat device list
(``mesh.devices.flat``); ``device_ids`` maps them to device ids, and without it a partition id
is taken as the device id (true of the simulated CPU mesh, whose device order is id order). A
collective whose groups the HLO text does not give falls back to its group size: the innermost
level with ``devices_per_group`` at least that size.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.cost_model.collectives import ring_steps
from autopar.cost_model.hlo import Collective, HloSummary, wire_bytes


def _level_for_size(profile, group_size: int):
    for level in profile.levels:
        if level.devices_per_group is None or group_size <= level.devices_per_group:
            return level
    return profile.levels[-1]


def collective_level(profile, collective: Collective, device_ids: Sequence[int] | None = None):
    """The :class:`LinkLevel` a collective's bytes move over (see the module docstring)."""
    if collective.groups is None:
        return _level_for_size(profile, collective.group_size)
    groups = collective.groups
    if device_ids is not None:
        groups = tuple(tuple(device_ids[p] for p in group) for group in groups)
    for level in profile.levels:
        block = level.devices_per_group
        if block is None or all(len({d // block for d in g}) <= 1 for g in groups):
            return level
    return profile.levels[-1]


def collective_time_s(profile, collective: Collective,
                      device_ids: Sequence[int] | None = None) -> float:
    """Alpha-beta time of one execution of a collective on its level."""
    level = collective_level(profile, collective, device_ids)
    c = collective
    return (ring_steps(c.kind, c.group_size) * level.latency_s
            + wire_bytes(c.kind, c.in_bytes, c.out_bytes, c.group_size)
            / level.bandwidth_bytes_per_s)


def reference_comm_time_s(summary: HloSummary, profile,
                          device_ids: Sequence[int] | None = None) -> float:
    return sum(c.trip_count * collective_time_s(profile, c, device_ids)
               for c in summary.collectives)


def reference_compute_time_s(summary: HloSummary, profile, dtype) -> float:
    return summary.flops / (profile.matmul_flops(dtype) * profile.matmul_efficiency)


def reference_step_time_s(summary: HloSummary, profile, dtype,
                          device_ids: Sequence[int] | None = None) -> float:
    """Compute plus communication, with no overlap assumed (as the planner assumes);
    ``device_ids``: the device id of each partition id (default: the same)."""
    return (reference_compute_time_s(summary, profile, dtype)
            + reference_comm_time_s(summary, profile, device_ids))
