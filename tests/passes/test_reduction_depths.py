"""Which reductions XLA's combiner can merge (``passes.reductions.reduction_depths``): those
no reduction to a non-scalar waits for (a train step's gradients, its loss) form one group,
and others merge only with reductions of equal depth. The estimate charges each group one
latency; the ILP prices the first group without latency."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from autopar.passes.estimate import plan_collectives
from autopar.models import mlp
from autopar.passes.cluster import cluster
from autopar.passes.ilp import IlpBuilder
from autopar.passes.reductions import is_combined_reduction, reduction_depths
from autopar.passes.trace import trace
from tests.passes.test_propagate import _complete, _setup


def test_gradients_and_the_loss_are_last_and_activations_are_waited_on():
    fn, args = mlp.make_train_step(mlp.TINY)
    graph = trace(fn, args).graph
    params = {graph.values[graph.nodes[n].outs[0]].shape for n in graph.input_nodes}
    depths = reduction_depths(graph)
    dots = [n for n in graph.nodes if n.prim == "dot_general"]
    gradients = [n for n in dots if depths[n.id] == 0]
    activations = [n for n in dots if depths[n.id] > 0]
    assert gradients and activations
    # A gradient's dot is read by a transpose into its parameter's shape; an activation's
    # by the next layer (its bias add).
    consumers = graph.consumers()

    def readers(n):
        return [graph.nodes[r] for v in n.outs for r, _ in consumers.get(v, ())]
    assert all(r.prim == "transpose" and graph.values[r.outs[0]].shape in params
               for n in gradients for r in readers(n))
    assert all(r.prim != "transpose" for n in activations for r in readers(n))
    assert all(is_combined_reduction(n, graph) for n in gradients)
    assert not any(is_combined_reduction(n, graph) for n in activations)
    losses = [n for n in graph.nodes if n.prim == "reduce_sum"
              and graph.values[n.outs[0]].rank == 0]
    assert losses and all(is_combined_reduction(n, graph) for n in losses)


def test_a_norms_two_statistics_share_a_depth_and_one_latency():
    """A batch norm's mean and mean of squares, over a batch split on the mesh: two
    all-reduces that do not wait for each other, priced with one latency."""
    def norm_then_matmul(x, w):
        mean = jnp.mean(x, axis=0, keepdims=True)
        mean_sq = jnp.mean(x * x, axis=0, keepdims=True)
        return ((x - mean) * jax.lax.rsqrt(mean_sq - mean * mean + 1e-5)) @ w

    x, w = jnp.ones((64, 32)), jnp.ones((32, 16))
    g, _, strats, prop = _complete(norm_then_matmul, (x, w), in_pins=(P("data"),),
                                   mesh={"data": 8})
    depths = reduction_depths(g)
    sums = [n for n in g.nodes if n.prim == "reduce_sum"]
    assert len(sums) == 2 and depths[sums[0].id] == depths[sums[1].id] > 0
    mesh = _setup(norm_then_matmul, (x, w), mesh={"data": 8})[3]
    graph, choice = g, prop.choice
    reduces = [c for c in plan_collectives(graph, strats, choice, mesh)
               if c.reason == "reduce" and graph.nodes[c.node].prim == "reduce_sum"]
    assert len(reduces) == 2
    bandwidth_s = [dataclasses.replace(c.step, combined=True).time_s(mesh.levels)
                   for c in reduces]
    latency_s = reduces[0].step.time_s(mesh.levels) - bandwidth_s[0]
    assert latency_s > 0
    assert abs(sum(c.time_s for c in reduces) - (sum(bandwidth_s) + latency_s)) < 1e-12


def test_the_ilp_prices_the_last_reductions_latency_as_the_estimate_does():
    """A data-parallel MLP step: its gradients and loss are all-reduced over `data`, one
    latency in the estimate, and one in the ILP (``IlpBuilder.add_group_latencies``)."""
    fn, args = mlp.make_train_step(mlp.TINY)
    n_in = len(jax.tree_util.tree_leaves(args))
    n_batch = len(jax.tree_util.tree_leaves(args[-1]))
    pins = [None] * (n_in - n_batch) + [P("data")] * n_batch
    g, _, strats, prop = _complete(fn, args, in_pins=pins, mesh={"data": 8})
    mesh = _setup(fn, args, mesh={"data": 8})[3]
    charged_s = sum(c.time_s - dataclasses.replace(c.step, combined=True).time_s(mesh.levels)
                    for c in plan_collectives(g, strats, prop.choice, mesh)
                    if c.reason == "reduce" and c.step.combined)
    assert charged_s > 0
    builder = IlpBuilder(g, strats, cluster(g, strats, mesh), mesh).build()
    c, *_ = builder.matrices()
    x = builder.point(prop.choice)
    assert x is not None
    ilp_s = sum(c[y] for y, _ in builder.latencies if x[y] == 1) / 1e6
    assert ilp_s == pytest.approx(charged_s)


def test_a_sum_read_by_a_scatter_add_is_combined_with_the_gradients():
    """A position embedding's gradient: the batch's sum of the cotangent, scatter-added into
    the table. The scatter adds what it reads, so the sum's all-reduce is among the last ones
    (as XLA compiles it) and its plan needs no all-to-all to dodge a latency."""
    def loss(table, x):
        rows = table[jnp.arange(x.shape[1])]
        return jnp.sum((x + rows[None]) ** 2)

    graph = trace(jax.grad(loss), (jnp.ones((16, 32)), jnp.ones((8, 16, 32)))).graph
    sums = [n for n in graph.nodes if n.prim == "reduce_sum"
            and graph.values[n.outs[0]].shape == (16, 32)]
    scatters = [n for n in graph.nodes if n.prim == "scatter-add"]
    assert sums and scatters
    assert all(is_combined_reduction(n, graph) for n in sums)
