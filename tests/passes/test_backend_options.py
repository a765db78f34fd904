"""Backend options: the overlap options per hardware profile, validated on the backend they
target and skipped with a note elsewhere, never through XLA_FLAGS."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.cost_model.hardware import LevelKind, LinkLevel, get_profile, known_profiles
from autopar.passes import backend_options as bo
from autopar.passes.backend_options import Backend, BackendOption

GPU_PROFILES = ("t4", "l4", "a100-40gb", "a100-80gb", "h100", "h200", "b200")
TPU_PROFILES = ("tpu-v2", "tpu-v3", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e")
BOGUS = "xla_autopar_no_such_option"


def _names(notes):
    return [n.name for n in notes]


def test_every_built_in_profile_names_its_backend():
    assert set(GPU_PROFILES) | set(TPU_PROFILES) | {"cpu"} == set(known_profiles())
    for name in GPU_PROFILES:
        assert bo.profile_backend(get_profile(name)) is Backend.GPU
    for name in TPU_PROFILES:
        assert bo.profile_backend(get_profile(name)) is Backend.TPU
    assert bo.profile_backend(get_profile("cpu")) is Backend.CPU
    ethernet = dataclasses.replace(
        get_profile("cpu"), levels=(LinkLevel(LevelKind.ETHERNET, 1e9, 1e-5, None),))
    assert bo.profile_backend(ethernet) is None
    assert bo.choose(ethernet, jax.devices()[0]) == ()


@pytest.mark.parametrize("name,expected", [
    ("h100", {"xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_enable_pipelined_all_gather",
              "xla_gpu_multi_streamed_windowed_einsum"}),
    ("tpu-v5p", {"xla_tpu_enable_async_collective_fusion", "xla_enable_async_all_gather",
                 "xla_tpu_enable_windowed_einsum_for_all_gather",
                 "xla_tpu_enable_windowed_einsum_for_reduce_scatter"}),
])
def test_option_set_per_profile(name, expected):
    table = bo.OPTIONS[bo.profile_backend(get_profile(name))]
    assert expected <= {o.name for o in table}
    assert {o.backend for o in table} == {bo.profile_backend(get_profile(name))}
    assert all(o.why for o in table)
    assert bo.OPTIONS[Backend.CPU] == ()


def test_multi_streamed_windowed_einsum_is_off_on_jaxlib_0_10_2(monkeypatch):
    multi = next(o for o in bo.GPU_OPTIONS if o.name == "xla_gpu_multi_streamed_windowed_einsum")
    assert "0.10.2" in multi.broken_on_jaxlib and "39200" in multi.bug
    # On a CPU device every GPU option is skipped; on 0.10.2 the note names the bug first.
    monkeypatch.setattr(bo, "jaxlib_version", lambda: "0.10.2")
    notes = {n.name: n for n in bo.choose(get_profile("h100"), jax.devices()[0])}
    assert not notes[multi.name].is_set and "jax#39200" in notes[multi.name].why


def test_gpu_and_tpu_options_skipped_on_cpu_with_a_note():
    device = jax.devices()[0]
    for name in ("h100", "tpu-v4"):
        backend = bo.profile_backend(get_profile(name))
        notes = bo.choose(get_profile(name), device)
        assert _names(notes) == [o.name for o in bo.OPTIONS[backend]]
        assert bo.as_options(notes) == {}
        for n in notes:
            assert not n.is_set
            assert (f"targets {backend.value}; this program compiles for cpu" in n.why
                    or "jax#39200" in n.why)


def _cpu_table(*options):
    return tuple(BackendOption(name, value, Backend.CPU, f"test: {name}", **kw)
                 for name, value, kw in options)


def test_validated_on_the_backend_it_targets(monkeypatch):
    """An option the targeted compiler knows is set; one it refuses is skipped with its error
    and never reaches XLA_FLAGS; an option broken on this jaxlib is skipped with its bug."""
    monkeypatch.setattr(bo, "jaxlib_version", lambda: "9.9.9")
    flags_before = os.environ.get("XLA_FLAGS")
    table = _cpu_table(("xla_gpu_enable_latency_hiding_scheduler", True, {}),
                       (BOGUS, True, {}),
                       ("xla_gpu_enable_pipelined_all_gather", True,
                        {"broken_on_jaxlib": ("9.9.9",), "bug": "bug#1"}))
    notes = bo.choose(get_profile("cpu"), jax.devices()[0], table=table)
    good, bogus, broken = notes
    assert good.is_set and good.why == "test: xla_gpu_enable_latency_hiding_scheduler"
    assert not bogus.is_set and "No such compile option" in bogus.why
    assert not broken.is_set and "off on jaxlib 9.9.9: bug#1" in broken.why
    assert bo.as_options(notes) == {"xla_gpu_enable_latency_hiding_scheduler": True}
    assert os.environ.get("XLA_FLAGS") == flags_before
    assert BOGUS not in (os.environ.get("XLA_FLAGS") or "")
    assert BOGUS not in os.environ.get("LIBTPU_INIT_ARGS", "")


def _mlp(w1, w2, x):
    return jnp.tanh(jnp.tanh(x @ w1) @ w2).sum()


@pytest.mark.parametrize("hardware", ["h100", "tpu-v5e", "cpu"])
def test_plan_lists_options_and_compiles_with_them(hardware, mesh_2d):
    args = (jnp.ones((32, 64)), jnp.ones((64, 32)), jnp.ones((16, 32)))
    p = autopar.plan(_mlp, *args, mesh=mesh_2d, hardware=hardware)
    notes = p.stats["compiler_options"]
    backend = bo.profile_backend(get_profile(hardware))
    assert [n["name"] for n in notes] == [o.name for o in bo.OPTIONS[backend]]
    assert p.compiler_options == {n["name"]: n["value"] for n in notes if n["set"]} == {}
    report = p.report()
    assert "XLA compiler options (plan.compiler_options" in report
    section = report.split("XLA compiler options")[1].split("\n\n")[0]
    assert max(map(len, section.splitlines())) <= 100   # the skipped options' lines wrap
    words = " ".join(section.split())
    for n in notes:
        assert f"{n['name']}={n['value']}" in words and " ".join(n["why"].split()) in words
    np.testing.assert_allclose(p.jit()(*args), _mlp(*args), rtol=1e-5)
    assert autopar.Plan.from_json(p.to_json()).stats["compiler_options"] == notes


def test_plan_on_cpu_keeps_the_option_its_program_needs(mesh_1d):
    """A program with optimization barriers (as a rematerialized one has) keeps them on
    XLA:CPU: that option is set, listed first with its reason, and the program compiles."""
    def step(w, x):
        h, w = jax.lax.optimization_barrier((jnp.tanh(x @ w), w))
        return jnp.tanh(h @ w).sum()
    args = (jnp.ones((32, 32)), jnp.ones((16, 32)))
    p = autopar.plan(step, *args, mesh=mesh_1d, hardware="h100")
    assert p.compiler_options == {"xla_disable_hlo_passes": "cse_barrier_expander"}
    first = p.stats["compiler_options"][0]
    assert first["set"] and "optimization barriers" in first["why"]
    assert "set  xla_disable_hlo_passes=cse_barrier_expander" in p.report()
    np.testing.assert_allclose(p.jit()(*args), step(*args), rtol=1e-5)
