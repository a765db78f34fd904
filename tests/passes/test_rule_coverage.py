"""Every primitive the example models (autopar.models) emit on this jax has a sharding rule:
none is planned replicated by the fallback (jax 0.12 brought ``unstack`` and
``one_minus_square``; CI runs this on jax 0.10 and 0.12)."""

import dataclasses

import pytest

from autopar._mesh import as_auto_mesh, axis_sizes
from autopar.cost_model.hardware import axis_levels, get_profile
from autopar.models import MODEL_NAMES, bert, convnet, gpt, llama_nnx, mlp, moe
from autopar.passes.strategies import MeshContext, build_strategies
from autopar.passes.trace import trace

MODULES = {"mlp": mlp, "gpt": gpt, "bert": bert, "moe": moe, "llama_nnx": llama_nnx,
           "convnet": convnet}
CASES = [(name, scan) for name in MODEL_NAMES
         for scan in ((False, True) if hasattr(MODULES[name].TINY, "scan_layers") else (False,))]


def _mesh_context() -> MeshContext:
    mesh = as_auto_mesh({"data": 2, "model": 4})
    sizes = axis_sizes(mesh)
    profile = get_profile("h100")
    return MeshContext(tuple(mesh.axis_names), sizes, axis_levels(mesh, profile, None), profile)


def test_the_cases_cover_every_example_model():
    assert {name for name, _ in CASES} == set(MODEL_NAMES) == set(MODULES)


@pytest.mark.parametrize("name,scan", CASES)
def test_every_primitive_of_an_example_train_step_has_a_rule(name, scan):
    module = MODULES[name]
    config = dataclasses.replace(module.TINY, scan_layers=True) if scan else module.TINY
    fn, args = module.make_train_step(config, abstract=True)
    _, fallbacks = build_strategies(trace(fn, args).graph, _mesh_context())
    assert not fallbacks, f"no sharding rule for {sorted(fallbacks)}"


def test_a_scan_that_splits_its_rngs_has_every_rule():
    """``nn.scan(split_rngs={"dropout": True})`` clones the key (``random_clone``)."""
    import jax
    import jax.numpy as jnp

    def step(key, x):
        keys = jax.random.split(jax.random.clone(key), 4)
        h, _ = jax.lax.scan(lambda h, k: (h * jax.random.uniform(k, h.shape), None), x, keys)
        return jnp.sum(h)

    args = (jax.random.key(0), jax.ShapeDtypeStruct((8, 4), jnp.float32))
    _, fallbacks = build_strategies(trace(step, args).graph, _mesh_context())
    assert not fallbacks, f"no sharding rule for {sorted(fallbacks)}"
