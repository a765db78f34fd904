"""The example models (autopar.models) and the hand-written baselines (autopar.baselines)."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from autopar.models import bert, convnet, gpt, llama_nnx, mlp, moe

MODELS = {
    "mlp": mlp,
    "gpt": gpt,
    "bert": bert,
    "moe": moe,
    "llama_nnx": llama_nnx,
    "convnet": convnet,
}

from autopar import baselines
from autopar import errors

Baseline = baselines.Baseline


def _leaf_names(path):
    return baselines.leaf_names(path)


def _find(tree, *suffix):
    """The leaf of ``tree`` whose key path ends with ``suffix``."""
    hits = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if _leaf_names(path)[-len(suffix):] == suffix
    ]
    assert len(hits) == 1, (suffix, len(hits))
    return hits[0]


def _assert_close(actual, expected, rtol=2e-3, atol=1e-5):
    a_flat, a_tree = jax.tree_util.tree_flatten_with_path(actual)
    e_flat, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree
    for (path, a), e in zip(a_flat, e_flat):
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol, atol=atol,
            err_msg=jax.tree_util.keystr(path),
        )


#: Test-only XLA options: skip LLVM optimisation (SPMD partitioning still runs), which roughly
#: halves CPU compile time; results agree with the default compile to within rounding.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


class _Cache:
    """One concrete train step per model, built, compiled and run on one device once."""

    def __init__(self):
        self._entries = {}

    def get(self, name):
        if name not in self._entries:
            step, args = MODELS[name].make_train_step(MODELS[name].TINY)
            compiled = jax.jit(step).lower(*args).compile(compiler_options=FAST_COMPILE)
            first = compiled(*args)
            self._entries[name] = (step, args, compiled, first)
        return self._entries[name]


def _run_baseline(step, args, mesh, kind, **kw):
    """Compile ``step`` under a baseline and run it on ``args`` placed per the baseline."""
    compiled = (
        baselines.jit_baseline(step, args, mesh, kind, **kw)
        .lower(*args)
        .compile(compiler_options=FAST_COMPILE)
    )
    placed = jax.device_put(args, baselines.baseline_named_shardings(kind, args, mesh, fn=step,
                                                                     **kw))
    return compiled(*placed), baselines.baseline_shardings(kind, args, mesh, fn=step, **kw)


@pytest.fixture(scope="module")
def cache():
    return _Cache()


# ----------------------------------------------------------------------------- models


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_train_step_runs_and_learns(cache, name):
    _, args, jitted, (params, opt_state, loss) = cache.get(name)
    assert loss.shape == () and np.isfinite(float(loss))
    assert jax.tree.structure(params) == jax.tree.structure(args[0])
    assert jax.tree.structure(opt_state) == jax.tree.structure(args[1])
    _, _, loss2 = jitted(params, opt_state, args[2])
    if name == "convnet":  # the train step replaces the BatchNorm running statistics
        before = jax.tree.leaves(args[0]["batch_stats"])
        after = jax.tree.leaves(params["batch_stats"])
        assert any(not np.allclose(a, b) for a, b in zip(after, before))
    assert np.isfinite(float(loss2))
    assert float(loss2) < float(loss), (name, float(loss), float(loss2))


@pytest.mark.parametrize("name", list(MODELS))
def test_abstract_args_match_concrete(cache, name):
    _, args, _, _ = cache.get(name)
    step, abstract = MODELS[name].make_train_step(MODELS[name].TINY, abstract=True)
    leaves = jax.tree.leaves(abstract)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert jax.tree.structure(abstract) == jax.tree.structure(args)
    for a, c in zip(leaves, jax.tree.leaves(args)):
        assert a.shape == c.shape and a.dtype == c.dtype
    # The abstract step traces (nothing computed) and returns params/opt_state-shaped results.
    out = jax.eval_shape(step, *abstract)
    assert jax.tree.structure(out[:2]) == jax.tree.structure(abstract[:2])
    assert out[2].shape == ()


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_is_scalar_loss(name):
    fn, args = MODELS[name].make_forward(MODELS[name].TINY, abstract=True)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(args))
    out = jax.eval_shape(fn, *args)
    assert out.shape == () and out.dtype == jnp.float32


@pytest.mark.parametrize("name", ["gpt", "bert", "moe", "llama_nnx"])
def test_realistic_configs_are_abstract_and_bf16(name):
    module = MODELS[name]
    _, args = module.make_train_step(module.REALISTIC, abstract=True)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(args))
    assert module.REALISTIC.dtype == jnp.bfloat16
    # MaxText-style precision: float32 parameters, bf16 compute.
    assert {x.dtype for x in jax.tree.leaves(args[0])} == {jnp.dtype(jnp.float32)}


def test_gpt_param_names_and_scan_layers():
    _, (params, _, batch) = gpt.make_train_step(gpt.TINY, abstract=True)
    c = gpt.TINY
    assert set(params) == {"embed", "pos_embed", "block_0", "block_1", "ln_f"}
    assert set(params["block_0"]) == {"ln_1", "qkv", "attn_out", "ln_2", "mlp_in", "mlp_out"}
    assert params["block_0"]["qkv"]["kernel"].shape == (c.hidden, 3 * c.hidden)
    assert params["embed"]["embedding"].shape == (c.vocab, c.hidden)
    assert batch["tokens"].dtype == jnp.int32
    _, (scan_params, _, _) = gpt.make_train_step(gpt.TINY_SCAN, abstract=True)
    assert scan_params["blocks"]["qkv"]["kernel"].shape == (c.layers, c.hidden, 3 * c.hidden)


def test_moe_param_names():
    _, (params, _, _) = moe.make_train_step(moe.TINY, abstract=True)
    c = moe.TINY
    layer = params["block_0"]["moe"]
    assert layer["experts_in"].shape == (c.experts, c.hidden, c.ffn)
    assert layer["experts_out"].shape == (c.experts, c.ffn, c.hidden)
    assert layer["router"]["kernel"].shape == (c.hidden, c.experts)
    prims = _primitives(*moe.make_train_step(moe.TINY, abstract=True))
    assert {"top_k", "cumsum", "dot_general"} <= prims


def test_llama_annotate_puts_sharding_metadata():
    from flax import nnx

    config = dataclasses.replace(llama_nnx.TINY, annotate=True)
    _, (state, _, _) = llama_nnx.make_train_step(config, abstract=True)
    specs = nnx.get_partition_spec(state)
    assert _find(specs, "layers", 0, "attn", "q", "kernel") == P(None, "model")
    assert _find(specs, "layers", 0, "mlp", "down", "kernel") == P("model", None)
    assert _find(specs, "embed", "embedding") == P("model", None)
    _, (plain, _, _) = llama_nnx.make_train_step(llama_nnx.TINY, abstract=True)
    assert _find(plain, "layers", 1, "attn", "k", "kernel").shape == (64, 32)  # 2 kv heads


def _primitives(step, args):
    from autopar.models.common import primitives_of

    return primitives_of(step, *args)


# ----------------------------------------------------------------------------- baselines


def test_megatron_specs_on_gpt(mesh_2d):
    _, args = gpt.make_train_step(gpt.TINY, abstract=True)
    params, opt_state, batch = baselines.baseline_shardings(Baseline.MEGATRON, args, mesh_2d)
    assert params["block_0"]["qkv"]["kernel"] == P(None, "model")
    assert params["block_0"]["qkv"]["bias"] == P("model")
    assert params["block_0"]["mlp_in"]["kernel"] == P(None, "model")
    assert params["block_0"]["attn_out"]["kernel"] == P("model", None)
    assert params["block_1"]["mlp_out"]["kernel"] == P("model", None)
    assert params["block_1"]["mlp_out"]["bias"] == P()
    assert params["embed"]["embedding"] == P()
    assert params["ln_f"]["scale"] == P()
    assert batch["tokens"] == P("data", None)
    # Optimizer state mirrors the params.
    assert _find(opt_state, "mu", "block_1", "qkv", "kernel") == P(None, "model")
    assert _find(opt_state, "nu", "block_0", "attn_out", "kernel") == P("model", None)
    assert _find(opt_state, "count") == P()

    vocab = baselines.baseline_shardings("megatron_vocab", args, mesh_2d)
    assert vocab[0]["embed"]["embedding"] == P("model", None)
    assert vocab[0]["pos_embed"]["embedding"] == P()
    assert _find(vocab[1], "mu", "embed", "embedding") == P("model", None)


def test_megatron_specs_scan_layers_and_nnx(mesh_2d):
    _, args = gpt.make_train_step(gpt.TINY_SCAN, abstract=True)
    params = baselines.baseline_shardings("megatron", args, mesh_2d)[0]
    assert params["blocks"]["qkv"]["kernel"] == P(None, None, "model")
    assert params["blocks"]["attn_out"]["kernel"] == P(None, "model", None)

    _, args = llama_nnx.make_train_step(llama_nnx.TINY, abstract=True)
    state, opt_state, _ = baselines.baseline_shardings("megatron_vocab", args, mesh_2d)
    assert _find(state, "layers", 0, "attn", "k", "kernel") == P(None, "model")
    assert _find(state, "layers", 0, "attn", "o", "kernel") == P("model", None)
    assert _find(state, "layers", 1, "mlp", "down", "kernel") == P("model", None)
    assert _find(state, "norm", "scale") == P()
    assert _find(state, "lm_head", "kernel") == P(None, "model")
    assert _find(opt_state, "mu", "layers", 1, "mlp", "gate", "kernel") == P(None, "model")


def test_dp_fsdp_expert_specs(mesh_2d, mesh_3d):
    _, args = gpt.make_train_step(gpt.TINY, abstract=True)
    dp = baselines.baseline_shardings("dp", args, mesh_2d)
    assert all(s == P() for s in jax.tree.leaves(dp[:2]))
    assert dp[2]["targets"] == P("data", None)
    joint = baselines.baseline_shardings("dp", args, mesh_2d, batch_axes=("data", "model"))
    assert joint[2]["tokens"] == P(("data", "model"), None)

    fsdp = baselines.baseline_shardings(Baseline.FSDP, args, mesh_2d)
    assert fsdp[0]["block_0"]["mlp_in"]["kernel"] == P(None, "data")  # [64, 256]: largest dim
    assert fsdp[0]["embed"]["embedding"] == P("data", None)  # [128, 64]
    assert _find(fsdp[1], "mu", "block_0", "mlp_in", "kernel") == P(None, "data")
    assert _find(fsdp[1], "count") == P()

    _, margs = moe.make_train_step(moe.TINY, abstract=True)
    ep = baselines.baseline_shardings("expert", margs, mesh_3d, expert_axis="expert")
    assert ep[0]["block_0"]["moe"]["experts_in"] == P("expert", None, None)
    assert ep[0]["block_0"]["moe"]["experts_out"] == P("expert", None, None)
    assert ep[0]["block_0"]["moe"]["router"]["kernel"] == P()
    assert _find(ep[1], "nu", "block_0", "moe", "experts_out") == P("expert", None, None)
    default = baselines.baseline_shardings("expert", margs, mesh_2d)  # expert_axis=model_axis
    assert default[0]["block_0"]["moe"]["experts_in"] == P("model", None, None)
    assert default[2]["tokens"] == P("data", None)
    mt = baselines.baseline_shardings("megatron", margs, mesh_3d)
    assert mt[0]["block_0"]["moe"]["experts_in"] == P(None, None, "model")
    assert mt[0]["block_0"]["moe"]["experts_out"] == P(None, "model", None)


def test_undivisible_dims_stay_unsharded(make_mesh):
    mesh = make_mesh((8,), ("data",))
    args = ({"qkv": {"kernel": jax.ShapeDtypeStruct((12, 20), jnp.float32)}},
            {"x": jax.ShapeDtypeStruct((6, 4), jnp.float32)})
    specs = baselines.baseline_shardings("fsdp", args, mesh)
    assert specs[0]["qkv"]["kernel"] == P() and specs[1]["x"] == P()


def test_megatron_on_1d_mesh_has_no_data_parallel(mesh_1d):
    _, args = gpt.make_train_step(gpt.TINY, abstract=True)
    params, _, batch = baselines.baseline_shardings("megatron", args, mesh_1d, model_axis="data")
    assert params["block_0"]["qkv"]["kernel"] == P(None, "data")
    assert batch["tokens"] == P()


def test_baseline_errors(mesh_1d, mesh_2d):
    _, args = gpt.make_train_step(gpt.TINY, abstract=True)
    with pytest.raises(errors.ArgumentError, match="'zero'.*'dp'.*'megatron'"):
        baselines.baseline_shardings("zero", args, mesh_2d)
    with pytest.raises(errors.ArgumentError, match="'model'.*'data'"):
        baselines.baseline_shardings("megatron", args, mesh_1d)
    with pytest.raises(errors.ArgumentError, match="'batch'"):
        baselines.baseline_shardings("dp", args, mesh_2d, batch_axes=("batch",))
    with pytest.raises(errors.ArgumentError, match="'expert'"):
        baselines.baseline_shardings("expert", args, mesh_2d, expert_axis="expert")
    assert issubclass(errors.ArgumentError, errors.AutoparError)


@pytest.mark.parametrize("kind", list(Baseline))
def test_gpt_baselines_compile_and_match_single_device(cache, mesh_2d, kind):
    step, args, _, expected = cache.get("gpt")
    out, specs = _run_baseline(step, args, mesh_2d, kind)
    _assert_close(out, expected)
    # Outputs that mirror inputs keep their sharding; the loss is replicated.
    assert out[0]["block_0"]["qkv"]["kernel"].sharding.spec == specs[0]["block_0"]["qkv"]["kernel"]
    assert out[2].sharding.is_fully_replicated


def test_expert_baseline_on_moe(cache, mesh_3d):
    step, args, _, expected = cache.get("moe")
    out, _ = _run_baseline(step, args, mesh_3d, "expert", expert_axis="expert")
    _assert_close(out, expected)
    assert out[0]["block_0"]["moe"]["experts_in"].sharding.spec == P("expert", None, None)
    assert out[1][0].mu["block_0"]["moe"]["experts_out"].sharding.spec == P("expert", None, None)


def test_megatron_baseline_on_llama_nnx(cache, mesh_2d):
    step, args, _, expected = cache.get("llama_nnx")
    out, _ = _run_baseline(step, args, mesh_2d, "megatron")
    _assert_close(out, expected)
    assert _find(out[0], "layers", 0, "attn", "q", "kernel").sharding.spec == P(None, "model")


def test_realistic_gpt_configs_compile_with_data_parallel(mesh_2d):
    for config in (gpt.REALISTIC, gpt.REALISTIC_SCAN):
        start = time.perf_counter()
        step, args = gpt.make_train_step(config, abstract=True)
        lowered = baselines.jit_baseline(step, args, mesh_2d, "dp").lower(*args)
        assert lowered.compile(compiler_options=FAST_COMPILE) is not None
        # A few seconds on an idle 2-core machine; the bound only catches blow-ups.
        assert time.perf_counter() - start < 60, config
