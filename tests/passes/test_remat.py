"""The remat pass: a rematerialized train step computes the same thing, recomputes in the
backward pass instead of keeping activations, and XLA's compiled program holds less."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from autopar._compat import scan_counts
from autopar.cost_model.hlo import analyze
from autopar.passes.liveness import consumers, last_uses, materialized, memory_timeline
from autopar.models import gpt, llama_nnx
from autopar.passes.emit import compiler_options
from autopar.passes.remat import RematPolicy, remat_layers, rematerialize, residual_bytes
from autopar.cost_model.spec import Spec
from autopar.passes.trace import trace

#: Activations dominate: a 4-layer GPT at batch 32, sequence 256, hidden 256.
WIDE = dataclasses.replace(gpt.TINY, batch=32, seq=256, hidden=256, heads=4, layers=4,
                           vocab=1024)


def _run(traced, args):
    return jax.jit(jcore.jaxpr_as_fun(traced.closed_jaxpr))(*jax.tree_util.tree_leaves(args))


def test_layers_are_the_parameters_top_level_modules():
    fn, args = gpt.make_train_step(gpt.TINY, abstract=True)
    assert [k for k in remat_layers(trace(fn, args)) if k.startswith("block")] == [
        "block_0", "block_1"]
    fn, args = llama_nnx.make_train_step(llama_nnx.TINY, abstract=True)
    names = list(remat_layers(trace(fn, args)))
    assert {"layers[0]", "layers[1]"} <= set(names), names


@pytest.mark.parametrize("policy", list(RematPolicy))
def test_rematerialized_step_matches_the_original(policy):
    fn, args = gpt.make_train_step(gpt.TINY)
    traced = trace(fn, args)
    layers = list(remat_layers(traced))
    remat = rematerialize(traced, layers, policy)
    jcore.check_jaxpr(remat.closed_jaxpr.jaxpr)
    barriers = [e for e in remat.closed_jaxpr.jaxpr.eqns
                if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == len(residual_bytes(traced, policy)) >= 2
    assert len(remat.closed_jaxpr.jaxpr.eqns) > len(traced.closed_jaxpr.jaxpr.eqns)
    for got, want in zip(_run(remat, args), _run(traced, args)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _replicated(graph):
    specs = {v.id: Spec.replicated(v.rank) for v in graph.values}
    return specs, {n.id: tuple(None if v is None else specs[v] for v in n.ins)
                   for n in graph.nodes}


def test_compiled_program_holds_less_and_recomputes():
    """On one device, compiled from ShapeDtypeStruct arguments: keeping fewer activations
    lowers XLA's temporaries (nothing_saveable below dots_saveable below none) and recomputes
    (more flops). The memory model orders the three the same way, each within 25% (measured:
    1329 / 616 / 296 MiB compiled against 1080 / 616 / 360 MiB predicted; what XLA:CPU keeps
    that the model does not is in ``cost_model/memory.py``)."""
    fn, args = gpt.make_train_step(WIDE, abstract=True)
    traced = trace(fn, args)
    blocks = [k for k in remat_layers(traced) if k.startswith("block")]
    temps, flops, predicted = {}, {}, {}
    for policy in (None, RematPolicy.DOTS, RematPolicy.NOTHING):
        t = traced if policy is None else rematerialize(traced, blocks, policy)
        options = compiler_options(t.graph, "cpu")
        assert bool(options) == (policy is not None)
        compiled = (jax.jit(jcore.jaxpr_as_fun(t.closed_jaxpr), compiler_options=options or None)
                    .lower(*jax.tree_util.tree_leaves(args)).compile())
        truth = analyze(compiled)
        specs, operand = _replicated(t.graph)
        _, live = memory_timeline(t.graph, specs, {}, results_held=True, operand_specs=operand)
        temps[policy], flops[policy], predicted[policy] = truth.temp_bytes, truth.flops, max(live)
        assert predicted[policy] == pytest.approx(temps[policy], rel=0.25), policy
    assert temps[RematPolicy.NOTHING] < 0.6 * temps[RematPolicy.DOTS]
    assert temps[RematPolicy.DOTS] < 0.6 * temps[None]
    assert flops[RematPolicy.NOTHING] > 1.1 * flops[None]
    assert predicted[RematPolicy.NOTHING] < predicted[RematPolicy.DOTS] < predicted[None]


def test_barriers_alias_their_operands_in_the_memory_model():
    """A value passed through an optimization barrier is one buffer: the barrier's result is
    not a new one, and the operand's buffer lives until the result is last read."""
    fn, args = gpt.make_train_step(gpt.TINY, abstract=True)
    graph = rematerialize(trace(fn, args), ["block_0"], RematPolicy.NOTHING).graph
    barriers = [n for n in graph.nodes if n.prim == "optimization_barrier"]
    assert barriers
    users = consumers(graph)
    last = last_uses(graph, users)
    for node in barriers:
        assert materialized(graph, node, users) == []
        for vin, vout in zip(node.ins, node.outs):
            if vout in users:  # the barrier's tie to the backward pass has no reader
                assert last[vin] >= max(u.id for u in users[vout]) > node.id


#: A stack of layers under ``nn.scan``: one layer to the remat pass, named ``blocks``.
SCANNED = dataclasses.replace(gpt.TINY, layers=3, scan_layers=True)


def _scans(traced):
    return [e for e in traced.closed_jaxpr.jaxpr.eqns if e.primitive.name == "scan"]


