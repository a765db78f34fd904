"""Layer deduplication: the copies of an unrolled layer share one decision, the ILP does not
grow with depth, and the plan still computes what one device computes."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

import autopar
from autopar.models import gpt, mlp
from autopar.passes.dedup import node_keys, structural_colors
from autopar.passes.trace import trace

MESH = {"data": 2, "model": 4}
# Big enough that sharding pays (planned only, never executed).
MEDIUM = dataclasses.replace(gpt.REALISTIC, vocab=8192, seq=512, hidden=1024, heads=8, batch=8)


def _per_layer_specs(plan) -> dict[str, dict[str, object]]:
    """{'block_<i>': {path inside the block (params and optimizer state): PartitionSpec}}."""
    out: dict[str, dict[str, object]] = {}
    leaves = jax.tree_util.tree_leaves(plan.in_shardings)
    for path, sharding in zip(plan.in_paths, leaves):
        m = re.search(r"\['(block_\d+)'\]", path)
        if m:
            rest = path.replace(m.group(0), "['block']")
            out.setdefault(m.group(1), {})[rest] = sharding.spec
    return out


def test_every_copy_of_a_layer_gets_the_same_shardings():
    fn, args = gpt.make_train_step(dataclasses.replace(MEDIUM, layers=4), abstract=True)
    plan = autopar.plan(fn, *args, mesh=MESH, hardware="h100")
    layers = _per_layer_specs(plan)
    assert sorted(layers) == [f"block_{i}" for i in range(4)]
    first = layers["block_0"]
    assert any(spec != jax.sharding.PartitionSpec() for spec in first.values()), \
        "the layers are all replicated: the check below would be vacuous"
    for name, specs in layers.items():
        assert specs == first, name
    assert plan.stats["ilp_groups"] < plan.stats["ilp_groups_followed"]


def test_ilp_size_does_not_grow_with_depth():
    stats = {}
    for layers in (8, 12):
        config = dataclasses.replace(mlp.TP_FRIENDLY, num_layers=layers)
        fn, args = mlp.make_train_step(config, abstract=True)
        stats[layers] = autopar.plan(fn, *args, mesh=MESH, hardware="h100").stats
    assert stats[12]["nodes"] > stats[8]["nodes"] * 1.4
    for key in ("ilp_groups", "ilp_variables", "ilp_constraints", "ilp_edges"):
        assert stats[12][key] == stats[8][key], key


def test_unrolled_copies_share_colors_and_ends_do_not():
    def f(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x.sum()

    ws = [jnp.ones((8, 8))] * 6
    graph = trace(f, (ws, jnp.ones((4, 8)))).graph
    colors = structural_colors(graph, node_keys(graph)).of
    dots = [n.id for n in graph.nodes if n.prim == "dot_general"]
    assert len(dots) == 6
    assert len({colors[d] for d in dots[2:4]}) == 1   # interior copies: one decision
    assert colors[dots[0]] != colors[dots[3]]          # the first sees the inputs


def test_deduplicated_plan_matches_one_device():
    fn, args = gpt.make_train_step(dataclasses.replace(gpt.TINY, layers=4))
    plan = autopar.plan(fn, *args, mesh=MESH, hardware="h100")
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    got = jax.tree_util.tree_leaves(plan.jit()(*args))
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)
