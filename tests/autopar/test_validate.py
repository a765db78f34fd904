"""plan.validate(): prediction beside the compiled program, and the flags for collectives the
plan did not price. Tiny shapes (compiling is what takes time here, nothing runs)."""

import dataclasses

import jax
import pytest
from jax.sharding import PartitionSpec as P

import autopar
from autopar._validate import _with_stages, count_note, flag_kinds, validate, validation_table
from autopar.cost_model.hlo import analyze
from autopar.models import gpt, mlp
from tests.autopar.test_pipeline import CONFIG, _gpt_case, _step


@pytest.fixture(scope="module")
def gpt_plan():
    fn, args = gpt.make_train_step(gpt.TINY)
    hint = (None, None, jax.tree_util.tree_map(lambda _: jax.sharding.PartitionSpec("data"),
                                               args[2]))
    # The ILP's own plan (at these tiny shapes the data-parallel seed wins, and it runs one
    # kind of collective): the test wants several kinds side by side.
    return autopar.plan(fn, *args, mesh={"data": 2, "model": 4}, in_shardings=hint,
                        baseline_seeds=False)


def test_validate_puts_every_measure_beside_the_compiled_one(gpt_plan):
    v = validate(gpt_plan)
    truth = analyze(gpt_plan.compile())
    assert v["wire_bytes"] == (gpt_plan.estimate.comm_bytes, truth.wire_bytes)
    assert v["flops"] == (gpt_plan.estimate.flops, truth.flops_all_trips)
    assert v["peak_memory_bytes"] == (gpt_plan.estimate.peak_memory_bytes,
                                      truth.peak_memory_bytes)
    compiled = {k.value: n_b for k, n_b in truth.by_kind().items()}
    assert len(compiled) >= 2
    assert {k: c for k, (_, c) in v["by_kind"].items() if c[0]} == compiled
    for kind, ((p_count, p_bytes), (count, nbytes)) in v["by_kind"].items():
        assert count <= p_count and nbytes == pytest.approx(p_bytes, rel=0.10), kind
    assert v["flags"] == {} and v["unexpected_kinds"] == []
    table = validation_table(gpt_plan, v)
    for name in ["wire bytes", "flops", "peak memory", *compiled]:
        assert name in table
    assert "did not predict" not in table
    assert "MFLOP" in table and "KiB" in table   # units that fit, not 4.578e+07
    merged = [k for k, ((pn, _), (cn, _)) in v["by_kind"].items() if 0 < cn < pn]
    for kind in merged:   # a count XLA's combiner lowered is explained where it shows
        assert f"XLA's {kind} combiner merged" in table


def test_validation_goes_into_the_report_json_and_html(gpt_plan):
    v = validate(gpt_plan)
    assert gpt_plan.stats["validation"] is v
    assert "Validation: predicted vs compiled" in gpt_plan.report()
    saved = autopar.Plan.from_json(gpt_plan.to_json())
    assert saved.stats["validation"]["by_kind"].keys() == v["by_kind"].keys()
    page = gpt_plan.to_html()
    assert "Validation: predicted beside compiled" in page and "predicted" in page


@pytest.mark.parametrize("predicted, compiled, note", [
    ((51, 1000.0), (12, 1000.0), "XLA's all-reduce combiner merged 51 into 12"),
    ((4, 100.0), (4, 100.0), ""),
    ((4, 100.0), (0, 0.0), "XLA compiled none of the 4 predicted"),
    ((4, 2048.0), (2, 1024.0), "XLA merged or removed some: 4 predicted, 2 compiled, "
                               "1.0 KiB fewer bytes"),
    ((4, 1024.0), (2, 2048.0), "2 compiled, 4 predicted, 1.0 KiB more bytes"),
    ((2, 643.0), (13, 643.0), "13 compiled, 2 predicted, the same bytes: run in more steps "
                              "(a region's loop)"),
])
def test_count_notes(predicted, compiled, note):
    assert count_note("all-reduce", predicted, compiled) == note


def test_a_pipelined_stack_s_collectives_count_by_kind():
    """Its layers' own collectives and its stage-to-stage sends join the plan's by kind."""
    predicted = {"all-reduce": (2, 100.0), "all-gather": (1, 10.0)}
    pipeline = {"sends": 6, "send_bytes": 60.0,
                "layer_collectives": {"all-reduce": (40, 4000.0),
                                      "collective-permute": (2, 8.0)}}
    assert _with_stages(predicted, pipeline) == {
        "all-reduce": (42, 4100.0), "all-gather": (1, 10.0), "collective-permute": (8, 68.0)}
    assert _with_stages(predicted, None) == predicted


def _without_kind(plan, kind: str):
    graph, strats, choice, comms = plan._details
    kept = [c for c in comms if c.step.kind is None or c.step.kind.value != kind]
    assert len(kept) < len(comms)
    return dataclasses.replace(plan, _details=(graph, strats, choice, kept))


def test_a_compiled_kind_missing_from_the_prediction_is_flagged():
    fn, args = mlp.make_train_step(mlp.TINY)
    batch = (None,) * (len(args) - 1) + (jax.tree_util.tree_map(lambda _: P("data"), args[-1]),)
    plan = autopar.plan(fn, *args, mesh={"data": 8}, in_shardings=batch)  # all-reduces grads
    v = validate(_without_kind(plan, "all-reduce"))
    assert v["unexpected_kinds"] == ["all-reduce"]
    assert v["flags"]["all-reduce"] == "not predicted"
    assert v["by_kind"]["all-reduce"][0] == (0, 0.0)
    assert "did not predict: all-reduce" in validation_table(plan, v)


def test_a_pipelined_plan_is_flagged_too():
    """A pipelined plan's collectives are checked as any plan's; the flag says where a
    stage's layers may part from the layer's plan."""
    loss_fn, tx, args, _ = _gpt_case(CONFIG)
    plan = autopar.plan(_step(autopar.value_and_grad, loss_fn, tx), *args,
                        mesh={"stage": 4, "data": 2}, hardware="h100",
                        pipeline=autopar.Pipeline(axis="stage", schedule="gpipe"))
    assert validate(plan)["flags"] == {}
    v = validate(_without_kind(plan, "all-reduce"))   # the sums the region ends with
    assert v["flags"] == {"all-reduce": "not predicted"}
    assert "partitioned by XLA from the stage's input specs" in validation_table(plan, v)


@pytest.mark.parametrize("predicted, compiled, flagged", [
    ({"all-reduce": (4, 100.0)}, {"all-reduce": (2, 100.0)}, None),        # combined by XLA
    ({"all-reduce": (4, 100.0)}, {"all-reduce": (4, 109.0)}, None),        # within 10%
    ({"all-reduce": (4, 100.0)}, {"all-reduce": (5, 100.0)}, None),        # more steps
    ({"all-reduce": (4, 100.0)}, {"all-reduce": (5, 130.0)}, "1.30x the predicted bytes"),
    ({"all-reduce": (4, 100.0)}, {"all-reduce": (4, 120.0)}, "1.20x the predicted bytes"),
    ({"all-reduce": (4, 100.0)}, {"all-to-all": (1, 10.0)}, "not predicted"),
    ({"all-gather": (3, 50.0)}, {}, None),                                  # predicted only
])
def test_flag_rules(predicted, compiled, flagged):
    flags = flag_kinds(predicted, compiled)
    assert flags == ({} if flagged is None else {next(iter(compiled)): flagged})