def _stacks_read_backward(traced) -> int:
    """Bytes of the forward scan's stacked results that the backward scan reads."""
    forward, backward = _scans(traced)
    ys = set(forward.outvars[scan_counts(forward.params)[1]:])
    return sum(a.aval.size * a.aval.dtype.itemsize for a in set(backward.invars) & ys)


@pytest.mark.parametrize("policy", list(RematPolicy))
def test_rematerialized_scan_matches_the_original(policy):
    """The scan pair is rewritten: the backward scan reads fewer stacked bytes of the forward
    one, by what ``residual_bytes`` says, and the step computes the same."""
    fn, args = gpt.make_train_step(SCANNED)
    traced = trace(fn, args)
    saved = residual_bytes(traced, policy)
    remat = rematerialize(traced, ["blocks"], policy)
    jcore.check_jaxpr(remat.closed_jaxpr.jaxpr)
    assert len(_scans(remat)) == 2
    assert saved["blocks"] > 0
    assert _stacks_read_backward(traced) - _stacks_read_backward(remat) == saved["blocks"]
    for got, want in zip(_run(remat, args), _run(traced, args)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_dots_saveable_keeps_more_of_a_scan_than_nothing_saveable():
    fn, args = gpt.make_train_step(SCANNED, abstract=True)
    traced = trace(fn, args)
    dots, nothing = (residual_bytes(traced, p)["blocks"] for p in
                     (RematPolicy.DOTS, RematPolicy.NOTHING))
    assert 0 < dots < nothing


def test_compiled_scanned_stack_holds_less_and_recomputes():
    """The scanned twin of ``test_compiled_program_holds_less_and_recomputes`` (measured:
    1641 / 752 / 456 MiB of temporaries compiled for no remat / dots_saveable /
    nothing_saveable, 1528 / 568 / 304 MiB predicted)."""
    fn, args = gpt.make_train_step(dataclasses.replace(WIDE, scan_layers=True), abstract=True)
    traced = trace(fn, args)
    temps, flops, predicted = {}, {}, {}
    for policy in (None, RematPolicy.DOTS, RematPolicy.NOTHING):
        t = traced if policy is None else rematerialize(traced, ["blocks"], policy)
        compiled = (jax.jit(jcore.jaxpr_as_fun(t.closed_jaxpr))
                    .lower(*jax.tree_util.tree_leaves(args)).compile())
        truth = analyze(compiled)
        specs, operand = _replicated(t.graph)
        _, live = memory_timeline(t.graph, specs, {}, results_held=True, operand_specs=operand)
        temps[policy], flops[policy], predicted[policy] = truth.temp_bytes, truth.flops, max(live)
    assert temps[RematPolicy.NOTHING] < 0.75 * temps[RematPolicy.DOTS]
    assert temps[RematPolicy.DOTS] < 0.6 * temps[None]
    assert flops[RematPolicy.NOTHING] > 1.1 * flops[None]
    assert predicted[RematPolicy.NOTHING] < predicted[RematPolicy.DOTS] < predicted[None]


def _lax_scan_loss(hidden: int, layers: int):
    """(loss, params): a ``lax.scan`` over a dict of stacked kernels. The layers' gelu leaves
    residuals beyond the layer input and the dot under either policy on every jax line (a
    tanh alone does not on jax 0.12: it saves only the input and ``one_minus_square``)."""
    def loss(params, x):
        def layer(h, w):
            return jax.nn.gelu(h @ w["kernel"]) + h, None
        h, _ = jax.lax.scan(layer, x, params["stack"])
        return jnp.mean((h @ params["head"]) ** 2)

    key = jax.random.PRNGKey(0)
    return loss, {"stack": {"kernel": 0.1 * jax.random.normal(key, (layers, hidden, hidden))},
                  "head": jax.random.normal(key, (hidden, 4))}


def _nnx_scan_loss(hidden: int, layers: int):
    """(loss, params): flax nnx blocks made by ``nnx.vmap``, run by ``nnx.scan``."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(hidden, hidden, rngs=rngs)

        def __call__(self, x):
            return jax.nn.gelu(self.linear(x)) + x

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stack(rngs):
        return Block(rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.stack = stack(rngs)
            self.head = nnx.Linear(hidden, 4, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(h, block):
                return block(h)
            return self.head(run(x, self.stack))

    graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)

    def loss(params, x):
        return jnp.mean(nnx.merge(graphdef, params)(x) ** 2)
    return loss, params


@pytest.mark.parametrize("make", [_lax_scan_loss, _nnx_scan_loss], ids=["lax.scan", "nnx.scan"])
def test_scanned_stack_outside_linen_is_rematerialized(make):
    """Not only flax linen: a ``lax.scan`` over stacked kernels, and an ``nnx.scan`` over
    ``nnx.vmap``-made blocks, are one layer too (``stack``), recomputed with equal numerics."""
    import optax

    loss, params = make(32, 4)
    opt = optax.adam(1e-3)

    def step(params, opt_state, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    args = (params, opt.init(params), jax.random.normal(jax.random.PRNGKey(1), (16, 32)))
    traced = trace(step, args)
    for policy in RematPolicy:
        assert residual_bytes(traced, policy)["stack"] > 0
        remat = rematerialize(traced, ["stack"], policy)
        assert _stacks_read_backward(remat) < _stacks_read_backward(traced)
        for got, want in zip(_run(remat, args), _run(traced, args)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
