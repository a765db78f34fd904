"""`autopar.plan(..., pipeline=autopar.Pipeline(...))`: a train step that marks its loss with
`autopar.value_and_grad` is planned with its scanned layers cut into stages, and the planned
program computes what the single-device step computes."""

import re

import jax
import numpy as np
import pytest

import autopar
from autopar._html import render_html
from autopar._layers import OTHER, layer_rows, memory_over_program, pipelined_layer
from autopar.errors import ArgumentError, PipelineError
from autopar.models import common, gpt
from tests.autopar.test_pipeline import (  # noqa: F401 (gpt_case: a fixture)
    CONFIG, _aux_case, _loss_with_aux, _masked_case, _masked_loss, _step, gpt_case)


@pytest.fixture(scope="module")
def case(gpt_case):
    loss_fn, tx, args, expected = gpt_case
    return _step(autopar.value_and_grad, loss_fn, tx), args, expected


@pytest.mark.parametrize("mesh", [{"stage": 4, "data": 2}, {"stage": 2, "data": 2, "model": 2}],
                         ids=["4x2", "2x2x2"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_plan_computes_the_single_device_step(case, mesh, schedule):
    step, args, expected = case
    plan = autopar.plan(step, *args, mesh=mesh, hardware="h100",
                        pipeline=autopar.Pipeline(axis="stage", schedule=schedule))
    stages = mesh["stage"]
    assert plan.pipeline["schedule"] == schedule and plan.pipeline["stages"] == stages
    assert plan.pipeline["layer_ranges"] == [(s * 4 // stages, (s + 1) * 4 // stages)
                                             for s in range(stages)]
    got = plan.jit()(*args)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=2e-3, atol=2e-5), got, expected)
    # The stacked layer parameters live on their stage.
    kernel = plan.in_shardings[0]["blocks"]["qkv"]["kernel"]
    assert kernel.spec[0] == "stage"
    # validate() puts the schedule beside the compiled loops
    validated = plan.validate()
    checked = validated["pipeline"]
    assert checked["ticks"][0] == checked["ticks"][1]
    table = autopar._validate.validation_table(plan, validated)
    assert "pipeline tick loops" in table and "please report" not in table
    # the estimate counts the pipelined stack's work and sends (it once priced them as free)
    (flops, compiled_flops), (wire, compiled_wire) = validated["flops"], validated["wire_bytes"]
    assert 0.5 * compiled_flops <= flops <= 1.5 * compiled_flops
    assert wire == pytest.approx(compiled_wire, rel=0.01)
    # the sums over the stage axis the region ends with (the loss, the stack input's
    # cotangent, the shared parameters' gradients) are predicted as the all-reduces compiled
    (_, summed), (_, compiled_sums) = validated["by_kind"]["all-reduce"]
    assert summed == pytest.approx(compiled_sums, rel=0.01)
    # the stage-to-stage sends are predicted as the collective-permutes XLA compiles
    (sends, send_bytes), (permutes, permute_bytes) = validated["by_kind"]["collective-permute"]
    assert (sends, send_bytes) == (permutes, permute_bytes) == (
        plan.pipeline["sends"], plan.pipeline["send_bytes"])
    assert "inside the pipelined stack" in plan.report()
    # only the pipelined stack is said to be cut into stages, whatever else the axis splits
    assert pipelined_layer(plan) == "blocks"
    assert all(("pipeline stages" in line) == line.startswith("blocks")
               for line in plan.summary().splitlines() if ":" in line)
    assert "runs no collective" not in render_html(plan)
    # Saved with the plan, and shown in the report.
    loaded = autopar.Plan.from_json(plan.to_json())
    assert loaded.pipeline == plan.pipeline
    assert loaded.summary() == plan.summary()   # the stages said, as when it was made
    assert layer_rows(loaded) == layer_rows(plan)
    assert f"Pipeline over `stage`: {stages} stages" in plan.report()
    assert "on every stage (one SPMD program" in plan.report()
    # the pipelined stack's time is the stacked layer's, not left unattributed
    rows = {r.name: r for r in layer_rows(plan)}
    assert rows["blocks"].compute_s >= plan.pipeline["predicted_time_s"]
    assert rows[OTHER].compute_s + rows[OTHER].comm_s < 0.05 * plan.estimate.step_time_s


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_head_splits_over_the_other_axes_at_realistic_width(schedule):
    """The scanned GPT at hidden 2048 with a 32768-word vocabulary on {stage: 4, data: 2},
    compiled from abstract arguments: the region's head and loss are planned over ``data``,
    and no matmul of the compiled program reads the whole vocabulary (each device computed
    the whole microbatch's logits before: f32[2048,32768] dots)."""
    config = gpt.Config(vocab=32768, seq=1024, hidden=2048, heads=16, layers=4, batch=16,
                        dtype=jax.numpy.bfloat16, scan_layers=True)
    tx = common.make_optimizer()
    _, args = gpt.make_train_step(config, abstract=True, tx=tx)
    step = _step(autopar.value_and_grad, gpt._loss_fn(config), tx)
    plan = autopar.plan(step, *args, mesh={"stage": 4, "data": 2}, hardware="h100",
                        pipeline=autopar.Pipeline(schedule=schedule, microbatches=8))
    post = plan.pipeline["post"]
    assert [s for s in post["inputs"] if s not in (None, "()")] == ["('data',)"]
    assert "the head and loss run in the region" in plan.report()
    dots = re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} dot\(", plan.compile().as_text())
    assert dots and not [d for d in dots if "32768" in d.split(",")]
    assert [d for d in dots if "16384" in d.split(",")]     # the head, split in two


@pytest.mark.parametrize("loss_fn, case, has_aux", [(_loss_with_aux, _aux_case, True),
                                                     (_masked_loss, _masked_case, False)],
                         ids=["has_aux", "batch_mask"])
def test_a_1f1b_plan_takes_auxiliary_outputs_and_values_made_from_the_batch(loss_fn, case,
                                                                            has_aux):
    """Planned end to end on (2, 2, 2): a loss with auxiliary outputs (an integer one among
    them), or layers reading a mask made from the batch, pipelines under 1F1B and the step
    computes what one device computes."""
    args = case() if has_aux else case()[0]

    def step(value_and_grad, *args):
        value, grads = value_and_grad(loss_fn, has_aux=has_aux)(*args)
        return jax.tree.map(lambda p, g: p - 0.1 * g, args[0], grads), value

    expected = jax.jit(lambda *a: step(jax.value_and_grad, *a))(*args)
    plan = autopar.plan(lambda *a: step(autopar.value_and_grad, *a), *args,
                        mesh={"stage": 2, "data": 2, "model": 2}, hardware="h100",
                        pipeline=autopar.Pipeline(axis="stage", microbatches=4))
    assert plan.pipeline["schedule"] == "1f1b"
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=2e-3, atol=2e-5),
                 plan.jit()(*args), expected)


