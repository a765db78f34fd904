"""The user's sharding annotations are honored and propagated: hints, search=False (plain
GSPMD), flax linen logical partitioning and nnx sharding metadata, and bad annotations."""

import dataclasses
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar import baselines
from autopar._mesh import as_auto_mesh
from autopar._compare import measure
from autopar.errors import ShardingConflictWarning, ShardingHintError
from autopar.cost_model.hardware import get_profile
from autopar.cost_model.hlo import analyze
from autopar.models import gpt, llama_nnx
from autopar.models.workloads import abstract_train_step

MESH = {"data": 2, "model": 4}


def _compiled_in_shardings(plan) -> list:
    return list(jax.tree_util.tree_leaves(plan.compile().input_shardings[0]))


def _assert_kept(plan, hints_per_leaf, avals):
    """Every given hint is the compiled program's input sharding of that leaf, exactly."""
    compiled = _compiled_in_shardings(plan)
    checked = 0
    for path, hint, got, aval in zip(plan.in_paths, hints_per_leaf, compiled, avals):
        if hint is None:
            continue
        want = NamedSharding(plan.mesh, hint)
        assert got.is_equivalent_to(want, len(aval.shape)), (path, got, hint)
        checked += 1
    assert checked


def _assert_same_numerics(plan, fn, args):
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    got = jax.tree_util.tree_leaves(plan.jit()(*args))
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)


def _collectives(summary):
    return sorted((c.kind.value, c.group_size, c.trip_count, c.wire_bytes)
                  for c in summary.collectives)


# ----- hints and search=False

def test_megatron_weight_hints_alone_compile_like_the_hand_written_jit():
    """Megatron column/row specs on the GPT kernels only (biases, optimizer state, batch left
    None), planned with search=False: propagation finds the rest, and XLA compiles the same
    collectives (kind, group, count, bytes) as jax.jit with the full Megatron shardings."""
    cfg = dataclasses.replace(gpt.REALISTIC, vocab=2048, seq=256, hidden=512, heads=8,
                              layers=2, batch=8)
    fn, args = gpt.make_train_step(cfg, abstract=True)
    mesh = as_auto_mesh(MESH)
    full = baselines.baseline_shardings("megatron", args, mesh, batch_axes=())
    kernels = jax.tree_util.tree_map_with_path(
        lambda path, spec: spec if baselines.leaf_names(path)[-1] == "kernel" else None, full[0])
    assert any(s for s in jax.tree_util.tree_leaves(kernels))
    plan = autopar.plan(fn, *args, mesh=mesh, hardware="h100", in_shardings=(kernels, None, None),
                        search=False)
    assert plan.stats["solver_status"] == "propagated"
    ours = analyze(plan.compile())
    ins, outs = baselines.baseline_io_shardings(fn, args, mesh, "megatron", batch_axes=())
    hand = analyze(jax.jit(fn, in_shardings=ins, out_shardings=outs).lower(*args).compile())
    assert ours.by_kind() == hand.by_kind()
    assert _collectives(ours) == _collectives(hand)
    # and the unhinted biases and optimizer state took the Megatron shardings by propagation
    for ours_s, hand_s, leaf in zip(jax.tree_util.tree_leaves(plan.in_shardings),
                                    jax.tree_util.tree_leaves(ins), jax.tree_util.tree_leaves(args)):
        assert ours_s.is_equivalent_to(hand_s, len(leaf.shape))


@pytest.mark.parametrize("search", [True, False])
def test_batch_hint_is_kept_and_numerics_match(search):
    """One compile: its input shardings are the hints, and it computes what one device does."""
    fn, args = gpt.make_train_step(gpt.TINY)
    hint = (None, None, jax.tree_util.tree_map(lambda _: P("data"), args[-1]))
    plan = autopar.plan(fn, *args, mesh=MESH, hardware="h100", in_shardings=hint, search=search)
    compiled = plan.jit().lower(*args).compile()
    leaves = jax.tree_util.tree_leaves(args)
    for leaf, got in zip(leaves[-2:], compiled.input_shardings[0][-2:]):  # tokens, targets
        assert got.is_equivalent_to(NamedSharding(plan.mesh, P("data")), leaf.ndim), got
    got = compiled(*jax.device_put(leaves, list(compiled.input_shardings[0])))
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)


