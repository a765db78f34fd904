"""Emission computes what the single-device function computes, for any plan.

Random programs over the regions and calls that trace handles (scan, while, cond, remat,
custom_jvp, nested jit, softmax and friends) are emitted with RANDOM strategy choices on 1-D,
2-D and 3-D meshes, so every pinning path runs with shardings that really split tensors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from autopar._mesh import axis_sizes
from autopar.passes.estimate import value_specs
from autopar.cost_model.hardware import axis_levels, get_profile
from autopar.passes.emit import build_flat_fn
from autopar.passes.strategies import MeshContext, build_strategies
from autopar.passes.trace import trace


def mlp_scan(w, x):
    def body(h, wi):
        return jnp.tanh(h @ wi), h.sum()
    h, sums = jax.lax.scan(body, x, jnp.stack([w, w * 0.5]))
    return h, sums


def remat_and_custom_jvp(w, x):
    f = jax.checkpoint(lambda a: jax.nn.gelu(a @ w) + jax.nn.relu(a))
    loss = lambda w_, x_: jax.nn.softmax(f(x_) @ w_.T).sum()  # noqa: E731
    return jax.value_and_grad(loss)(w, x)


def while_and_cond(w, x):
    def cond(c):
        return c[0] < 3

    def body(c):
        i, h = c
        return i + 1, jax.lax.cond(i % 2 == 0, lambda a: a @ w, lambda a: a * 2.0, h)
    _, h = jax.lax.while_loop(cond, body, (0, x))
    return jax.jit(lambda a: jax.nn.log_softmax(a, axis=-1))(h)


def train_like(w, x):
    def loss(w_):
        h = jax.nn.relu(x @ w_)
        return jnp.mean((h @ w_.T - x) ** 2)
    l, g = jax.value_and_grad(loss)(w)
    return w - 0.1 * g, l


@jax.custom_vjp
def clipped_square(x):
    return x * x


clipped_square.defvjp(lambda x: (x * x, x), lambda x, g: (jnp.clip(2 * x * g, -1.0, 1.0),))


def custom_vjp_program(w, x):
    return jax.value_and_grad(lambda w_: clipped_square(x @ w_).sum())(w)


PROGRAMS = {"custom_vjp": custom_vjp_program, "mlp_scan": mlp_scan, "remat_and_custom_jvp": remat_and_custom_jvp,
            "while_and_cond": while_and_cond, "train_like": train_like}


def _emit_random(fn, args, mesh, seed):
    traced = trace(fn, args)
    graph = traced.graph
    sizes = axis_sizes(mesh)
    profile = get_profile("cpu")
    ctx = MeshContext(tuple(sizes), sizes, axis_levels(mesh, profile), profile)
    strats, _ = build_strategies(graph, ctx)
    rng = np.random.default_rng(seed)
    choice = [int(rng.integers(len(s))) for s in strats]
    specs = value_specs(graph, strats, choice)
    operand = {n.id: strats[n.id][choice[n.id]].in_specs for n in graph.nodes}
    flat_fn = build_flat_fn(traced, specs, operand, mesh)
    in_sh = [NamedSharding(mesh, strats[n][choice[n]].out_specs[0].to_partition_spec())
             for n in graph.input_nodes]
    sharded = sum(bool(specs[v].axes) for v in specs)
    return jax.jit(flat_fn, in_shardings=in_sh), sharded


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("mesh_name", ["mesh_1d", "mesh_2d", "mesh_3d"])
def test_random_plans_match_single_device(name, mesh_name, request):
    mesh = request.getfixturevalue(mesh_name)
    fn = PROGRAMS[name]
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(16, 16)) / 4, jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    expected = jax.tree_util.tree_leaves(fn(w, x))
    for seed in range(3):
        run, sharded = _emit_random(fn, (w, x), mesh, seed)
        assert sharded > 0, "a random plan should split some values"
        got = run(w, x)
        for a, b in zip(got, expected):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)


def test_custom_vjp_survives_emission(mesh_2d):
    """Differentiating the planned program uses the custom backward rule (clipped)."""
    x = jnp.full((8, 16), 3.0)
    run, _ = _emit_random(clipped_square, (x,), mesh_2d, 2)
    g = jax.grad(lambda a: run(a)[0].sum())(x)
    np.testing.assert_array_equal(np.asarray(g), np.ones((8, 16)))


def test_custom_jvp_survives_emission(mesh_2d):
    """The planned program of a function holding a custom_jvp call stays differentiable with
    the custom rule (relu's derivative at 0 is 0 under its custom_jvp)."""
    fn = lambda x: jax.nn.relu(x)  # noqa: E731
    x = jnp.zeros((8, 16))
    run, _ = _emit_random(fn, (x,), mesh_2d, 1)
    g = jax.grad(lambda a: run(a)[0].sum())(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(jax.grad(lambda a: fn(a).sum())(x)))


def test_the_compiled_plan_keeps_the_programs_op_names(mesh_2d):
    """The planned program's ops are named as under the user's own jax.jit (function, module
    path, forward or backward), so profiles and HLO dumps read alike."""
    import re

    import autopar
    from autopar.models import gpt
    fn, args = gpt.make_train_step(gpt.TINY)
    plan = autopar.plan(fn, *args, mesh=mesh_2d, hardware="h100", verbose=False)
    names = set(re.findall(r'op_name="([^"]*)"', plan.compile().as_text()))
    assert "jit(train_step)/transpose(jvp(GPT))/block_0/qkv/dot_general" in names
    assert "jit(train_step)/jvp(GPT)/block_1/mlp_out/dot_general" in names
    # parallelize's program too (its shape check wraps the function)
    from autopar._dispatch import Program
    text = Program(plan, plan._flat_fn)._jitted.lower(*jax.tree.leaves(args)).as_text(
        debug_info=True)
    assert "jit(train_step)" in text and "jit(guarded)" not in text


def test_a_cast_back_to_f32_folds_as_under_plain_jit(mesh_1d):
    """A bf16 matmul's result read only by a cast to f32: the plan pins the cast, not the
    matmul's result, so XLA folds the round trip of converts (its f32 matmul's bf16 result,
    then the cast back) as it does in a data-parallel program with no constraints."""
    import re

    import autopar

    def step(x, w):
        y = jnp.dot(x, w).astype(jnp.float32)
        return jnp.mean(y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6))

    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128, 128), jnp.bfloat16)
    plan = autopar.plan(step, x, w, mesh=mesh_1d, hardware="h100", verbose=False,
                        in_shardings=(jax.sharding.PartitionSpec("data"), None))
    plain = jax.jit(step, in_shardings=plan.in_shardings, out_shardings=plan.out_shardings)

    def converts(compiled) -> int:
        return len(re.findall(r"= \w+\[[^\]]*\]\{?[^ ]* convert\(", compiled.as_text()))
    assert plan.in_shardings[0].spec == jax.sharding.PartitionSpec("data")
    assert converts(plan.compile()) == converts(plain.lower(x, w).compile())


def test_images_are_split_before_their_cast_to_a_convolutions_dtype(mesh_2d):
    """A cast read by a convolution is a kernel of its own (no fusion takes it in): where the
    convolution's batch is split over every axis, the plan splits the f32 images the same way
    before casting them, so no device casts more than its share."""
    import re

    import autopar
    from jax.sharding import PartitionSpec as P

    def step(images, kernel):
        return jax.lax.conv_general_dilated(
            images.astype(jnp.bfloat16), kernel, (1, 1), "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    images = jax.ShapeDtypeStruct((64, 32, 32, 3), jnp.float32)
    kernel = jax.ShapeDtypeStruct((3, 3, 3, 8), jnp.bfloat16)
    plan = autopar.plan(step, images, kernel, mesh=mesh_2d, hardware="h100", verbose=False,
                        in_shardings=(None, P()), out_shardings=P(("data", "model")))
    casts = re.findall(r"= bf16\[(\d+),32,32,3\]\{?[^ ]* convert\(", plan.compile().as_text())
    assert casts and all(int(n) == 64 // 8 for n in casts), casts