def test_a_plan_balances_stages_its_layers_do_not_divide():
    """6 layers on 4 stages, the schedule and microbatches left to the stage search: the
    stages hold 2, 2, 1 and 1 layers, priced and stacked as 2 each. (The parameters' layer
    axis of 6 cannot be split 4 ways, so they stay where the plan puts them.)"""
    config = gpt.Config(scan_layers=True, layers=6)
    tx = common.make_optimizer()
    _, args = gpt.make_train_step(config, tx=tx)
    loss_fn = gpt._loss_fn(config)
    expected = jax.jit(_step(jax.value_and_grad, loss_fn, tx))(*args)
    plan = autopar.plan(_step(autopar.value_and_grad, loss_fn, tx), *args,
                        mesh={"stage": 4, "data": 2}, hardware="h100",
                        pipeline=autopar.Pipeline(axis="stage"), verbose=False)
    assert plan.pipeline["layer_ranges"] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    got = plan.jit()(*args)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=2e-3, atol=2e-5), got, expected)
    assert "4 stages (layers 0-1, 2-3, 4, 5)" in plan.report()
    checked = plan.validate()["pipeline"]
    assert checked["ticks"][0] == checked["ticks"][1]


def test_a_zb_h1_plan_says_why_its_measures_read_apart(case):
    """A tabled loop's compiled flops count each slot at its costliest branch, though a device
    runs one branch a slot; validate() says so beside the ratio, and only for tabled loops."""
    step, args, expected = case
    plan = autopar.plan(step, *args, mesh={"stage": 4, "data": 2}, hardware="h100",
                        pipeline=autopar.Pipeline(axis="stage", schedule="zb-h1"),
                        verbose=False)
    got = plan.jit()(*args)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=2e-3, atol=2e-5), got, expected)
    validated = plan.validate()
    notes = {name: note for name, _, _, _, note in autopar._validate.validation_rows(validated)}
    assert "costliest branch" in notes["flops"] and "copies" in notes["peak memory"]
    assert "costliest branch" in plan.report()
    assert autopar._validate._measure_notes({"schedule": "1f1b"}) == {}
    assert autopar._validate._measure_notes(None) == {}


