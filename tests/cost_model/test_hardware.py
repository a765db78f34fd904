"""Tests for cost_model.hardware: built-in profiles, lookup, JSON and mesh-axis levels."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar

from autopar.errors import AutoparError, MeshError, ProfileError, UnknownHardwareError
from autopar.cost_model import hardware as hw
from autopar.cost_model.hardware import (
    PROFILE_FORMAT_VERSION,
    HardwareProfile,
    LevelKind,
    LinkLevel,
    axis_levels,
    get_profile,
    known_profiles,
)

ALL_NAMES = (
    "tpu-v2",
    "tpu-v3",
    "tpu-v4",
    "tpu-v5e",
    "tpu-v5p",
    "tpu-v6e",
    "a100-40gb",
    "a100-80gb",
    "h100",
    "h200",
    "b200",
    "t4",
    "l4",
    "cpu",
)
ACCELERATORS = tuple(n for n in ALL_NAMES if n != "cpu")
TPUS = ("tpu-v2", "tpu-v3", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e")
GPUS = ("a100-40gb", "a100-80gb", "h100", "h200", "b200", "t4", "l4")


# ---------------------------------------------------------------------------- lookup by name


def test_known_profiles_lists_every_required_name():
    assert known_profiles() == ALL_NAMES


@pytest.mark.parametrize("name", ALL_NAMES)
def test_every_profile_loads_by_name(name):
    profile = get_profile(name)
    assert isinstance(profile, HardwareProfile)
    assert profile.name == name
    assert get_profile(name) == profile  # factories are deterministic


@pytest.mark.parametrize(
    "alias, expected",
    [
        ("h100-sxm", "h100"),
        ("H100", "h100"),
        ("  h100_sxm5 ", "h100"),
        ("v5e", "tpu-v5e"),
        ("TPU-V5E", "tpu-v5e"),
        ("v5litepod", "tpu-v5e"),
        ("v5p", "tpu-v5p"),
        ("v4", "tpu-v4"),
        ("v6e", "tpu-v6e"),
        ("trillium", "tpu-v6e"),
        ("a100", "a100-80gb"),
        ("A100-80GB", "a100-80gb"),
        ("a100-40gb", "a100-40gb"),
        ("h200-sxm", "h200"),
        ("B200", "b200"),
        ("host", "cpu"),
        # device_kind strings as jax reports them
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("TPU v4", "tpu-v4"),
        ("TPU v5 lite", "tpu-v5e"),
        ("TPU v5", "tpu-v5p"),
        ("TPU v5p", "tpu-v5p"),
        ("TPU v6 lite", "tpu-v6e"),
    ],
)
def test_aliases_resolve(alias, expected):
    assert get_profile(alias).name == expected


def test_profile_instance_is_returned_as_is():
    profile = hw.h100()
    assert get_profile(profile) is profile


def test_unknown_name_lists_known_names():
    with pytest.raises(UnknownHardwareError) as err:
        get_profile("tpu-v9000")
    message = str(err.value)
    assert "tpu-v9000" in message
    for name in ALL_NAMES:
        assert name in message
    assert "autopar profile" in message


@pytest.mark.parametrize("bad", ["TPU v4 lite", "NVIDIA H100 PCIe", ""])
def test_unmapped_names_are_unknown(bad):
    # v4i (inference) and PCIe parts differ from the built-in profiles: no silent match.
    with pytest.raises(UnknownHardwareError):
        get_profile(bad)


def test_non_string_hardware_is_rejected():
    with pytest.raises(UnknownHardwareError, match="int"):
        get_profile(42)


# ---------------------------------------------------------------------- None = current backend


def test_none_on_this_cpu_machine_gives_cpu():
    assert jax.default_backend() == "cpu"
    assert get_profile(None).name == "cpu"
    assert get_profile().name == "cpu"


def _fake_backend(monkeypatch, platform, device_kind):
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    monkeypatch.setattr(jax, "devices", lambda *a, **k: [SimpleNamespace(device_kind=device_kind)])


@pytest.mark.parametrize(
    "platform, device_kind, expected",
    [
        ("gpu", "NVIDIA H100 80GB HBM3", "h100"),
        ("gpu", "NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("gpu", "NVIDIA H200", "h200"),
        ("tpu", "TPU v5 lite", "tpu-v5e"),
        ("tpu", "TPU v6 lite", "tpu-v6e"),
        ("tpu", "TPU v5", "tpu-v5p"),
        ("tpu", "TPU v4", "tpu-v4"),
        ("tpu", "TPU v2", "tpu-v2"),
        ("tpu", "TPU v3", "tpu-v3"),
        ("gpu", "Tesla T4", "t4"),
        ("gpu", "NVIDIA L4", "l4"),
    ],
)
def test_none_maps_accelerator_device_kind(monkeypatch, platform, device_kind, expected):
    _fake_backend(monkeypatch, platform, device_kind)
    assert get_profile(None).name == expected


@pytest.mark.parametrize("platform, device_kind, nearest", [
    ("gpu", "NVIDIA H100 PCIe", "h100"), ("gpu", "Tesla V100-SXM2-16GB", "a100-40gb"),
    ("gpu", "NVIDIA A100-PCIE-40GB", "a100-40gb"), ("tpu", "TPU v7x", "tpu-v6e")])
def test_none_on_an_accelerator_without_a_profile_takes_the_nearest(monkeypatch, platform,
                                                                    device_kind, nearest):
    _fake_backend(monkeypatch, platform, device_kind)
    with pytest.warns(autopar.HardwareWarning, match="autopar profile"):
        assert get_profile(None).name == nearest


@pytest.mark.parametrize("device_kind", ["AMD Instinct MI300X", "host"])
def test_none_on_unknown_accelerator_suggests_profiling(monkeypatch, device_kind):
    _fake_backend(monkeypatch, "gpu", device_kind)
    with pytest.raises(UnknownHardwareError) as err:
        get_profile(None)
    message = str(err.value)
    assert device_kind in message
    assert "autopar profile" in message


# ------------------------------------------------------------------------------- peak flops


@pytest.mark.parametrize("name", [n for n in ACCELERATORS if n != "t4"])  # Turing: no bf16
def test_bf16_beats_fp32_on_accelerators(name):
    profile = get_profile(name)
    assert profile.peak_flops("bfloat16") > profile.peak_flops("float32") > 0


@pytest.mark.parametrize("name", [n for n in GPUS if n != "t4"])  # Turing: fp16 only
def test_gpu_precision_ladder(name):
    p = get_profile(name)
    assert p.peak_flops("float8_e4m3fn") >= p.peak_flops("bfloat16") > p.peak_flops("tensorfloat32")
    assert p.peak_flops("tensorfloat32") > p.peak_flops("float32")
    assert p.peak_flops("float16") == p.peak_flops("bfloat16")


@pytest.mark.parametrize("name", GPUS)
def test_gpu_float32_matmuls_run_as_xla_runs_them(name):
    # XLA:GPU computes default-precision float32 dots on TF32 tensor cores (Ampere and later)
    p = get_profile(name)
    tf32 = name != "t4"
    assert p.matmul_flops("float32") == p.peak_flops("tensorfloat32" if tf32 else "float32")
    assert p.matmul_flops("float32", highest=True) == p.peak_flops("float32")
    assert p.matmul_flops("bfloat16") == p.peak_flops("bfloat16")
    assert 0 < p.achieved_hbm_bytes_per_s < p.hbm_bandwidth_bytes_per_s


def test_cpu_and_tpu_float32_matmuls_at_the_float32_rate():
    for name in ("cpu", "tpu-v5e"):
        p = get_profile(name)
        assert p.matmul_flops("float32") == p.peak_flops("float32")
        assert p.achieved_hbm_bytes_per_s == p.hbm_bandwidth_bytes_per_s


@pytest.mark.parametrize("name", ALL_NAMES)
def test_peak_flops_accepts_every_dtype_spelling(name):
    p = get_profile(name)
    bf16, f32 = p.peak_flops_per_s["bfloat16"], p.peak_flops_per_s["float32"]
    for spelling in ("bfloat16", "bf16", "BF16", jnp.bfloat16, np.dtype(jnp.bfloat16), jnp.zeros(2, jnp.bfloat16)):
        assert p.peak_flops(spelling) == bf16, spelling
    for spelling in ("float32", "fp32", "f32", jnp.float32, np.float32, np.dtype("float32")):
        assert p.peak_flops(spelling) == f32, spelling
    shape = jax.ShapeDtypeStruct((4,), jnp.bfloat16)
    assert p.peak_flops(shape) == bf16


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("dtype", ["int8", jnp.int32, np.int64, jnp.bool_, "complex64", "float64", "no-such-dtype"])
def test_int_and_unknown_dtypes_use_float32_number(name, dtype):
    p = get_profile(name)
    assert p.peak_flops(dtype) == p.peak_flops_per_s["float32"]


@pytest.mark.parametrize("name", TPUS + ("cpu",))
def test_float16_and_fp8_fall_back_to_bf16_where_absent(name):
    p = get_profile(name)
    assert "float16" not in p.peak_flops_per_s
    assert p.peak_flops(jnp.float16) == p.peak_flops("bfloat16")
    assert p.peak_flops(jnp.float8_e4m3fn) == p.peak_flops("bfloat16")
    assert p.peak_flops("fp8") == p.peak_flops("bfloat16")
    # tensorfloat32 has no meaning here: full float32
    assert p.peak_flops("tensorfloat32") == p.peak_flops("float32")


@pytest.mark.parametrize("name", ("h100", "h200", "b200"))
def test_every_fp8_format_uses_the_fp8_number(name):
    p = get_profile(name)
    fp8 = p.peak_flops_per_s["float8_e4m3fn"]
    assert fp8 == pytest.approx(2 * p.peak_flops("bfloat16"), rel=1e-3)
    for dt in (jnp.float8_e4m3fn, jnp.float8_e5m2, "float8_e5m2", "fp8"):
        assert p.peak_flops(dt) == fp8


def test_a100_has_no_fp8_and_falls_back_to_bf16():
    p = get_profile("a100")
    assert p.peak_flops(jnp.float8_e4m3fn) == p.peak_flops("bfloat16") == 312e12


# --------------------------------------------------------------------- pinned datasheet numbers


@pytest.mark.parametrize(
    "name, dtype, flops, hbm_bw, hbm_bytes, inner_kind, inner_bw, outer_kind, outer_bw",
    [
        ("h100", "bfloat16", 989e12, 3.35e12, 80e9, LevelKind.NVLINK, 450e9, LevelKind.INFINIBAND, 50e9),
        ("h200", "bfloat16", 989e12, 4.8e12, 141e9, LevelKind.NVLINK, 450e9, LevelKind.INFINIBAND, 50e9),
        ("a100-40gb", "bfloat16", 312e12, 1555e9, 40e9, LevelKind.NVLINK, 300e9, LevelKind.INFINIBAND, 25e9),
        ("a100-80gb", "bfloat16", 312e12, 2039e9, 80e9, LevelKind.NVLINK, 300e9, LevelKind.INFINIBAND, 25e9),
        ("b200", "bfloat16", 2.25e15, 7.7e12, 180e9, LevelKind.NVLINK, 900e9, LevelKind.INFINIBAND, 50e9),
        ("tpu-v4", "bfloat16", 275e12, 1200e9, 32 * 2**30, LevelKind.ICI, 90e9, LevelKind.DCN, 6.25e9),
        ("tpu-v5e", "bfloat16", 197e12, 819e9, 16e9, LevelKind.ICI, 100e9, LevelKind.DCN, 3.125e9),
        ("tpu-v5p", "bfloat16", 459e12, 2765e9, 95 * 2**30, LevelKind.ICI, 200e9, LevelKind.DCN, 6.25e9),
        ("tpu-v6e", "bfloat16", 918e12, 1638e9, 32e9, LevelKind.ICI, 200e9, LevelKind.DCN, 12.5e9),
    ],
)
def test_sourced_numbers(name, dtype, flops, hbm_bw, hbm_bytes, inner_kind, inner_bw, outer_kind, outer_bw):
    p = get_profile(name)
    assert p.peak_flops(dtype) == pytest.approx(flops)
    assert p.hbm_bandwidth_bytes_per_s == pytest.approx(hbm_bw)
    assert p.hbm_capacity_bytes == int(hbm_bytes)
    assert [lvl.kind for lvl in p.levels] == [inner_kind, outer_kind]
    assert p.level(inner_kind).bandwidth_bytes_per_s == pytest.approx(inner_bw)
    assert p.level(outer_kind).bandwidth_bytes_per_s == pytest.approx(outer_bw)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_profile_invariants(name):
    p = get_profile(name)
    assert 0 < p.matmul_efficiency <= 1
    assert p.launch_overhead_s >= 0
    assert p.levels[-1].devices_per_group is None
    # outer levels are slower and no faster to start than inner ones, and group more devices
    for inner, outer in zip(p.levels, p.levels[1:]):
        assert outer.bandwidth_bytes_per_s < inner.bandwidth_bytes_per_s
        assert outer.latency_s >= inner.latency_s
    # the interconnect never outruns the device's own memory
    assert all(lvl.bandwidth_bytes_per_s < p.hbm_bandwidth_bytes_per_s for lvl in p.levels)


def test_cpu_profile_is_a_single_host_level():
    p = get_profile("cpu")
    assert [lvl.kind for lvl in p.levels] == [LevelKind.HOST]
    assert p.innermost is p.level("host") is p.level(LevelKind.HOST)


def test_level_lookup_errors_name_the_level_and_choices():
    with pytest.raises(ProfileError, match=r"'dcn'.*'host'"):
        get_profile("cpu").level(LevelKind.DCN)
    with pytest.raises(ProfileError, match="warp"):
        get_profile("h100").level("warp")
    assert get_profile("h100").level("IB").kind is LevelKind.INFINIBAND


# -------------------------------------------------------------------- frozen, hashable, valid


def test_profiles_are_frozen_and_hashable():
    p = get_profile("tpu-v5e")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.peak_flops_per_s["bfloat16"] = 1.0  # type: ignore[index]
    assert {p: 1}[get_profile("v5e")] == 1
    assert len({get_profile(n) for n in ALL_NAMES}) == len(ALL_NAMES)
    assert p.peak_flops_per_s == dict(p.peak_flops_per_s)


def test_replace_revalidates_and_changes_equality():
    p = get_profile("h100")
    q = dataclasses.replace(p, matmul_efficiency=0.5)
    assert q != p and q.matmul_efficiency == 0.5
    with pytest.raises(ProfileError, match="matmul_efficiency"):
        dataclasses.replace(p, matmul_efficiency=1.5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(bandwidth_bytes_per_s=-1.0), "bandwidth_bytes_per_s"),
        (dict(bandwidth_bytes_per_s=float("nan")), "bandwidth_bytes_per_s"),
        (dict(latency_s=-1e-6), "latency_s"),
        (dict(devices_per_group=0), "devices_per_group"),
        (dict(kind="warp"), "kind"),
    ],
)
def test_link_level_validation(kwargs, field):
    base = dict(kind=LevelKind.ICI, bandwidth_bytes_per_s=1e9, latency_s=1e-6, devices_per_group=4)
    base.update(kwargs)
    with pytest.raises(ProfileError, match=field):
        LinkLevel(**base)


def test_profile_validation():
    good = get_profile("h100")
    nvlink, ib = good.levels
    with pytest.raises(ProfileError, match="ordered innermost first|not the outermost"):
        dataclasses.replace(good, levels=(ib, nvlink))
    with pytest.raises(ProfileError, match="twice"):
        dataclasses.replace(good, levels=(nvlink, nvlink))
    with pytest.raises(ProfileError, match="levels"):
        dataclasses.replace(good, levels=())
    with pytest.raises(ProfileError, match="'float32'"):
        dataclasses.replace(good, peak_flops_per_s={"bfloat16": 1e12})
    with pytest.raises(ProfileError, match="hbm_capacity_bytes"):
        dataclasses.replace(good, hbm_capacity_bytes=0)


# ------------------------------------------------------------------------------------ JSON


@pytest.mark.parametrize("name", ALL_NAMES)
def test_json_round_trip_equals_original(name):
    p = get_profile(name)
    text = p.to_json()
    doc = json.loads(text)
    assert doc["format_version"] == PROFILE_FORMAT_VERSION
    q = HardwareProfile.from_json(text)
    assert q == p
    assert hash(q) == hash(p)
    assert q.to_json() == text


def _doc(name="h100"):
    return json.loads(get_profile(name).to_json())


def _load(doc):
    return HardwareProfile.from_json(json.dumps(doc))


@pytest.mark.parametrize(
    "field", ["name", "peak_flops_per_s", "hbm_bandwidth_bytes_per_s", "hbm_capacity_bytes", "levels", "format_version"]
)
def test_json_missing_field(field):
    doc = _doc()
    del doc[field]
    with pytest.raises(ProfileError) as err:
        _load(doc)
    assert repr(field) in str(err.value)
    assert "autopar profile" in str(err.value)


@pytest.mark.parametrize("version", [0, PROFILE_FORMAT_VERSION + 1, "1", True, None])
def test_json_wrong_version(version):
    doc = _doc()
    doc["format_version"] = version
    with pytest.raises(ProfileError) as err:
        _load(doc)
    message = str(err.value)
    assert "format_version" in message
    assert "autopar profile" in message


@pytest.mark.parametrize("text", ["", "not json at all", "{\"format_version\": 1,", "\x00\x01"])
def test_json_not_json(text):
    with pytest.raises(ProfileError) as err:
        HardwareProfile.from_json(text)
    assert "not valid JSON" in str(err.value)
    assert "autopar profile" in str(err.value)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d.__setitem__("hbm_capacity_bytes", "lots"), "hbm_capacity_bytes"),
        (lambda d: d.__setitem__("hbm_bandwidth_bytes_per_s", -3), "hbm_bandwidth_bytes_per_s"),
        (lambda d: d.__setitem__("peak_flops_per_s", [1, 2]), "peak_flops_per_s"),
        (lambda d: d["peak_flops_per_s"].pop("float32"), "float32"),
        (lambda d: d["peak_flops_per_s"].__setitem__("bfloat16", "fast"), "bfloat16"),
        (lambda d: d.__setitem__("levels", []), "levels"),
        (lambda d: d["levels"][0].__setitem__("kind", "warp"), "levels[0].kind"),
        (lambda d: d["levels"][1].__setitem__("bandwidth_bytes_per_s", -1), "levels[1]"),
        (lambda d: d["levels"][0].pop("latency_s"), "latency_s"),
        (lambda d: d["levels"][0].__setitem__("speed", 1), "speed"),
        (lambda d: d.__setitem__("colour", "green"), "colour"),
        (lambda d: d.__setitem__("matmul_efficiency", 2.0), "matmul_efficiency"),
        (lambda d: d.__setitem__("float32_matmul", "float64"), "float32_matmul"),
        (lambda d: d.__setitem__("hbm_efficiency", 0), "hbm_efficiency"),
    ],
)
def test_json_bad_field_is_named(mutate, needle):
    doc = _doc()
    mutate(doc)
    with pytest.raises(ProfileError) as err:
        _load(doc)
    assert needle in str(err.value)


def test_json_top_level_must_be_object():
    with pytest.raises(ProfileError, match="JSON object"):
        HardwareProfile.from_json("[1, 2, 3]")


def test_json_accepts_integer_numbers():
    doc = _doc("cpu")
    doc["hbm_bandwidth_bytes_per_s"] = 10_000_000_000
    assert _load(doc) == get_profile("cpu")


# ----------------------------------------------------------------------------- JSON files


def test_json_path_loads(tmp_path):
    path = tmp_path / "measured.json"
    custom = dataclasses.replace(get_profile("h100"), name="my-cluster", matmul_efficiency=0.6)
    path.write_text(custom.to_json())
    assert get_profile(path) == custom
    assert get_profile(str(path)) == custom
    assert isinstance(path, pathlib.Path)


def test_missing_json_path_names_it(tmp_path):
    path = tmp_path / "nope" / "profile.json"
    for arg in (path, str(path)):
        with pytest.raises(ProfileError) as err:
            get_profile(arg)
        assert str(path) in str(err.value)


def test_malformed_json_file_names_path_and_field(tmp_path):
    path = tmp_path / "old.JSON"
    doc = _doc()
    doc["format_version"] = 0
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError) as err:
        get_profile(str(path))
    assert str(path) in str(err.value)
    assert "format_version" in str(err.value)


def test_errors_are_autopar_errors():
    assert issubclass(ProfileError, AutoparError)
    assert issubclass(UnknownHardwareError, AutoparError)


# ---------------------------------------------------------------------------- axis levels


@pytest.mark.parametrize("fixture", ["mesh_1d", "mesh_2d", "mesh_3d"])
def test_cpu_meshes_map_every_axis_to_host(request, fixture):
    mesh = request.getfixturevalue(fixture)
    levels = axis_levels(mesh, get_profile("cpu"))
    assert list(levels) == list(mesh.axis_names)
    assert all(lvl.kind is LevelKind.HOST for lvl in levels.values())


@pytest.mark.parametrize("name", ACCELERATORS)
def test_single_process_meshes_use_innermost_level(mesh_2d, name):
    p = get_profile(name)
    levels = axis_levels(mesh_2d, p)
    assert levels == {"data": p.levels[0], "model": p.levels[0]}


def test_axis_levels_accepts_profile_names(mesh_1d):
    assert axis_levels(mesh_1d, "cpu")["data"].kind is LevelKind.HOST
    assert axis_levels(mesh_1d, None)["data"].kind is LevelKind.HOST


def test_overrides_win(mesh_2d):
    p = get_profile("tpu-v5e")
    levels = axis_levels(mesh_2d, p, {"data": "dcn"})
    assert levels["data"] is p.level(LevelKind.DCN)
    assert levels["model"] is p.level(LevelKind.ICI)
    levels = axis_levels(mesh_2d, p, {"model": LevelKind.DCN, "data": "ICI"})
    assert levels == {"data": p.level("ici"), "model": p.level("dcn")}


def test_override_unknown_axis(mesh_2d):
    with pytest.raises(MeshError) as err:
        axis_levels(mesh_2d, get_profile("tpu-v5e"), {"batch": "dcn"})
    message = str(err.value)
    assert "'batch'" in message and "'data'" in message and "'model'" in message


def test_override_level_missing_from_profile(mesh_2d):
    with pytest.raises(ProfileError) as err:
        axis_levels(mesh_2d, get_profile("cpu"), {"data": "dcn"})
    message = str(err.value)
    assert "'data'" in message and "'dcn'" in message and "'cpu'" in message and "'host'" in message


def test_override_not_a_level(mesh_2d):
    with pytest.raises(ProfileError) as err:
        axis_levels(mesh_2d, get_profile("h100"), {"data": "warp"})
    message = str(err.value)
    assert "'warp'" in message and "'nvlink'" in message and "'infiniband'" in message


def test_overrides_must_be_a_mapping(mesh_2d):
    with pytest.raises(ProfileError, match="overrides"):
        axis_levels(mesh_2d, get_profile("h100"), [("data", "dcn")])


def test_abstract_mesh_is_rejected(mesh_2d):
    with pytest.raises(MeshError, match="concrete"):
        axis_levels(mesh_2d.abstract_mesh, get_profile("cpu"))


# Multi-host topologies cannot be built on one CPU machine, so these use stand-in devices
# with the attributes axis_levels reads (id, process_index, slice_index).


def _fake_mesh(shape, names, *, per_process, per_slice=None, order=None):
    count = int(np.prod(shape))
    ids = np.arange(count) if order is None else np.asarray(order)
    devices = []
    for i in ids.reshape(-1):
        attrs = dict(id=int(i), process_index=int(i) // per_process)
        if per_slice is not None:
            attrs["slice_index"] = int(i) // per_slice
        devices.append(SimpleNamespace(**attrs))
    return SimpleNamespace(devices=np.array(devices, dtype=object).reshape(shape), axis_names=names)


def test_gpu_nodes_one_process_per_node():
    p = get_profile("h100")
    mesh = _fake_mesh((2, 8), ("data", "model"), per_process=8)
    levels = axis_levels(mesh, p)
    assert levels["data"].kind is LevelKind.INFINIBAND
    assert levels["model"].kind is LevelKind.NVLINK


def test_gpu_nodes_one_process_per_gpu():
    # processes differ inside a node, but the 8 GPUs of a node still share NVLink
    p = get_profile("a100")
    mesh = _fake_mesh((2, 8), ("data", "model"), per_process=1)
    levels = axis_levels(mesh, p)
    assert levels == {"data": p.level("infiniband"), "model": p.level("nvlink")}


def test_gpu_axis_crossing_nodes_by_device_order():
    # a size-2 axis whose two devices sit on different nodes is an InfiniBand axis
    p = get_profile("h100")
    order = np.arange(16).reshape(2, 8).T  # shape (8, 2): axis "data" pairs device i with i+8
    mesh = _fake_mesh((8, 2), ("model", "data"), per_process=8, order=order)
    levels = axis_levels(mesh, p)
    assert levels["data"].kind is LevelKind.INFINIBAND
    assert levels["model"].kind is LevelKind.NVLINK


def test_gpu_axis_larger_than_a_node():
    p = get_profile("h200")
    mesh = _fake_mesh((16,), ("data",), per_process=1)
    assert axis_levels(mesh, p)["data"].kind is LevelKind.INFINIBAND


def test_tpu_multislice_uses_dcn_only_between_slices():
    # 2 slices x 16 chips, 4 chips per host process: processes differ inside a slice, ICI
    # still connects them; only the slice axis crosses DCN.
    p = get_profile("tpu-v5e")
    mesh = _fake_mesh((2, 4, 4), ("replica", "data", "model"), per_process=4, per_slice=16)
    levels = axis_levels(mesh, p)
    assert levels["replica"].kind is LevelKind.DCN
    assert levels["data"].kind is LevelKind.ICI
    assert levels["model"].kind is LevelKind.ICI
    # overrides still win over topology
    assert axis_levels(mesh, p, {"replica": "ici"})["replica"].kind is LevelKind.ICI


def test_tpu_single_slice_without_slice_index_is_ici():
    p = get_profile("tpu-v5p")
    mesh = _fake_mesh((4, 8), ("data", "model"), per_process=4)
    assert {lvl.kind for lvl in axis_levels(mesh, p).values()} == {LevelKind.ICI}
