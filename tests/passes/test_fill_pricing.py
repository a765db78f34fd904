"""A scatter into a broadcast of a scalar (a gather's gradient) pays for the fill, which XLA
writes as a kernel of its own, at each strategy's local size; a scatter into a buffer the
program already holds writes in place and pays nothing more."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from autopar._mesh import axis_sizes
from autopar.cost_model.hardware import axis_levels, get_profile
from autopar.cost_model.spec import local_bytes
from autopar.passes.ir import NodeKind
from autopar.passes.strategies import MeshContext, build_strategies, fills_its_operand
from autopar.passes.trace import trace

SHAPE = (256, 4096)


def _scatter(fn, args, mesh):
    graph = trace(fn, args).graph
    sizes = axis_sizes(mesh)
    profile = get_profile("h100")
    strats, _ = build_strategies(graph, MeshContext(tuple(sizes), sizes,
                                                    axis_levels(mesh, profile), profile))
    node = next(n for n in graph.nodes
                if n.kind is NodeKind.OP and n.primitive is lax.scatter_add_p)
    return graph, node, strats[node.id], sizes, profile


def test_a_scatter_into_zeros_pays_its_fill(mesh_1d):
    def gather_grad(logits, targets):
        return jax.grad(lambda x: jnp.take_along_axis(x, targets[:, None], axis=1).sum())(
            logits)

    graph, node, strats, sizes, profile = _scatter(
        gather_grad, (jnp.zeros(SHAPE), jnp.zeros(SHAPE[:1], jnp.int32)), mesh_1d)
    assert fills_its_operand(graph, node) and len(strats) > 1
    fills = [local_bytes(s.in_specs[0], SHAPE, 4, sizes) / profile.achieved_hbm_bytes_per_s
             for s in strats]
    assert [s.compute_s for s in strats] == pytest.approx(fills)
    assert max(fills) == pytest.approx(SHAPE[0] * SHAPE[1] * 4
                                       / profile.achieved_hbm_bytes_per_s)
    assert min(fills) < max(fills)  # a split fill writes a device's share


def test_a_scatter_into_a_held_buffer_pays_no_fill(mesh_1d):
    def add_rows(buffer, rows, updates):
        return buffer.at[rows].add(updates)

    graph, node, strats, _, _ = _scatter(
        add_rows, (jnp.zeros(SHAPE), jnp.zeros((8,), jnp.int32), jnp.zeros((8, SHAPE[1]))),
        mesh_1d)
    assert not fills_its_operand(graph, node)
    assert all(s.compute_s == 0.0 for s in strats)