def test_interleaved_plan_computes_the_single_device_step(case):
    step, args, expected = case
    plan = autopar.plan(step, *args, mesh={"stage": 2, "data": 2, "model": 2}, hardware="h100",
                        pipeline=autopar.Pipeline(schedule="interleaved", virtual_stages=2,
                                                  microbatches=2))
    assert plan.pipeline["virtual_stages"] == 2
    assert plan.pipeline["layer_ranges"] == [(0, 1), (1, 2), (2, 3), (3, 4)]   # chunk c
    assert plan.pipeline["ticks"] == 2 * 2 + 2 - 1
    got = plan.jit()(*args)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=2e-3, atol=2e-5), got, expected)
    assert "pipelined layers take" in plan.report()
    # the HTML report draws the schedule: one row per stage, a cell per busy slot
    page = render_html(plan)
    assert "<h2>Pipeline schedule</h2>" in page
    assert page.count("stage 0</text>") == page.count("stage 1</text>") == 1
    assert len(re.findall(r"<title>tick \d+: [FB]\d", page)) == 2 * (2 * 2 * 2)  # S (2 M v)


def test_without_a_pipeline_the_marked_step_plans_as_before(case):
    step, args, _ = case
    for pipeline in (None, "auto"):
        plan = autopar.plan(step, *args, mesh={"data": 8}, hardware="h100", pipeline=pipeline)
        assert plan.pipeline is None
        assert "Pipeline over" not in plan.report()
        # auto says why it tried no axis (one level of links, and the plan fits)
        assert ("no axis was tried" in plan.report()) == (pipeline == "auto")


@pytest.mark.parametrize("favoured", ["none", "node"])
def test_auto_keeps_the_candidate_whose_compiled_program_is_fastest(case, monkeypatch,
                                                                    favoured):
    """Across a slow axis, "auto" plans with and without stages over it, compiles both, and
    keeps the faster program by the simulated timeline, whatever the estimates say: here
    the simulated step is replaced by one that favours ``favoured``."""
    step, args, expected = case
    judged = []

    def simulated(compiled, profile, dtype):   # called in the search's order: none, node
        judged.append(("none", "node")[len(judged)])
        return 1.0 if judged[-1] == favoured else 2.0

    monkeypatch.setattr(autopar._api, "simulated_step_s", simulated)
    plan = autopar.plan(step, *args, mesh={"node": 2, "gpu": 4}, hardware="h100",
                        axis_level_overrides={"node": "infiniband"}, memory_budget="80GB")
    assert set(plan.stats["pipeline_search"]) == {"none", "node"}
    assert judged == ["none", "node"]   # each candidate compiled once
    compiled = plan.stats["pipeline_search_compiled"]
    assert compiled[favoured] == 1.0 and min(compiled, key=compiled.get) == favoured
    assert autopar.Plan.from_json(plan.to_json()).stats["pipeline_search_compiled"] == compiled
    assert (plan.pipeline is not None) == (favoured == "node")
    report = plan.report()
    label = "no pipeline" if favoured == "none" else "stages over node"
    assert "Pipeline search" in report
    assert re.search(rf"\* {label} +[\d.]+ \w+ +1\.000 s +[\d.]+ \w*B\n", report), report
    page = render_html(plan)
    assert "<h2>Pipeline search</h2>" in page and f'<tr class="chosen"><td class="l">{label}' in page
    got = plan.jit()(*args)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=2e-3, atol=2e-5), got, expected)


def test_auto_keeps_only_a_candidate_whose_compiled_program_fits(case, monkeypatch):
    """The faster program (pipelined over ``node``) peaks over the memory budget as
    compiled, so "auto" keeps the slower one that fits, whatever the estimates say."""
    step, args, _ = case
    order = []

    def simulated(compiled, profile, dtype):   # called in the search's order: none, node
        order.append(("none", "node")[len(order)])
        return 1.0 if order[-1] == "node" else 2.0

    def peak(compiled):
        return 2**40 if order[-1] == "node" else 2**20   # the pipelined program: 1 TiB

    monkeypatch.setattr(autopar._api, "simulated_step_s", simulated)
    monkeypatch.setattr(autopar._api, "program_peak_bytes", peak)
    plan = autopar.plan(step, *args, mesh={"node": 2, "gpu": 4}, hardware="h100",
                        axis_level_overrides={"node": "infiniband"}, memory_budget="80GB")
    assert plan.pipeline is None
    assert plan.stats["pipeline_search_compiled"] == {"none": 2.0, "node": 1.0}
    assert plan.stats["pipeline_search_compiled_peak_bytes"] == {"none": 2**20, "node": 2**40}
    assert "1.00 TiB" in plan.report() and "1.00 TiB" in render_html(plan)


