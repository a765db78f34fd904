"""The plan in words (plan.summary()) and the layers the report finds in a parameter tree."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from tests.autopar.export_target import mlp_args, mlp_train_step
from autopar._layers import LOSS, OTHER, input_layers, layer_rows
from autopar._summary import DimRole, LayerFacts, describe

SIZES = {"data": 2, "model": 4}


def _names(args) -> dict[str, str | None]:
    leaves, tree = jax.tree_util.tree_flatten(args)
    names, _ = input_layers(tree, [np.shape(x) for x in leaves])
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    return dict(zip(paths, names))


_A = np.zeros((4, 4))
_BLOCK = {"attn": {"kernel": _A}, "mlp": {"kernel": _A},
          "LayerNorm_0": {"scale": np.zeros(4)}, "LayerNorm_1": {"scale": np.zeros(4)}}


@pytest.mark.parametrize("params, optimizer_state, expected", [
    # flax lm1b: blocks nested under params['decoder']; the optimizer state follows
    ({"params": {"decoder": {"embed": {"embedding": np.zeros((16, 4))},
                             "encoderdecoderblock_0": _BLOCK, "encoderdecoderblock_1": _BLOCK,
                             "encoderdecoder_norm": {"scale": np.zeros(4)}}}},
     True,
     {"[0]['params']['decoder']['encoderdecoderblock_1']['attn']['kernel']":
          "encoderdecoderblock_1",
      "[0]['params']['decoder']['embed']['embedding']": "embed",
      "[1]['mu']['params']['decoder']['encoderdecoderblock_0']['mlp']['kernel']":
          "encoderdecoderblock_0"}),
    # an encoder and a decoder, each with numbered blocks: opened into them
    ({"encoder": {"block_0": _BLOCK, "block_1": _BLOCK, "norm": {"scale": np.zeros(4)}},
      "decoder": {"block_0": _BLOCK, "block_1": _BLOCK}, "shared": np.zeros((16, 4))},
     False,
     {"[0]['encoder']['block_1']['attn']['kernel']": "encoder/block_1",
      "[0]['decoder']['block_0']['mlp']['kernel']": "decoder/block_0",
      "[0]['encoder']['norm']['scale']": "encoder/norm", "[0]['shared']": "shared"}),
    # a list of layers (nnx, Equinox, keras)
    ({"embed": {"e": _A}, "layers": [_BLOCK, _BLOCK]}, False,
     {"[0]['layers'][1]['attn']['kernel']": "layers[1]", "[0]['embed']['e']": "embed"}),
    # haiku's flat module names
    ({"lm/~/embed": {"embeddings": _A}, "lm/~/block_0/~/mlp": {"w": _A},
      "lm/~/block_1/~/mlp": {"w": _A}}, False,
     {"[0]['lm/~/block_1/~/mlp']['w']": "block_1", "[0]['lm/~/embed']['embeddings']": "embed"}),
])
def test_layers_at_any_depth(params, optimizer_state, expected):
    args = (params, {"mu": params}, np.zeros(3)) if optimizer_state else (params, np.zeros(3))
    names = _names(args)
    for path, name in expected.items():
        assert names[path] == name, path
    assert names[f"[{len(args) - 1}]"] is None   # the batch is in no layer


def test_train_state_layers_are_its_params():
    state = {"params": {"block_0": _BLOCK, "block_1": _BLOCK},
             "opt_state": ({"mu": {"block_0": _BLOCK, "block_1": _BLOCK}},), "step": np.zeros(())}
    names = _names((state, np.zeros(3)))
    assert names["[0]['params']['block_1']['mlp']['kernel']"] == "block_1"
    assert names["[0]['opt_state'][0]['mu']['block_0']['attn']['kernel']"] == "block_0"
    assert names["[0]['step']"] is None


_C, _R, _E, _V, _O = (DimRole.COLUMN, DimRole.ROW, DimRole.EXPERT, DimRole.VOCAB,
                      DimRole.OTHER)


@pytest.mark.parametrize("roles, batch, expected", [
    ({"model": {_C, _R, _O}}, ("data",), "Megatron TP over model(4), batch over data(2)"),
    ({"data": {_C, _R}}, ("data",), "FSDP over data(2)"),
    ({"model": {_C}}, (), "column-parallel over model(4)"),
    ({"model": {_E, _C}}, ("data",), "expert-parallel over model(4), batch over data(2)"),
    ({"model": {_V}}, (), "vocab-parallel over model(4)"),
    ({}, ("data", "model"), "batch over data(2) x model(4)"),
    ({}, (), "replicated"),
])
def test_describe(roles, batch, expected):
    facts = LayerFacts({a: frozenset(r) for a, r in roles.items()}, batch, ())
    assert describe(facts, SIZES) == expected


def test_summary_says_megatron_and_batch():
    step, args = mlp_train_step, mlp_args(abstract=True)
    plan = autopar.plan(step, *args, mesh=SIZES, hardware="h100")
    assert plan.summary().splitlines()[:2] == [
        "w1: column-parallel over model(4), batch over data(2)",
        "w2: row-parallel over model(4), batch over data(2)"]
    assert plan.report().split("\n\n")[1].startswith("The plan in words:\n  w1: column-parallel")


@pytest.mark.parametrize("mesh", [{"data": 8, "model": 1}, {"data": 1, "model": 8}])
def test_an_axis_of_size_1_splits_nothing_in_the_words(mesh):
    """Specs may name a size-1 axis; the words leave it out (it was "column-parallel over
    model(1)", "batch over data(1) x model(8)")."""
    plan = autopar.plan(mlp_train_step, *mlp_args(abstract=True), mesh=mesh, hardware="h100")
    text = plan.summary()
    assert "(1)" not in text and "(8)" in text, text


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(nn.relu(nn.Dense(4 * x.shape[-1])(x)))


class _Decoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = _Block(name=f"encoderdecoderblock_{i}")(x)
        return nn.Dense(8, name="logitdense")(x)


class _NestedLM(nn.Module):   # lm1b's layout: params['decoder']['encoderdecoderblock_N']
    @nn.compact
    def __call__(self, x):
        return _Decoder(name="decoder")(x)


def test_nested_blocks_get_their_own_rows():
    model, tx = _NestedLM(), optax.adam(1e-3)
    x = jnp.ones((16, 32))
    params = model.init(jax.random.key(0), x)

    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss
    plan = autopar.plan(step, params, tx.init(params), x, mesh=SIZES, hardware="h100")
    rows = {r.name: r for r in layer_rows(plan)}
    assert set(rows) == {"encoderdecoderblock_0", "encoderdecoderblock_1", "logitdense", LOSS,
                         OTHER}
    assert len(rows["encoderdecoderblock_0"].params) == 4
    blocks = rows["encoderdecoderblock_0"].compute_s + rows["encoderdecoderblock_1"].compute_s
    assert blocks > 2 * rows[OTHER].compute_s
    assert plan.summary().startswith("encoderdecoderblock_0..encoderdecoderblock_1: ")


def test_describe_names_pipeline_stages():
    facts = LayerFacts({"stage": frozenset({_O, _C}), "model": frozenset({_C, _R})}, ("data",), ())
    assert describe(facts, {"stage": 4, "data": 2, "model": 2}, stage_axis="stage") == (
        "pipeline stages over stage(4), Megatron TP over model(2), batch over data(2)")


class _EmbedLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(4096, 256, name="embed")(tokens)
        for i in range(2):
            x = _Block(name=f"block_{i}")(x)
        return nn.Dense(8, name="head")(x)


def test_an_embedding_s_gradient_is_its_own_layer_s():
    """The embedding's gradient (a scatter-add of the first block's input cotangent) and the
    sum of its partial results over the batch axis belong to the embedding, not to the block
    whose cotangent it reads."""
    model, tx = _EmbedLM(), optax.adam(1e-3)
    tokens = jax.ShapeDtypeStruct((64, 128), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean(model.apply(p, tokens) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss
    plan = autopar.plan(step, params, jax.eval_shape(tx.init, params), tokens, mesh={"data": 8},
                        hardware="h100", batch_axes="data")
    rows = {r.name: r for r in layer_rows(plan)}
    assert plan.in_shardings[2].spec[0] == "data"   # the batch is split: partial sums
    assert "optimizer state: replicated, as its parameters" in plan.summary()
    table = 4096 * 256 * 4
    assert rows["embed"].collectives == 1 and rows["embed"].comm_bytes >= table
    assert rows["block_0"].comm_bytes == rows["block_1"].comm_bytes
    assert "backward of embed: partial sums of scatter-add" in plan.report()


class _Boxed(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.Dense(1024, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
                     name="up")(x)
        return nn.Dense(256, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")),
                        name="down")(nn.relu(x))


def test_logically_partitioned_parameters_are_said_as_plain_ones():
    """flax's boxed parameters reach their matmuls through the sharding constraint their
    unboxing applies: the words see through it (they read 'parameters split over' before)."""
    model, tx = _Boxed(), optax.adamw(1e-3)
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    boxed = jax.eval_shape(model.init, jax.random.key(0), x)["params"]

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    plan = autopar.plan(step, boxed, jax.eval_shape(tx.init, boxed), x, x, mesh=SIZES,
                        logical_axis_rules=[("batch", "data"), ("mlp", "model"),
                                            ("embed", None)])
    assert plan.summary().splitlines()[:2] == [
        "down: row-parallel over model(4), batch over data(2)",
        "up: column-parallel over model(4), batch over data(2)"]


def test_only_inputs_of_the_batch_s_size_lead_with_the_batch():
    """The batch's size is the leading size most later arguments share, the larger on a tie:
    two seeds split beside a batch of 16 are not called a batch."""
    from jax.sharding import PartitionSpec as P

    def step(params, opt_state, seeds, x):   # Adam's moments are in the layers, not counted
        grads = jax.grad(lambda p: jnp.sum(x @ p["w"]) + jnp.sum(seeds))(params)
        updates, opt_state = optax.adam(1e-3).update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    params = {"w": jnp.ones((4, 4))}
    plan = autopar.plan(step, params, optax.adam(1e-3).init(params), jnp.ones((2,)),
                        jnp.ones((16, 4)), mesh={"data": 2, "model": 4}, verbose=False,
                        in_shardings=(None, None, P("data"), P("data")))
    line = next(x for x in plan.summary().splitlines() if x.startswith("inputs:"))
    assert "[2] dim 0 over data(2)" in line and "[3] batch over data(2)" in line, line


def test_inputs_outside_the_layers_call_the_state_s_leading_dim_dim_0_and_group_long_lists():
    from jax.sharding import PartitionSpec as P

    from autopar._summary import _paths_text

    def step(state, x):   # flax variables: parameters, and statistics of no layer
        stats = {k: v + jnp.mean(x) for k, v in state["stats"].items()}
        return {"params": state["params"], "stats": stats}, jnp.sum(x @ state["params"]["w"])

    stats = {f"s{i}": jnp.ones((8,)) for i in range(6)}
    state = {"params": {"w": jnp.ones((4, 4))}, "stats": stats}
    plan = autopar.plan(step, state, jnp.ones((8, 4)), mesh={"data": 8}, verbose=False,
                        in_shardings=({"params": None, "stats": {k: P("data") for k in stats}},
                                      P("data")))
    line = next(x for x in plan.summary().splitlines() if x.startswith("inputs:"))
    assert "[0]['stats'] (6 arrays) dim 0 over data(8)" in line, line
    assert "[1] batch over data(8)" in line, line
    assert _paths_text(["[0]['a']", "[1]['b']", "[2]", "[3]", "[4]"]) == (
        "[0]['a'], [1]['b'], [2] and 2 more")
