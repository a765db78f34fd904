"""The benchmark runner (benchmarks/run.py) on one tiny row, its options, and the fast compile
it relies on. The benchmark itself is not a test: `python -m benchmarks.run`."""

import json
import sys
import types

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import autopar
from benchmarks import run, sharding, workloads
from autopar._mesh import as_auto_mesh
from autopar.cost_model.hardware import get_profile
from autopar.cost_model.hlo import analyze
from autopar.cost_model.timeline import simulate
from autopar.models import mlp


def test_one_tiny_row_writes_the_tables(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(workloads.WORKLOADS, "mlp", (mlp, mlp.TINY))
    assert run.main(["--models", "mlp", "--meshes", "2x4", "--jobs", "1",
                     "--time-limit-s", "30", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["plan_kwargs"] == {"time_limit_s": 30.0}
    (row,) = data["rows"]
    assert row["mesh"] == "2x4" and row["axes"] == {"data": 2, "model": 4}
    assert set(row["programs"]) == {"autopar", "dp", "fsdp", "megatron", "megatron_vocab"}
    ours = row["programs"]["autopar"]
    assert ours["flops"] > 0 and ours["peak_memory_bytes"] > 0 and row["cpu_s"] > 0
    best = row["programs"][row["best_baseline"]]
    assert row["ratio"] == pytest.approx(ours["step_time_s"] / best["step_time_s"])
    assert all(best["step_time_s"] <= p["step_time_s"]
               for k, p in row["programs"].items() if k != "autopar" and p["fits"])
    _check_simulated_columns(row, data["meta"])
    md = (tmp_path / "results.md").read_text()
    assert "| mlp | 2x4 |" in md and "## Every program" in md
    assert "| autopar sim ms | autopar exposed ms | autopar / limit |" in md
    assert f"| {_ms(ours['makespan_s'])} | {_ms(ours['exposed_comm_s'])} " \
           f"| {ours['limit_ratio']:.2f} |" in md
    assert "| mlp | 2x4 |" in capsys.readouterr().out


def _ms(seconds):
    return f"{seconds * 1e3:.3f}"


def _check_simulated_columns(row, meta):
    """Every program has the timeline's makespan, exposed communication and ratio to the
    compute-only limit, which is the single-device program's simulated step over the devices."""
    fn, args = workloads.abstract_train_step("mlp")
    single = jax.jit(fn).lower(*args).compile(compiler_options=sharding.COMPILE_OPTIONS)
    one_device = simulate(single.as_text(), get_profile("h100"), jnp.bfloat16)
    assert row["limit_s"] == pytest.approx(one_device.step_time_s / meta["devices"])
    assert one_device.exposed_comm_s == 0 and meta["devices"] == 8
    for name, p in row["programs"].items():
        assert 0 <= p["exposed_comm_s"] < p["makespan_s"], name
        assert p["limit_ratio"] == pytest.approx(p["makespan_s"] / row["limit_s"]), name
        # No program over 8 devices beats the single device's work split 8 ways by much
        # (a sharded program can drop replicated work, never most of it).
        assert p["limit_ratio"] > 0.5, name
    fitting = {k: p for k, p in row["programs"].items() if k != "autopar" and p["fits"]}
    assert row["best_simulated_baseline"] == min(fitting, key=lambda k: fitting[k]["makespan_s"])
    compiled = sharding.compile_baseline(fn, args, as_auto_mesh(row["axes"]), "dp",
                                         sharding.COMPILE_OPTIONS)
    timeline = simulate(compiled.as_text(), get_profile("h100"), jnp.bfloat16)
    assert row["programs"]["dp"]["makespan_s"] == pytest.approx(timeline.step_time_s)
    assert row["programs"]["dp"]["exposed_comm_s"] == pytest.approx(timeline.exposed_comm_s)
    # At the program's dtypes a widened collective moves less, and no step gets longer.
    native = simulate(compiled.as_text(), get_profile("h100"), jnp.bfloat16,
                      program_dtypes=True)
    assert row["programs"]["dp"]["makespan_program_dtypes_s"] == pytest.approx(
        native.step_time_s)
    for name, p in row["programs"].items():
        assert p["makespan_program_dtypes_s"] <= p["makespan_s"] * (1 + 1e-9), name
    assert row["best_program_dtypes_baseline"] == min(
        fitting, key=lambda k: fitting[k]["makespan_program_dtypes_s"])


def test_fast_compile_changes_no_measure(mesh_2d):
    fn, args = mlp.make_train_step(mlp.TP_FRIENDLY, abstract=True)
    batch = (None,) * (len(args) - 1) + (jax.tree_util.tree_map(lambda _: P("data"), args[-1]),)
    plan = autopar.plan(fn, *args, mesh=mesh_2d, hardware="h100", in_shardings=batch)
    default = analyze(sharding.compile_plan(plan, args))
    fast = analyze(sharding.compile_plan(plan, args, sharding.FAST_COMPILE))
    assert fast.wire_bytes == default.wire_bytes
    assert fast.flops == default.flops
    assert fast.peak_memory_bytes == default.peak_memory_bytes
    assert [c.kind for c in fast.collectives] == [c.kind for c in default.collectives]
    assert default.collectives, "a plan with collectives, so that the check means something"


def test_mesh_shapes_and_names():
    assert run.parse_shape("2x2x2") == (2, 2, 2)
    assert sharding.mesh_axes((4, 2)) == {"data": 4, "model": 2}
    assert sharding.mesh_axes((2, 2, 2)) == {"data": 2, "model": 2, "expert": 2}
    for bad in ("2x", "0x8", "2x2x2x1", "a"):
        with pytest.raises(ValueError):
            run.parse_shape(bad)


def test_bad_options_exit_with_a_message(capsys):
    for argv, words in ((["--models", "nope"], "unknown model"),
                        (["--meshes", "8,2x2"], "same number of devices"),
                        (["--hardware", "abacus"], "unknown hardware")):
        with pytest.raises(SystemExit) as e:
            run.main(argv)
        assert e.value.code == 2
        assert words in capsys.readouterr().err


def test_planning_suite_is_delegated(monkeypatch):
    seen = []
    fake = types.ModuleType("fake_planning")
    fake.main = lambda argv=None: seen.append(argv) or [{"rows": 1}]
    monkeypatch.setitem(sys.modules, "fake_planning", fake)
    monkeypatch.setattr(run, "_PLANNING_MODULE", "fake_planning")
    assert run.main(["--suite", "planning", "--layers", "4"]) == 0
    assert seen == [["--layers", "4"]]


def test_rows_run_longest_first():
    order = run._rows_in_order(["gpt"], [(8,), (2, 4), (2, 2, 2)])
    assert [s for _, s in order] == [(2, 2, 2), (2, 4), (8,)]


def test_limit_gap_splits_each_program_s_kernel_time_by_kind(monkeypatch):
    """benchmarks/limit_gap.py: every kernel of both programs lands in one kind (their sums
    are the timelines' compute), and only the planned program has converts beside collectives
    or exposed communication."""
    from benchmarks import limit_gap
    monkeypatch.setitem(workloads.WORKLOADS, "mlp", (mlp, mlp.TINY))
    row = limit_gap.measure_row("mlp", (2, 4))
    assert row["makespan_s"] == pytest.approx(row["compute_s"] + row["exposed_s"])
    assert sum(row["autopar"].values()) == pytest.approx(row["compute_s"])
    assert sum(row["limit"].values()) == pytest.approx(row["limit_s"])
    assert limit_gap.CONVERT_BESIDE not in row["limit"]
    assert set(row["autopar"]) <= set(limit_gap.KINDS.values()) | {
        "matmul", "multi-output fusion", "elementwise and other", limit_gap.FLOOR,
        limit_gap.CONVERT_BESIDE}
