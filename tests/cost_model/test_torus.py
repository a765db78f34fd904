"""Collectives over several mesh axes: one ring over the group on the slowest level, or on a
TPU torus one ring per torus axis in turn."""

import jax
import pytest

from autopar.cost_model.collectives import CommStep, reduce_step
from autopar.cost_model.hardware import axis_levels, get_profile
from autopar.cost_model.hlo import CollectiveKind

SIZES = {"data": 2, "model": 4}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_torus_all_reduce_is_two_phases_per_axis(mesh):
    prof = get_profile("tpu-v5e")
    levels = axis_levels(mesh, prof)
    ici = prof.innermost
    nbytes = 2**24
    step = reduce_step(CollectiveKind.ALL_REDUCE, ("data", "model"), nbytes, SIZES)
    # reduce-scatter over data (n=2) on B, over model (n=4) on B/2; all-gather back.
    sent = 2 * (nbytes / 2 + (3 / 4) * nbytes / 2)
    want = 2 * ((2 - 1) + (4 - 1)) * ici.latency_s + sent / ici.bandwidth_bytes_per_s
    assert step.time_s(levels) == pytest.approx(want)
    assert sent == pytest.approx(step.wire_bytes)  # the same bytes as one ring over 8
    one_ring = CommStep(step.kind, step.axes, 8, nbytes, nbytes)  # no per-axis sizes
    assert step.time_s(levels) < one_ring.time_s(levels)


def test_gpu_groups_run_one_ring(mesh):
    prof = get_profile("h100")
    levels = axis_levels(mesh, prof)
    step = CommStep(CollectiveKind.ALL_GATHER, ("data", "model"), 8, 2**17, 2**20,
                    axis_sizes=(2, 4))
    nvlink = prof.innermost
    want = 7 * nvlink.latency_s + step.wire_bytes / nvlink.bandwidth_bytes_per_s
    assert step.time_s(levels) == pytest.approx(want)