def test_auto_drops_a_pipelined_candidate_xla_does_not_compile(case, monkeypatch):
    step, args, _ = case
    calls = []

    def simulated(compiled, profile, dtype):   # called in the search's order: none, node
        calls.append(compiled)
        if len(calls) == 2:
            raise jax.errors.JaxRuntimeError("INTERNAL: out of something\nmore")
        return 2.0

    monkeypatch.setattr(autopar._api, "simulated_step_s", simulated)
    plan = autopar.plan(step, *args, mesh={"node": 2, "gpu": 4}, hardware="h100",
                        axis_level_overrides={"node": "infiniband"}, memory_budget="80GB")
    assert plan.pipeline is None
    assert plan.stats["pipeline_search"]["node"] == ("does not compile: INTERNAL: out of "
                                                     "something")
    assert plan.stats["pipeline_search_compiled"] == {"none": 2.0}
    assert "stages over node" in plan.report() and "does not compile" in plan.report()


def test_a_pipeline_of_an_unmarked_step_says_which_line_to_change(case):
    _, args, _ = case
    tx = common.make_optimizer()
    step = _step(jax.value_and_grad, gpt._loss_fn(CONFIG), tx)
    with pytest.raises(PipelineError, match=r"autopar\.value_and_grad"):
        autopar.plan(step, *args, mesh={"stage": 4, "data": 2}, hardware="h100",
                     pipeline=autopar.Pipeline(axis="stage"))


def test_bad_pipeline_arguments_are_named(case):
    step, args, _ = case
    with pytest.raises(PipelineError, match="no such axis"):
        autopar.plan(step, *args, mesh={"data": 8}, hardware="h100",
                     pipeline=autopar.Pipeline(axis="stage"))
    with pytest.raises(ArgumentError, match="`pipeline` must be"):
        autopar.plan(step, *args, mesh={"data": 8}, hardware="h100", pipeline="gpipe")


def test_the_memory_chart_holds_the_pipeline_s_activations(case):
    """The report's memory over the program holds, while the pipeline region runs, the
    activations its stages keep (priced apart from the ILP's operations), within the
    estimate's peak; a donating plan's estimate keeps them too."""
    step, args, _ = case
    plan = autopar.plan(step, *args, mesh={"stage": 4, "data": 2}, hardware="h100",
                        pipeline=autopar.Pipeline(axis="stage", schedule="1f1b"), verbose=False)
    kept = plan.pipeline["activation_bytes"]
    assert kept > 0
    graph = plan._details[0]
    (region,) = [n.id for n in graph.nodes if n.prim == "shard_map"]
    held, live = memory_over_program(plan)
    assert live[region] >= kept
    assert held + max(live) <= plan.estimate.peak_memory_bytes
    donated = plan.with_donation((0, 1))
    held, live = memory_over_program(donated)
    assert live[region] >= kept and donated.estimate.peak_memory_bytes == held + max(live)


def test_a_pipelined_plan_is_taken_from_the_cache_on_a_restart(case, tmp_path, recwarn):
    """``parallelize(cache_dir=...)`` of a pipelined step: a second decorator (a restart) takes
    the stored plan (its stages are planned again, the outer choice is not) and computes what
    one device does; the stages' own plans do not read the outer plan's cached choice."""
    step, args, expected = case
    settings = autopar.Pipeline(schedule="1f1b", microbatches=4)
    runs = [autopar.parallelize(step, mesh={"stage": 4, "data": 2}, pipeline=settings,
                                cache_dir=tmp_path, verbose=False) for _ in range(2)]
    for run in runs:
        jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                             rtol=2e-3, atol=2e-5),
                     run(*args), expected)
    assert (runs[0].plans_made, runs[1].plans_made, runs[1].plans_loaded) == (1, 0, 1)
    assert runs[1].plan.pipeline["schedule"] == "1f1b"
    assert not [w for w in recwarn if issubclass(w.category, autopar.StalePlanCacheWarning)]


def test_to_python_of_a_pipelined_plan_says_plain_jit_runs_no_pipeline(case, tmp_path):
    step, args, _ = case
    plan = autopar.plan(step, *args, mesh={"stage": 4, "data": 2},
                        pipeline=autopar.Pipeline(schedule="1f1b", microbatches=4))
    text = plan.to_python(tmp_path / "specs.py")
    assert re.search(r"Plain jax.jit runs no pipeline: .*\n.*split over stage.*\n.*The plan in "
                     r"words:\n    blocks: pipeline stages over stage", text)