def test_search_is_never_worse_than_propagation_alone():
    """Realistic shapes, compiled only: with the batch hinted over `data`, the ILP's plan is
    no slower by the reference step time than plain propagation with the same hint."""
    fn, args = abstract_train_step("gpt")
    hint = (None, None, jax.tree_util.tree_map(lambda _: P("data"), args[-1]))
    h100 = get_profile("h100")
    times = {}
    for search in (True, False):
        plan = autopar.plan(fn, *args, mesh=MESH, hardware=h100, in_shardings=hint,
                            search=search)
        times[search] = measure(str(search), plan.compile(), h100, jnp.bfloat16).step_time_s
    assert times[True] <= times[False], times


def test_with_sharding_constraint_in_the_program_propagates_with_search_false():
    """A constraint on an activation is kept and spreads to the inputs and the result."""
    mesh = as_auto_mesh(MESH)

    def fn(w, x):
        h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w), NamedSharding(mesh, P("data")))
        return h * 2.0

    w, x = jnp.ones((16, 32)), jnp.ones((8, 16))
    plan = autopar.plan(fn, w, x, mesh=mesh, hardware="h100", search=False)
    assert [s.spec for s in jax.tree_util.tree_leaves(plan.in_shardings)] == [P(), P("data")]
    assert jax.tree_util.tree_leaves(plan.out_shardings)[0].spec == P("data")
    _assert_same_numerics(plan, fn, (w, x))


def test_already_sharded_arguments_plan_as_plain_ones():
    """A train step called on sharded arrays (a restored checkpoint, the previous step's
    outputs) traces with a ``reshard`` of the gradient seed: it is planned with no warning, to
    a plan as fast as that of the same step on plain arrays (of equally fast plans, the ILP's
    tie breaks may take another one, so the arrays are put where it wants them)."""
    fn, args = gpt.make_train_step(gpt.TINY)
    plain = autopar.plan(fn, *args, mesh=MESH, hardware="h100")
    placed = jax.device_put(args, plain.in_shardings)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = autopar.plan(fn, *placed, mesh=MESH, hardware="h100")
    assert again.estimate.step_time_s == pytest.approx(plain.estimate.step_time_s)
    _assert_same_numerics(again, fn, jax.device_put(placed, again.in_shardings))


def test_parallelize_forwards_hints_and_search():
    def fn(w, x):
        return jnp.tanh(x @ w).sum()
    w, x = jnp.ones((16, 32)) / 16, jnp.arange(128.0).reshape(8, 16) / 128
    step = autopar.parallelize(fn, mesh=MESH, hardware="h100", in_shardings=(None, P("data")),
                               search=False)
    out = step(w, x)
    assert step.plan.stats["solver_status"] == "propagated"
    assert step.plan.stats["source"] == "propagated"
    assert jax.tree_util.tree_leaves(step.plan.in_shardings)[-1].spec == P("data")
    np.testing.assert_allclose(np.asarray(out), np.asarray(fn(w, x)), rtol=2e-3)


# ----- flax metadata

RULES = [("batch", "data"), ("mlp", "model"), ("embed", None)]


class _LogicalMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
                     bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)))(x)
        h = nn.with_logical_constraint(nn.relu(h), ("batch", "mlp"))
        return nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")),
                        use_bias=False)(h)


def _linen_step():
    model = _LogicalMLP()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), jnp.float32)
    params = model.init(jax.random.key(0), x)["params"]

    def step(params, x):
        def loss(p):
            return jnp.mean(model.apply({"params": p}, x) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), value
    return step, params, x


def _flax_specs(params, rules):
    """What flax itself makes of the metadata, per leaf."""
    return [nn.logical_to_mesh_axes(b.names, rules) for b in jax.tree_util.tree_leaves(
        params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))]


