"""The live profiler on 8 simulated CPU devices: fitted, positive, monotone, and usable."""

import json

import jax
import numpy as np
import pytest

import autopar
from autopar.errors import ProfileError
from autopar.cost_model.collectives import CommStep
from autopar.cost_model.hardware import HardwareProfile, axis_levels, get_profile
from autopar.cost_model.hlo import CollectiveKind
from autopar.cost_model.profiler import fit_alpha_beta
from autopar.models import mlp


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    prof = autopar.profile({"data": 2, "model": 4}, min_bytes=2**12, max_bytes=2**22,
                           matmul_sizes=(32, 64, 128), repeats=3, verbose=False)
    path = tmp_path_factory.mktemp("profile") / "cpu8.json"
    path.write_text(prof.to_json())
    return prof, path


def test_every_collective_on_every_axis_is_fitted_positive(measured):
    prof, _ = measured
    fitted = {(axis, kind) for axis, kind, _, _ in prof.collective_fits}
    assert fitted == {(a, k.value) for a in ("data", "model") for k in CollectiveKind}
    for axis, kind, latency_s, bandwidth in prof.collective_fits:
        assert latency_s > 0 and bandwidth > 0, (axis, kind)


def test_fitted_time_is_monotone_in_message_size(measured):
    prof, _ = measured
    mesh = jax.make_mesh((2, 4), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    levels = axis_levels(mesh, prof)
    for axis, n in (("data", 2), ("model", 4)):
        for kind in CollectiveKind:
            times = [CommStep(kind, (axis,), n, size, size).time_s(levels)
                     for size in (2**10, 2**14, 2**18, 2**22)]
            assert all(a < b for a, b in zip(times, times[1:])), (axis, kind, times)
            assert levels[axis].fit(kind.value) is not None


def test_measured_matmul_and_memory(measured):
    prof, _ = measured
    base = get_profile("cpu")
    assert prof.name == "cpu-profiled"
    assert prof.matmul_efficiency == 1.0
    assert [s for s, _ in prof.matmul_curve] == [32, 64, 128]
    assert max(f for _, f in prof.matmul_curve) == 1.0
    assert prof.peak_flops("float32") > 0 and prof.peak_flops("bfloat16") > 0
    assert prof.hbm_bandwidth_bytes_per_s > 0
    assert prof.levels == base.levels  # axes of other names keep the built-in levels


def test_profile_json_round_trip(measured):
    prof, path = measured
    assert HardwareProfile.from_json(path.read_text()) == prof
    assert get_profile(str(path)) == prof


def test_outdated_or_malformed_profile_file_is_refused(measured, tmp_path):
    _, path = measured
    doc = json.loads(path.read_text())
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps(dict(doc, format_version=99)))
    with pytest.raises(ProfileError, match="format_version"):
        get_profile(str(bad))
    bad.write_text(json.dumps(dict(doc, collective_fits=[["data", "all-sum", 1e-6, 1e9]])))
    with pytest.raises(ProfileError, match="all-sum"):
        get_profile(str(bad))
    bad.write_text(path.read_text()[:100])
    with pytest.raises(ProfileError, match="not valid JSON"):
        get_profile(str(bad))


def test_version_1_profile_still_loads(tmp_path):
    doc = json.loads(get_profile("h100").to_json())
    for field in ("matmul_tile", "matmul_curve", "collective_fits"):
        del doc[field]
    doc["format_version"] = 1
    old = tmp_path / "v1.json"
    old.write_text(json.dumps(doc))
    prof = get_profile(str(old))
    assert prof.collective_fits == () and prof.peak_flops("bfloat16") == \
        get_profile("h100").peak_flops("bfloat16")


def test_planning_with_the_fitted_profile_runs_end_to_end(measured):
    _, path = measured
    fn, args = mlp.make_train_step(mlp.TINY)
    plan = autopar.plan(fn, *args, mesh={"data": 2, "model": 4}, hardware=str(path))
    assert plan.hardware == "cpu-profiled"
    assert plan.estimate.step_time_s > 0
    got = plan.jit()(*args)
    want = jax.jit(fn)(*args)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)


def test_fit_recovers_known_parameters_and_refuses_flat_timings():
    kind, n = CollectiveKind.ALL_GATHER, 4
    wires = np.array([1e3, 1e4, 1e5, 1e6, 1e7])
    latency_s, bandwidth = 3e-6, 2e9
    times = (n - 1) * latency_s + wires / bandwidth
    got_latency, got_bandwidth = fit_alpha_beta(kind, n, wires, times)
    assert got_latency == pytest.approx(latency_s, rel=1e-6)
    assert got_bandwidth == pytest.approx(bandwidth, rel=1e-6)
    with pytest.raises(ProfileError, match="widen the message range"):
        fit_alpha_beta(kind, n, wires, np.full(5, 1e-3) - wires * 1e-11)


def test_a_mesh_with_none_of_the_profiled_axes_warns(measured):
    prof, _ = measured
    auto = (jax.sharding.AxisType.Auto,) * 2
    with pytest.warns(autopar.HardwareWarning, match=r"measured collectives over mesh axes "
                                                     r"data, model.*\(x, y\) are none of them"):
        axis_levels(jax.make_mesh((2, 4), ("x", "y"), axis_types=auto), prof)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.HardwareWarning)
        axis_levels(jax.make_mesh((4, 2), ("model", "data"), axis_types=auto), prof)
