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
    assert said.startswith("axis names: the batch is split over model(2)"), said
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


def test_layers_that_move_the_batch_off_its_axes_say_so():
    """The inputs pinned on `data`, the GPT's blocks take the batch over `model` (tensor
    parallelism is cheaper over the smaller axis at this width): the plan in words says so."""
    from autopar.models import targets
    step, args = targets.gpt_realistic()
    plan = autopar.plan(step, *args, mesh={"data": 2, "model": 4}, hardware="h100",
                        verbose=False, batch_axes="data")
    assert plan.stats["axis_roles"]["batch_split_over"] == ["data"]   # the inputs keep it
    said = plan.summary().splitlines()
    assert any(line.startswith("block_0..block_1:") and "batch over model(4)" in line
               for line in said), said
    assert said[-1].startswith("axis names: block_0..block_1 take the batch split over model(4), "
                               "not over `data` as the batch_axes say"), said
