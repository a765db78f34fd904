"""Bad input gets a clear AutoparError subclass that names the problem and the fix."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autopar
from autopar.errors import (ArgumentError, MeshError, PlanFormatError, ShardingHintError,
                            UnknownHardwareError)


def _fn(w, x):
    return jnp.tanh(x @ w).sum()


ARGS = (jnp.ones((16, 16)), jnp.ones((8, 16)))


@pytest.mark.parametrize("mesh, match", [
    ({"data": 16}, "needs 16 devices but 8"),
    ({"data": 3}, r"needs 3 devices but 8 cpu device\(s\) exist.*"
                  r"autopar\.simulate_cpu_devices\(3\) before jax starts in Python"),
    ({"data": 2, "model": 2}, "needs 4 devices"),
    ({}, "has no axes"),
    ({"data": 0}, "give a positive integer"),
    ("data=2,model", "malformed mesh"),
    ([2, 4], "must be a jax.sharding.Mesh or a dict"),
])
def test_bad_mesh(mesh, match):
    with pytest.raises(MeshError, match=match):
        autopar.plan(_fn, *ARGS, mesh=mesh)


def test_more_devices_than_exist_says_how_to_simulate():
    with pytest.raises(MeshError, match="xla_force_host_platform_device_count"):
        autopar.plan(_fn, *ARGS, mesh={"data": 64})


def test_non_array_leaf_is_named():
    with pytest.raises(ArgumentError, match=r"args\[1\]\['lr'\]"):
        autopar.plan(lambda w, c: w * c["lr"], jnp.ones(8), {"lr": 0.1}, mesh={"data": 8})


@pytest.mark.parametrize("leaf", [np.array(["a", "b"]), np.array([object()] * 2)],
                         ids=["strings", "objects"])
def test_an_array_jax_cannot_trace_is_named(leaf):
    with pytest.raises(ArgumentError, match=r"args\[1\]` is an array of dtype"):
        autopar.plan(lambda w, s: w, jnp.ones(8), leaf, mesh={"data": 8})


def test_16_bit_floats_keys_and_float0_are_arrays_jax_traces():
    """bfloat16 (numpy kind "V", as every ml_dtype) and typed PRNG keys plan, and float0 (a
    record dtype: the tangents of integers, which pipeline stages trace) is not refused."""
    from autopar.passes.trace import check_args
    check_args((np.zeros(3, jax.dtypes.float0),))
    plan = autopar.plan(lambda w, k: w * jax.random.uniform(k, w.shape, w.dtype),
                        jnp.ones(8, jnp.bfloat16), jax.random.key(0), mesh={"data": 8})
    assert plan.estimate.step_time_s > 0


def test_unknown_hardware_lists_known_names():
    with pytest.raises(UnknownHardwareError, match="h100"):
        autopar.plan(_fn, *ARGS, mesh={"data": 8}, hardware="tpu-v99")


@pytest.mark.parametrize("hints, match", [
    ((P("model"), None), "names mesh axis `model`"),
    ((P(None, "data"), P("data")), None),  # fine: data divides both
    ((P(("data",)), P(None, None, "data")), "more entries than the rank"),
    ((None, None, None), "`in_shardings` does not match the arguments it hints: the hint is "
                         "a tuple of 3 where the arguments are a tuple of 2"),
])
def test_bad_hints(hints, match):
    if match is None:
        autopar.plan(_fn, *ARGS, mesh={"data": 8}, in_shardings=hints)
        return
    with pytest.raises(ShardingHintError, match=match):
        autopar.plan(_fn, *ARGS, mesh={"data": 8}, in_shardings=hints)


def test_hint_against_mesh_axis_order_is_refused_not_reordered():
    with pytest.raises(ShardingHintError, match="mesh's axis order"):
        autopar.plan(_fn, *ARGS, mesh={"data": 2, "model": 4},
                     in_shardings=(P(("model", "data")), None))


def test_indivisible_hint_says_what_divides():
    with pytest.raises(ShardingHintError, match="pad dim 0 to 16"):
        autopar.plan(_fn, jnp.ones((12, 16)), jnp.ones((8, 12)), mesh={"data": 8},
                     in_shardings=(P("data"), None))


def test_indivisible_shapes_still_plan():
    """No axis divides 7 or 5: the planner keeps those dims whole and the plan is right."""
    w, x = jnp.ones((7, 5)), jnp.ones((3, 7))
    plan = autopar.plan(_fn, w, x, mesh={"data": 8})
    assert jnp.allclose(plan.jit()(w, x), _fn(w, x))


@pytest.mark.filterwarnings("ignore:autopar. HiGHS reached:autopar.errors.SolverFallbackWarning")
@pytest.mark.parametrize("seeds", [False, True])
def test_ilp_time_limit_falls_back_and_says_so(seeds):
    """Without a solution in time the plan is greedy; with baseline seeds the ILP starts from
    the best propagated plan, keeps it when it finds nothing better, and says so; the plan is
    the fastest predicted of all. Either way it computes what one device does."""
    from autopar.models import mlp
    from autopar.errors import SolverFallbackWarning
    fn, args = mlp.make_train_step(mlp.TINY)
    match = "no plan better than the propagated one" if seeds else "greedy plan"
    with pytest.warns(SolverFallbackWarning, match=match):
        plan = autopar.plan(fn, *args, mesh={"data": 2, "model": 4}, time_limit_s=1e-6,
                            baseline_seeds=seeds)
    times = plan.stats.get("candidates_step_s", {})
    if seeds:
        assert "warm start" in times and plan.stats["solver_status"] in times
        assert times[plan.stats["solver_status"]] == min(times.values())
        assert plan.stats["source"] == ("ilp" if plan.stats["solver_status"] == "warm start"
                                        else "propagated")
    else:
        assert plan.stats["solver_status"] == "greedy"
        assert plan.stats["source"] == "ilp"
    expected = jax.tree_util.tree_leaves(fn(*args))
    got = jax.tree_util.tree_leaves(plan.jit()(*args))
    for a, b in zip(got, expected):
        assert jnp.allclose(a, b, rtol=2e-3, atol=2e-5)


def test_unsupported_primitive_falls_back_replicated_and_is_reported():
    from autopar.errors import UnsupportedPrimitiveWarning
    fn = lambda x: jnp.linalg.cholesky(x @ x.T + 8 * jnp.eye(8)).sum()  # noqa: E731
    x = jnp.ones((8, 8))
    with pytest.warns(UnsupportedPrimitiveWarning, match="cholesky") as record:
        plan = autopar.plan(fn, x, mesh={"data": 8})
    assert {w.filename for w in record} == {__file__}  # the user's line, not autopar's
    assert "cholesky" in plan.report()
    assert jnp.allclose(plan.jit()(x), fn(x), rtol=2e-3)


def test_bad_plan_json():
    with pytest.raises(PlanFormatError, match="not a valid autopar plan"):
        autopar.Plan.from_json("{not json")
    with pytest.raises(PlanFormatError, match="format version"):
        autopar.Plan.from_json('{"format_version": 99, "in_shardings": []}')
    with pytest.raises(PlanFormatError, match="not a saved plan.*hardware profile"):
        autopar.Plan.from_json('{"format_version": 2, "peak_flops_per_s": {}}')
    with pytest.raises(PlanFormatError, match="no plan file"):
        autopar.Plan.load("/nonexistent/plan.json")


@pytest.mark.parametrize("text", ["null", "[]", "3", '"plan"'])
def test_plan_json_that_is_no_object_is_a_plan_format_error(text):
    with pytest.raises(PlanFormatError, match="not a valid autopar plan"):
        autopar.Plan.from_json(text)


def test_plan_file_that_is_not_text_or_a_spec_that_is_a_string(tmp_path):
    binary = tmp_path / "plan.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(PlanFormatError, match="cannot read a plan"):
        autopar.Plan.load(binary)
    plan = autopar.plan(lambda x: x * 2, jnp.ones((8, 8)), mesh={"data": 8}, hardware="cpu")
    record = json.loads(plan.to_json())
    record["in_shardings"][0]["spec"] = "data"
    with pytest.raises(PlanFormatError, match="a spec must be a list"):
        autopar.Plan.from_json(json.dumps(record))
