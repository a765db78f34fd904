"""Axis names mean something (autopar/_axis_roles.py): the batch goes on `data` wherever plans
are equally fast, `batch_axes=` pins it, and a plan that splits it elsewhere says so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import autopar
from tests.autopar.export_target import mlp_args, mlp_train_step
from autopar._axis_roles import roles
from autopar.cost_model.spec import Spec


def _mesh(names):
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), names,
                axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.parametrize("names", [("data", "model"), ("model", "data")])
def test_equally_fast_plans_put_the_batch_on_data(names):
    step, args = mlp_train_step, mlp_args(batch=2048, d=256, h=1024)
    plan = autopar.plan(step, *args, mesh=_mesh(names), hardware="h100", verbose=False)
    specs = [s.spec for s in jax.tree.leaves(plan.in_shardings)]
    assert specs[2:] == [jax.sharding.PartitionSpec("data")] * 2, specs
    assert "model" in str(specs[0]) + str(specs[1]), specs  # the weights over `model`
    assert plan.stats["axis_roles"]["batch_split_over"] == ["data"]
    assert "note" not in plan.stats["axis_roles"]
    assert "axis names:" not in plan.summary()


def test_batch_axes_pins_the_batch_and_a_plan_against_the_names_says_so():
    step, args = mlp_train_step, mlp_args()  # the README's quickstart
    mesh = {"model": 2, "data": 4}  # tensor parallelism is cheaper over the larger axis
    free = autopar.plan(step, *args, mesh=mesh, hardware="h100", verbose=False)
    assert free.stats["axis_roles"]["batch_split_over"] == ["model"]
    assert "batch_axes=('data',)" in free.stats["axis_roles"]["note"]
    said = free.summary().splitlines()[-1]   # the plan in words, and so the report, says so
    assert said.startswith("axis names: the batch is split over model(2), instead of over "
                           "`data`"), said   # `data` splits no batch there
    pinned = autopar.plan(step, *args, mesh=mesh, hardware="h100", verbose=False,
                          batch_axes="data")
    specs = [s.spec for s in jax.tree.leaves(pinned.in_shardings)]
    assert specs[2:] == [jax.sharding.PartitionSpec("data")] * 2, specs
    assert pinned.stats["axis_roles"]["explicit"]
    assert pinned.estimate.step_time_s >= free.estimate.step_time_s
    _, want = jax.jit(step)(*args)
    np.testing.assert_allclose(pinned.jit()(*args)[1], want, rtol=2e-3)


def test_roles_from_names_and_a_bad_batch_axes():
    r = roles(("data", "model", "stage"))
    assert (r.batch, r.model, r.explicit) == (("data",), ("model",), False)
    assert r.penalty(Spec((("data",), ()))) == 0
    assert r.penalty(Spec((("model",), ()))) == 2  # model on the batch, data missing
    with pytest.raises(autopar.ArgumentError, match="`batch_axes`"):
        roles(("data", "model"), batch_axes="rows")


def test_batch_axes_keep_the_batch_through_the_layers():
    """At this width the GPT's blocks are faster with tensor parallelism over the smaller
    axis, `data`, and the batch over `model`; with batch_axes="data" they keep the batch on
    `data` (the forward matmuls' activations, not only the inputs), and pay for it."""
    from autopar.models import targets
    step, args = targets.gpt_realistic()
    mesh = {"data": 2, "model": 4}
    free = autopar.plan(step, *args, mesh=mesh, hardware="h100", verbose=False)
    assert free.summary().splitlines()[0] == (
        "block_0..block_1: Megatron TP over data(2), batch over model(4)")
    pinned = autopar.plan(step, *args, mesh=mesh, hardware="h100", verbose=False,
                          batch_axes="data")
    said = pinned.summary().splitlines()
    assert said[0] == "block_0..block_1: Megatron TP over model(4), batch over data(2)", said
    assert not any(line.startswith("axis names:") for line in said), said
    assert pinned.estimate.step_time_s > free.estimate.step_time_s


def test_layers_that_move_the_batch_off_its_axes_say_so(monkeypatch):
    """Inputs on the batch axes, layers' matmuls taking the batch over another axis: the
    plan in words ends naming them."""
    from autopar import _summary
    step, args = mlp_train_step, mlp_args()
    plan = autopar.plan(step, *args, mesh={"data": 2, "model": 4}, hardware="h100",
                        verbose=False, batch_axes="data")
    facts = {f"block_{i}": _summary.LayerFacts({}, ("model",), ()) for i in range(3)}
    monkeypatch.setattr(_summary, "layer_facts", lambda plan: facts)
    note = _summary._activation_note(plan, {"data": 2, "model": 4}, plan.stats["axis_roles"])
    assert note.startswith("block_0..block_2 take the batch split over model(4), not over "
                           "`data` as the batch_axes say"), note


def test_batch_axes_keep_the_batch_inside_scanned_layers():
    """In a scanned GPT (the weights reach the matmuls through the scan's slices), every
    forward matmul of an activation with a weight takes the batch split over `data` alone
    with batch_axes="data"; without it, some take it otherwise."""
    import dataclasses

    from autopar._axis_roles import activation_batch_dims
    from autopar._layers import weight_leaves
    from autopar.models import gpt
    config = dataclasses.replace(gpt.REALISTIC, vocab=16384, seq=512, hidden=1024, heads=16,
                                 layers=2, batch=16, scan_layers=True)
    step, args = gpt.make_train_step(config, abstract=True)

    def batch_splits(plan):
        graph, strats, choice, _ = plan._details
        weights = {graph.input_nodes[i] for i in weight_leaves(plan._in_tree)}
        found = activation_batch_dims(graph, weights)
        assert len(found) >= 4, found   # qkv, attn_out, mlp_in, mlp_out at least
        return {strats[n][choice[n]].in_specs[p].dims[d] for n, p, d in found}
    mesh = {"data": 2, "model": 4}
    free = autopar.plan(step, *args, mesh=mesh, hardware="h100", verbose=False)
    assert batch_splits(free) != {("data",)}
    pinned = autopar.plan(step, *args, mesh=mesh, hardware="h100", verbose=False,
                          batch_axes="data")
    assert batch_splits(pinned) == {("data",)}


def test_a_propagated_plan_s_note_says_it_was_propagated_not_predicted():
    step, args = mlp_train_step, mlp_args()
    plan = autopar.plan(step, *args, mesh={"data": 8}, search=False, verbose=False)
    assert plan.stats["axis_roles"]["note"].endswith(
        "or replicates, as the annotations propagate (search=False)")


def test_an_exportable_plan_s_note_says_it_was_exported_not_propagated():
    """exportable=True propagates the fastest compiled candidate's shardings, which the user
    did not ask for with search=False."""
    plan = autopar.plan(mlp_train_step, *mlp_args(abstract=True), mesh={"data": 2, "model": 4},
                        exportable=True, verbose=False)  # the quickstart's, on the cpu profile
    note = plan.stats["axis_roles"]["note"]
    assert "search=False" not in note and "(exportable=True)" in note, note


def test_batch_axes_keeps_a_small_mlp_data_parallel_and_the_stats_say_where_the_batch_went():
    """At 1e4 tie-break units a read, this step gathered its batch and replicated every
    matmul under ``batch_axes="data"``, while the stats said the batch was split over data."""
    rng = np.random.default_rng(0)
    p = {"w1": rng.normal(0, .1, (64, 256)).astype(np.float32),
         "w2": rng.normal(0, .1, (256, 64)).astype(np.float32)}
    x = rng.normal(size=(16, 64)).astype(np.float32)

    def step(p, x):
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"]) ** 2))(p)
        return jax.tree.map(lambda a, b: a - .1 * b, p, g), loss

    plan = autopar.plan(step, p, x, mesh={"data": 8}, batch_axes="data", hardware="h100",
                        verbose=False)
    text = plan.jit().lower(p, x).compile().as_text()
    assert "all-gather(" not in text and "f32[2,256]" in text   # each device: 2 examples
    assert plan.stats["axis_roles"]["batch_split_over"] == ["data"]
    gathered = autopar.plan(step, p, x, mesh={"data": 8}, hardware="h100", verbose=False,
                            in_shardings=(None, jax.sharding.PartitionSpec("data")))
    # unasked, the plan replicates this tiny step: its readers take the batch whole
    assert gathered.stats["axis_roles"]["batch_split_over"] == []
    assert "not split over `data` as the axis names say" in gathered.stats["axis_roles"]["note"]
