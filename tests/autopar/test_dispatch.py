"""autopar.parallelize's call path (autopar/_dispatch.py): non-array leaves are static, as
``equinox.filter_jit`` treats them; a call with nothing changed goes straight to the one
compiled program; the first call says it is compiling."""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    """An Equinox-like module: arrays, a float, a bool and a callable as pytree leaves."""
    w: jax.Array
    rate: float
    use_act: bool
    act: Callable


def _loss(layer: Layer, x):
    h = x @ layer.w
    if layer.use_act:          # Python control flow on a static leaf
        h = layer.act(h)
    return jnp.mean(h ** 2) * layer.rate


def _args(rate=0.5):
    rng = np.random.default_rng(0)
    layer = Layer(w=rng.normal(size=(16, 32)).astype(np.float32), rate=rate, use_act=True,
                  act=jax.nn.relu)
    return layer, rng.normal(size=(16, 16)).astype(np.float32)


def test_float_bool_and_callable_leaves_are_static():
    step = autopar.parallelize(_loss, mesh={"data": 8}, verbose=False)
    layer, x = _args()
    np.testing.assert_allclose(step(layer, x), _loss(layer, x), rtol=1e-5)
    np.testing.assert_allclose(step(layer, x), _loss(layer, x), rtol=1e-5)
    assert step.plans_made == 1
    other = dataclasses.replace(layer, rate=0.25)  # a new static value: a new plan
    np.testing.assert_allclose(step(other, x), _loss(other, x), rtol=1e-5)
    assert step.plans_made == 2
    assert jax.tree.leaves(step.plan.in_shardings)[0].spec is not None  # arrays only
    assert len(jax.tree.leaves(step.plan.in_shardings)) == 2


def _update(params, moments, x):
    moments = jax.tree.map(lambda m, p: 0.9 * m + p, moments, params)
    params = jax.tree.map(lambda p, m: p - 0.01 * m, params, moments)
    return params, moments, jnp.sum(x)


def test_calls_fed_their_own_results_compile_once_and_new_shapes_replan(caplog, capsys):
    params = {f"w{i}": np.ones((8, 4), np.float32) * i for i in range(6)}
    moments = jax.tree.map(np.zeros_like, params)
    x = np.ones((8, 2), np.float32)
    step = autopar.parallelize(_update, mesh={"data": 8}, verbose=True, search=False)
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        state = (params, moments)
        for _ in range(3):
            *state, _ = step(*state, x)
    compiles = [r for r in caplog.records if r.getMessage().startswith("Compiling jit(")]
    assert len(compiles) == 1, [r.getMessage()[:80] for r in compiles]
    assert "compiling the planned program" in capsys.readouterr().err
    want = (params, moments)
    for _ in range(3):
        *want, _ = _update(*want, x)
    for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, expected, rtol=1e-5)
    wider = jax.tree.map(lambda a: np.ones((8, 8), np.float32), params)
    step(wider, wider, x)  # other shapes on the fast path's tree: planned again
    assert step.plans_made == 2


def _counted(params, count, x, i):
    params = jax.tree.map(lambda p: p - 0.01 * i * jnp.sum(x), params)
    return params, count + 1


def test_fresh_jax_arrays_and_python_ints_compile_once(caplog):
    """A train loop that passes a jax array made each step (a ``jnp`` batch), a counter that
    ``init`` returned uncommitted (optax's ``count``) and a Python int compiles its program
    once, through ``parallelize`` and through ``plan.jit()``: each such argument is placed as
    the first call placed it, which ``jax.jit`` would otherwise key apart."""
    params = {"w": np.ones((8, 4), np.float32)}
    rng = np.random.default_rng(0)
    batches = [jnp.asarray(rng.normal(size=(8, 2)), jnp.float32) for _ in range(3)]
    args0 = (params, jnp.zeros([], jnp.int32), batches[0], np.int32(0))
    runs = {"parallelize": autopar.parallelize(_counted, mesh={"data": 8}, verbose=False),
            "plan.jit": autopar.plan(_counted, *args0, mesh={"data": 8}).jit()}
    for name, run in runs.items():
        caplog.clear()
        with jax.log_compiles(True), caplog.at_level("WARNING"):
            state = args0[:2]
            for i, x in enumerate(batches):
                state = run(*state, x, i if name == "parallelize" else np.int32(i))
        compiles = [r for r in caplog.records if r.getMessage().startswith("Compiling jit(")]
        assert len(compiles) == 1, (name, [r.getMessage()[:80] for r in compiles])
        assert int(state[1]) == 3


def _decay(state):
    return {"w": jnp.tanh(state["w"] @ state["w"].T)[:, :8] * 0.5, "b": state["b"] + 1.0}


@pytest.mark.parametrize("fn, state", [
    (_decay, {"w": np.ones((16, 8), np.float32), "b": np.zeros((16,), np.float32)}),
    (lambda x: jnp.tanh(x @ x.T)[:, :8], np.ones((16, 8), np.float32)),
])
def test_a_step_that_returns_its_one_argument_keeps_its_sharding_and_compiles_once(
        caplog, fn, state):
    """``state = step(state)`` returns the state alone, at paths without the argument's
    ``[0]``: each result replaces its argument, so it keeps the argument's sharding and a host
    state fed back as jax arrays compiles once."""
    plan = autopar.plan(fn, state, mesh={"data": 8}, verbose=False)
    assert (jax.tree.leaves(plan.out_shardings) == jax.tree.leaves(plan.in_shardings))
    step = autopar.parallelize(fn, mesh={"data": 8}, verbose=False)
    want = state
    for _ in range(3):
        want = fn(want)
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        for _ in range(3):
            state = step(state)
    compiles = [r for r in caplog.records if r.getMessage().startswith("Compiling jit(")]
    assert len(compiles) == 1, [r.getMessage()[:80] for r in compiles]
    for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_a_float_that_changes_every_call_warns_on_the_third_plan():
    """A Python float is static: a scheduled learning rate plans each step again; the third
    plan of the same arrays says so, once, naming the leaf."""
    step = autopar.parallelize(lambda w, lr: w * lr, mesh={"data": 8}, verbose=False)
    w = np.ones((8, 4), np.float32)
    step(w, 0.1)
    step(w, 0.2)
    with pytest.warns(autopar.ReplanWarning, match=r"third time.*leaf 1: 0.2, now 0.3"):
        step(w, 0.3)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.ReplanWarning)
        step(w, 0.4)
    assert step.plans_made == 4