def test_linen_logical_partitioning_with_rules_is_honored():
    step, params, x = _linen_step()
    assert isinstance(params["Dense_0"]["kernel"], nn.LogicallyPartitioned)
    plan = autopar.plan(step, params, x, mesh=MESH, hardware="h100", logical_axis_rules=RULES)
    want = _flax_specs(params, RULES)
    assert P(None, "model") in want
    _assert_kept(plan, want + [None], jax.tree_util.tree_leaves((params, x)))
    _assert_same_numerics(plan, step, (params, x))  # the boxed params run as they are
    # nn.with_logical_constraint on the activation became a constraint, split as the rules say
    graph, strats, choice, _ = plan._details
    acts = [n for n in graph.nodes
            if n.prim == "sharding_constraint" and graph.values[n.outs[0]].shape == (8, 64)]
    assert acts
    assert {str(strats[n.id][choice[n.id]].out_specs[0]) for n in acts} == {"S(data)S(model)"}


def test_explicit_hint_wins_over_metadata_and_warns():
    step, params, x = _linen_step()
    explicit = jax.tree_util.tree_map(lambda _: None, nn.unbox(params))
    explicit["Dense_0"]["kernel"] = P("model", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(step, params, x, mesh=MESH, hardware="h100",
                            logical_axis_rules=RULES, in_shardings=(explicit, None))
    messages = [str(w.message) for w in caught if w.category is ShardingConflictWarning]
    # the hint against the metadata, and (inside the model, where flax constrains the unboxed
    # kernel by the rules) the hint against that constraint
    assert any(re.search(r"in_shardings\[0\]\['Dense_0'\]\['kernel'\].*disagrees with "
                         r"nn.with_logical_partitioning\('embed', 'mlp'\)", m) for m in messages)
    assert any(re.search(r"in_shardings\[0\]\['Dense_0'\]\['kernel'\].* wants P\('model'\); "
                         r"with_sharding_constraint at .*Dense_0 wants P\(None, 'model'\)", m)
               for m in messages), messages
    first = jax.tree_util.tree_leaves(plan.in_shardings)
    assert first[plan.in_paths.index("[0]['Dense_0']['kernel'].value")].spec == P("model")


def test_parallelize_forwards_logical_axis_rules():
    step, params, x = _linen_step()
    run = autopar.parallelize(step, mesh=MESH, hardware="h100", logical_axis_rules=RULES,
                              search=False)
    new_params, _ = run(params, x)
    assert isinstance(new_params["Dense_0"]["kernel"], nn.LogicallyPartitioned)
    kernel = new_params["Dense_0"]["kernel"].value
    assert kernel.sharding.is_equivalent_to(NamedSharding(run.plan.mesh, P(None, "model")), 2)


def test_nnx_sharding_metadata_is_honored():
    fn, args = llama_nnx.make_train_step(dataclasses.replace(llama_nnx.TINY, annotate=True))
    want = jax.tree_util.tree_leaves(nnx.get_partition_spec(args[0]),
                                     is_leaf=lambda x: isinstance(x, P))
    assert P(None, "model") in want and P("model", None) in want
    plan = autopar.plan(fn, *args, mesh=MESH, hardware="h100")
    n_rest = len(jax.tree_util.tree_leaves(args[1:]))
    _assert_kept(plan, want + [None] * n_rest, jax.tree_util.tree_leaves(args))
    _assert_same_numerics(plan, fn, args)


def test_nnx_logical_names_go_through_the_rules():
    class Lin(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((16, 32)), sharding=("embed", "mlp"),
                               eager_sharding=False)

    state = nnx.split(Lin())[1]
    graphdef = nnx.split(Lin())[0]
    x = jnp.ones((8, 16))

    def fn(state, x):
        return jnp.tanh(x @ nnx.merge(graphdef, state).w.value)
    plan = autopar.plan(fn, state, x, mesh=MESH, hardware="h100", logical_axis_rules=RULES)
    assert jax.tree_util.tree_leaves(plan.in_shardings)[0].spec == P(None, "model")
    _assert_same_numerics(plan, fn, (state, x))


# ----- bad annotations

def _fn(p, x):
    return jnp.tanh(x @ p["w"]).sum() + p["b"].sum()


ARGS = ({"w": jnp.ones((16, 20)), "b": jnp.ones(24)}, jnp.ones((8, 16)))


@pytest.mark.parametrize("hints, match", [
    (({"w": P()}, None), (r"at `in_shardings\[0\]`: the hint is a dict with keys \['w'\] "
                          r"where the argument is a dict with keys \['b', 'w'\]")),
    (({"w": [None], "b": None}, None), r"at `in_shardings\[0\]\['w'\]`: the hint is a list"),
    (({"w": P("expert"), "b": None}, None), (r"in_shardings\[0\]\['w'\]` names mesh axis "
                                             r"`expert`, which the mesh lacks")),
    (({"w": P(None, "data"), "b": None}, None), (r"in_shardings\[0\]\['w'\]` splits dim 1 "
                                                 r"of size 20 over 8 devices.*pad dim 1 to 24")),
])
def test_bad_hints_name_the_leaf(hints, match):
    with pytest.raises(ShardingHintError, match=match):
        autopar.plan(_fn, *ARGS, mesh={"data": 8}, in_shardings=hints)


def test_a_list_argument_takes_a_list_of_hints():
    def chain(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x.sum()

    ws, x = [jnp.ones((16, 16)), jnp.ones((16, 16))], jnp.ones((8, 16))
    plan = autopar.plan(chain, ws, x, mesh={"data": 8}, hardware="h100",
                        in_shardings=([P(), P(None, "data")], P("data")))
    assert [s.spec for s in jax.tree_util.tree_leaves(plan.in_shardings)] == [
        P(), P(None, "data"), P("data")]


def _boxed(names, rules=None, cols=24):
    box = nn.LogicallyPartitioned(jnp.ones((16, cols)), names, rules=rules)
    return ({"w": box, "b": jnp.ones(24)}, jnp.ones((8, 16)))


def _boxed_fn(p, x):
    return _fn(nn.unbox(p), x)


def test_logical_rule_to_an_axis_the_mesh_lacks_names_the_leaf():
    with pytest.raises(ShardingHintError, match=r"nn.with_logical_partitioning\('embed', 'mlp'\)"
                       r".* on args\[0\]\['w'\].*names mesh axis `tensor`"):
        autopar.plan(_boxed_fn, *_boxed(("embed", "mlp")), mesh=MESH,
                     logical_axis_rules=[("mlp", "tensor")])


def test_logical_names_that_do_not_fit_name_the_leaf():
    with pytest.raises(ShardingHintError, match=r"args\[0\]\['w'\]` cannot be read"):
        autopar.plan(_boxed_fn, *_boxed(("mlp", "mlp")), mesh=MESH, logical_axis_rules=RULES)
    with pytest.raises(ShardingHintError, match=r"args\[0\]\['w'\].*splits dim 1 of size 20 "
                       r"over 8 devices.*pad dim 1 to 24"):
        autopar.plan(_boxed_fn, *_boxed(("embed", "mlp"), cols=20), mesh={"data": 1, "model": 8},
                     logical_axis_rules=RULES)


def test_unknown_logical_name_is_replicated_as_in_flax():
    """A logical name no rule maps stays unsharded (flax's nn.logical_to_mesh_axes)."""
    args = _boxed(("vocab", "mlp"))
    assert nn.logical_to_mesh_axes(("vocab", "mlp"), RULES) == P(None, "model")
    plan = autopar.plan(_boxed_fn, *args, mesh=MESH, hardware="h100",
                        logical_axis_rules=RULES, search=False)
    assert jax.tree_util.tree_leaves(plan.in_shardings)[1].spec == P(None, "model")


def test_logical_metadata_without_rules_warns_and_is_not_a_hint():
    with pytest.warns(autopar.UnusedAnnotationWarning, match="no logical_axis_rules") as record:
        plan = autopar.plan(_boxed_fn, *_boxed(("embed", "mlp")), mesh=MESH, hardware="h100",
                            search=False)
    assert {w.filename for w in record} == {__file__}  # the user's line, not autopar's
    assert not any(s.spec for s in jax.tree_util.tree_leaves(plan.in_shardings))


def test_no_conflict_warning_for_agreeing_annotations():
    step, params, x = _linen_step()
    explicit = jax.tree_util.tree_map(lambda _: None, nn.unbox(params))
    explicit["Dense_0"]["kernel"] = P(None, "model")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingConflictWarning)
        autopar.plan(step, params, x, mesh=MESH, hardware="h100", logical_axis_rules=RULES,
                     in_shardings=(explicit, None), search=False)
