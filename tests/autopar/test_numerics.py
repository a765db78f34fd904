"""Every plan computes what the single-device function computes: outputs and updated
parameters of each example model's train step, on the 1-D, 2-D and 3-D meshes. Each plan also
saves and reads back as it is (``_saved_and_read``)."""

import warnings

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autopar
from autopar.models import bert, convnet, gpt, llama_nnx, mlp, moe
from autopar.errors import SolverFallbackWarning

MODELS = {"mlp": mlp, "gpt": gpt, "bert": bert, "moe": moe, "llama_nnx": llama_nnx,
          "convnet": convnet}
MESHES = {"8": {"data": 8}, "4": {"data": 4}, "2x4": {"data": 2, "model": 4},
          "4x2": {"data": 4, "model": 2}, "2x2x2": {"data": 2, "model": 2, "expert": 2}}


def _check(fn, args, mesh, **kw):
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverFallbackWarning)
        plan = autopar.plan(fn, *args, mesh=mesh, hardware="h100", **kw)
    got = jax.tree_util.tree_leaves(plan.jit()(*args))
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)
    _saved_and_read(plan)
    return plan


def _saved_and_read(plan):
    """The plan read back from its JSON writes the same JSON, and its report is the made one's
    but for the planner's times (a plan of any model, mesh and solver ending saves whole)."""
    text = plan.to_json()
    loaded = autopar.Plan.from_json(text)
    assert loaded.to_json() == text

    def shown(p):
        return [line for line in p.report().splitlines()[1:] if not line.startswith("Planner")]
    assert shown(loaded) == shown(plan)


def _batch_hint(args, axis):
    """Shard every batch leaf's first dim over `axis`, leave the rest to autopar."""
    return (None,) * (len(args) - 1) + (jax.tree_util.tree_map(lambda _: P(axis), args[-1]),)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_on_2x4_mesh(name):
    fn, args = MODELS[name].make_train_step(MODELS[name].TINY)
    plan = _check(fn, args, MESHES["2x4"], in_shardings=_batch_hint(args, "data"))
    assert any(s.spec for s in jax.tree_util.tree_leaves(plan.in_shardings))


@pytest.mark.parametrize("mesh_name", ["8", "4", "4x2", "2x2x2"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_on_every_mesh(name, mesh_name):
    """The (2,4) mesh is covered above with the ILP solved to optimality; here the solver
    gets a short time limit, so best-incumbent and greedy plans are checked as well (every
    plan must be right, optimal or not)."""
    fn, args = MODELS[name].make_train_step(MODELS[name].TINY)
    mesh = MESHES[mesh_name]
    if mesh_name == "4":
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    _check(fn, args, mesh, in_shardings=_batch_hint(args, "data"), time_limit_s=2)


def test_moe_on_3d_mesh_unhinted():
    fn, args = moe.make_train_step(moe.TINY)
    _check(fn, args, MESHES["2x2x2"], time_limit_s=3)
