"""autopar.parallelize: static arguments, donation, flax TrainState and nnx state."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state
from jax.sharding import PartitionSpec

import autopar
from autopar.errors import ArgumentError
from autopar.cost_model.hlo import analyze
from autopar.models import gpt, llama_nnx

MESH = {"data": 2, "model": 4}


def _close(got, want):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)


def test_static_arguments_are_part_of_the_signature():
    calls = []

    @autopar.parallelize(mesh={"data": 8}, static_argnums=1, static_argnames="scale")
    def f(x, power, *, scale):
        calls.append(power)
        return jnp.sum(x ** power) * scale

    x = jnp.arange(32.0).reshape(8, 4)
    assert float(f(x, 2, scale=3.0)) == pytest.approx(float(jnp.sum(x ** 2) * 3.0))
    f(x, 2, scale=3.0)
    assert f.plans_made == 1
    assert float(f(x, 3, scale=1.0)) == pytest.approx(float(jnp.sum(x ** 3)))
    assert f.plans_made == 2
    with pytest.raises(ArgumentError, match="static_argnames"):
        f(x, 2, scale=3.0, other=1)
    with pytest.raises(ArgumentError, match="hashable"):
        f(x, [2], scale=3.0)


def test_a_static_argument_is_static_by_position_or_by_keyword():
    """As in jax.jit: static_argnums covers the parameter passed by keyword, and
    static_argnames the parameter passed by position."""
    x = jnp.arange(32.0).reshape(8, 4)

    def g(x, power, scale=1.0):
        return jnp.sum(x ** power) * scale

    by_num = autopar.parallelize(g, mesh={"data": 8}, static_argnums=(1,))
    by_name = autopar.parallelize(g, mesh={"data": 8}, static_argnames=("power",))
    for f in (by_num, by_name):
        assert float(f(x, power=2)) == pytest.approx(float(g(x, 2)))
        assert float(f(x, 2)) == pytest.approx(float(g(x, 2)))
        assert float(f(x, 3)) == pytest.approx(float(g(x, 3)))
        assert f.plans_made == 3   # power=2 by keyword and by position, power=3
        assert float(jax.jit(g, static_argnums=(1,))(x, power=2)) == float(f(x, power=2))


def test_an_array_passed_by_keyword_after_the_positional_ones_is_bound_by_position():
    """``step(w, x=x)`` and ``step(w, x)`` share one plan and compute what the function
    does; an array for a keyword-only parameter is refused with the fix."""
    def step(w, x, *, scale=1.0):
        return w - 0.1 * jnp.mean(jnp.tanh(x @ w)) * scale

    f = autopar.parallelize(step, mesh={"data": 8})
    w, x = jnp.eye(16), jnp.arange(128.0).reshape(8, 16) / 128
    np.testing.assert_allclose(f(w, x=x), step(w, x), rtol=1e-6)
    np.testing.assert_allclose(f(w, x), step(w, x), rtol=1e-6)
    np.testing.assert_allclose(f(w=w, x=x), step(w, x), rtol=1e-6)
    assert f.plans_made == 1
    with pytest.raises(ArgumentError, match=r"\['scale'\] .* pass arrays positionally"):
        f(w, x, scale=jnp.float32(2.0))


def test_donated_arguments_are_consumed():
    @autopar.parallelize(mesh={"data": 8}, donate_argnums=0)
    def update(w, g):
        return w - 0.1 * g

    w = jnp.ones((8, 16))
    g = jnp.full((8, 16), 2.0)
    out = update(w, g)
    np.testing.assert_allclose(np.asarray(out), 0.8)
    assert update.plan.donate_argnums == (0,) and "donated" in update.plan.report()
    # The plan counts the reused buffer, as the compiled program does.
    kept = autopar.plan(lambda w, g: w - 0.1 * g, w, g, mesh={"data": 8})
    assert kept.with_donation(()).estimate == kept.estimate
    assert update.plan.estimate.peak_memory_bytes < kept.estimate.peak_memory_bytes
    assert (analyze(update.plan.compile()).peak_memory_bytes
            < analyze(kept.compile()).peak_memory_bytes)
    w2 = jax.device_put(out, update.plan.in_shardings[0])  # already where the plan wants it
    update(w2, g)
    assert w2.is_deleted()  # its buffer was reused for the result
    with pytest.raises(ArgumentError, match="both static and donated"):
        autopar.parallelize(lambda a: a, mesh={"data": 8}, static_argnums=0, donate_argnums=0)


def test_hints_given_for_static_arguments_too_say_they_are_not_counted():
    step = autopar.parallelize(lambda x, w, n: (x @ w) * n, mesh={"data": 8}, static_argnums=2,
                               in_shardings=(PartitionSpec("data"), None, None))
    with pytest.raises(ArgumentError, match=r"`in_shardings` has 3 entries, one per argument, "
                       r"but hints the 2 non-static arguments only \(static argument 2 is not "
                       r"counted\): leave the static arguments' entries out"):
        step(jnp.ones((8, 4)), jnp.ones((4, 4)), 2)
    again = autopar.parallelize(lambda x, w, n: (x @ w) * n, mesh={"data": 8}, static_argnums=2,
                                in_shardings=(PartitionSpec("data"), None))
    np.testing.assert_allclose(again(jnp.ones((8, 4)), jnp.ones((4, 4)), 2), 8.0)


def test_only_arguments_not_yet_in_place_are_put_there(monkeypatch):
    """Each call puts on the planned shardings only what is not there yet: host arrays, and
    arrays placed otherwise. The previous step's results are passed as they are (putting a
    train state of 591 leaves again took 5 ms a step)."""
    fn, (params, opt_state, batch) = gpt.make_train_step(gpt.TINY)
    step = autopar.parallelize(fn, mesh=MESH)
    want = jax.jit(fn)(params, opt_state, batch)
    put = []
    real_put = jax.device_put

    def counting_put(x, *a, **k):
        put.append(len(jax.tree_util.tree_leaves(x)))
        return real_put(x, *a, **k)
    monkeypatch.setattr(jax, "device_put", counting_put)
    got = step(params, opt_state, batch)
    _close(got, want)
    assert put and sum(put) <= len(jax.tree_util.tree_leaves((params, opt_state, batch)))
    placed_batch = real_put(batch, step.plan.in_shardings[2])
    put.clear()
    again = step(got[0], got[1], placed_batch)
    assert put == [], "every argument was already where the plan wants it"
    _close(again, jax.jit(fn)(*want[:2], batch))
    one_device = real_put(batch, jax.devices()[3])
    put.clear()
    step(got[0], got[1], one_device)
    assert put == [len(jax.tree_util.tree_leaves(batch))]


class _Tiny(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(nn.relu(nn.Dense(32)(x)))


def _train_state(x):
    model = _Tiny()
    return train_state.TrainState.create(apply_fn=model.apply,
                                         params=model.init(jax.random.key(2), x),
                                         tx=optax.adamw(1e-2))


def test_flax_train_state(tmp_path):
    x = jax.random.normal(jax.random.key(0), (16, 12))
    y = jax.random.normal(jax.random.key(1), (16, 8))
    state = _train_state(x)

    def step(state, x, y):
        def loss_fn(params):
            return jnp.mean((state.apply_fn(params, x) - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    run = autopar.parallelize(step, mesh=MESH, donate_argnums=0, cache_dir=tmp_path)
    ref = state
    losses = []
    for _ in range(3):
        ref, ref_loss = jax.jit(step)(ref, x, y)
        state, loss = run(state, x, y)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-3)
        losses.append(float(loss))
    _close(state.params, ref.params)
    assert losses[-1] < losses[0] and run.plans_made == 1
    # A restart builds new optimizer functions (new objects): the cached plan still applies.
    again = autopar.parallelize(step, mesh=MESH, donate_argnums=0, cache_dir=tmp_path)
    again(_train_state(x), x, y)
    assert again.plans_loaded == 1 and again.plans_made == 0


def test_flax_nnx_split_state():
    step, (state, opt_state, batch) = llama_nnx.make_train_step(llama_nnx.TINY)
    run = autopar.parallelize(step, mesh=MESH)
    got = run(state, opt_state, batch)
    _close(got, jax.jit(step)(state, opt_state, batch))
    assert run.plans_made == 1


def _cached_step(cache_dir):
    def update(w, x):
        return w - 0.1 * (x.T @ jnp.tanh(x @ w))
    return autopar.parallelize(update, mesh=MESH, cache_dir=cache_dir)


def test_disk_cache_skips_the_solve_and_survives_corruption(tmp_path):
    from autopar._cache import _checksum
    from autopar.errors import StalePlanCacheWarning

    w, x = jnp.ones((16, 16)) * 0.1, jnp.arange(32 * 16.0).reshape(32, 16) / 100
    first = _cached_step(tmp_path)
    want = first(w, x)
    assert first.plans_made == 1 and first.plans_loaded == 0
    [entry] = list(tmp_path.glob("plan-*.json"))

    second = _cached_step(tmp_path)  # a restart: a new wrapper, the same folder
    np.testing.assert_allclose(np.asarray(second(w, x)), np.asarray(want), rtol=1e-6)
    assert second.plans_made == 0 and second.plans_loaded == 1
    assert second.plan.stats["solver_status"] == "cached"
    assert [s.spec for s in jax.tree_util.tree_leaves(second.plan.in_shardings)] == \
        [s.spec for s in jax.tree_util.tree_leaves(first.plan.in_shardings)]

    entry.write_text("{not json")
    third = _cached_step(tmp_path)
    with pytest.warns(StalePlanCacheWarning, match="corrupted"):
        np.testing.assert_allclose(np.asarray(third(w, x)), np.asarray(want), rtol=1e-6)
    assert third.plans_made == 1

    doc = json.loads(entry.read_text())  # rewritten by the third call
    doc["fingerprint"] = "0" * 64
    doc["checksum"] = _checksum(doc)  # a program change, not a corruption
    entry.write_text(json.dumps(doc))
    fourth = _cached_step(tmp_path)
    with pytest.warns(StalePlanCacheWarning, match="no longer matches"):
        fourth(w, x)
    assert fourth.plans_made == 1


def test_cache_key_ignores_object_addresses(tmp_path):
    """A TrainState's tree structure holds functions whose repr has a memory address that
    changes on every run: the key must not, or a restart never finds its plan."""
    from autopar._cache import PlanCache

    cache = PlanCache(tmp_path)

    def key(address):
        signature = f"PyTreeDef(TrainState(apply_fn=<bound method at {address}>))"
        return cache.key(_cached_step, MESH, "h100", signature, (), {})
    assert key("0x7f00aa") == key("0x7f11bb")
    assert cache.key(_cached_step, MESH, "h100", "a", (), {}) != \
        cache.key(_cached_step, MESH, "h100", "b", (), {})
    # two lambdas on one line share their source line, not their code
    first, second = (lambda w, x: x @ w), (lambda w, x: x @ w.T)  # noqa: E731
    assert cache.key(first, MESH, "h100", "a", (), {}) != \
        cache.key(second, MESH, "h100", "a", (), {})


def test_decorated_gpt_train_step_matches_one_device_and_restarts_from_the_cache(tmp_path):
    fn, (params, opt_state, batch) = gpt.make_train_step(gpt.TINY)
    hint = (None, None, jax.tree_util.tree_map(lambda _: jax.sharding.PartitionSpec("data"),
                                               batch))

    def decorated():
        return autopar.parallelize(mesh=MESH, in_shardings=hint, donate_argnums=(0, 1),
                                   cache_dir=tmp_path)(fn)

    step = decorated()
    # Donated arguments are consumed (their buffers may be the ones passed in): keep copies.
    first = jax.tree_util.tree_map(jnp.copy, (params, opt_state))
    ref, losses = jax.tree_util.tree_map(jnp.copy, first), []
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, batch)
        *ref, ref_loss = jax.jit(fn)(*ref, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-3)
        losses.append(float(loss))
    _close((params, opt_state), ref)
    assert losses[2] < losses[1] < losses[0]
    assert step.plans_made == 1 and step.plan.donate_argnums == (0, 1)

    restarted = decorated()  # a new process would build the same wrapper
    *_, loss = restarted(*first, batch)
    assert restarted.plans_made == 0 and restarted.plans_loaded == 1
    assert restarted.plan.stats["solver_status"] == "cached"
    np.testing.assert_allclose(float(loss), losses[0], rtol=1e-6)
    assert [s.spec for s in jax.tree_util.tree_leaves(restarted.plan.in_shardings)] == \
        [s.spec for s in jax.tree_util.tree_leaves(step.plan.in_shardings)]


def test_donation_prices_the_partial_sums_the_estimate_prices():
    """``with_donation`` recomputes the peak over the same buffers as the estimate: the
    partial result a split contraction holds while it is reduced counts there too."""
    x, w = jnp.ones((64, 512)), jnp.ones((512, 256))
    plan = autopar.plan(lambda x, w: x @ w, x, w, mesh={"data": 2, "model": 4},
                        in_shardings=(PartitionSpec(None, "model"),
                                      PartitionSpec("model", None)))
    assert plan.estimate.comm_bytes > 0  # the partial sums are reduced
    assert plan.with_donation(()).estimate == plan.estimate


def test_typed_prng_keys_plan_run_and_round_trip(tmp_path):
    """jax.random.key arrays (an extended dtype numpy cannot read) as arguments and results,
    one and batched, through plan, parallelize and a saved plan."""
    def step(key, keys, x):
        k1, k2 = jax.random.split(key)
        noise = jax.vmap(lambda k, r: jax.random.uniform(k, r.shape))(keys, x)
        return x * jax.random.normal(k1, x.shape) + noise, k2

    args = (jax.random.key(3), jax.random.split(jax.random.key(4), 8), np.ones((8, 16), np.float32))
    want = jax.jit(step)(*args)
    plan = autopar.plan(step, *args, mesh={"data": 8})
    for got in (plan.jit()(*args), autopar.parallelize(step, mesh={"data": 8})(*args)):
        _close(got[0], want[0])
        assert got[1].dtype == want[1].dtype
        np.testing.assert_array_equal(jax.random.key_data(got[1]), jax.random.key_data(want[1]))
    plan.save(tmp_path / "plan.json")
    loaded = autopar.Plan.load(tmp_path / "plan.json")
    assert list(loaded.in_shardings) == jax.tree.leaves(plan.in_shardings)  # loaded flat
