"""Scan over layers: a stack of identical residual MLP blocks written as ``nn.scan`` (stacked
parameters with a leading layer axis) and as an unrolled loop get equivalent plans, the
scanned program keeps its loop, and both compute what one device computes."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import autopar
from autopar.models import common

MESH = {"data": 2, "model": 4}


class Block(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(4 * self.hidden, name="mlp_in")(x))
        return x + nn.Dense(self.hidden, name="mlp_out")(h)


class ScanBlock(Block):
    def __call__(self, x):  # type: ignore[override]
        return super().__call__(x), None


class Stack(nn.Module):
    hidden: int
    layers: int
    scan: bool

    @nn.compact
    def __call__(self, x):
        if self.scan:
            x, _ = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=self.layers)(self.hidden, name="blocks")(x)
        else:
            for i in range(self.layers):
                x = Block(self.hidden, name=f"block_{i}")(x)
        return x


def train_step(*, scan: bool, hidden: int, batch: int, layers: int = 4, abstract: bool):
    model = Stack(hidden, layers, scan)
    x = jnp.zeros((batch, hidden), jnp.float32)

    def loss_fn(params, b):
        return jnp.mean((model.apply({"params": params}, b["x"]) - b["y"]) ** 2)

    rng = common.batch_rng()
    data = {k: common.random_normal(rng, (batch, hidden), jnp.float32, abstract=abstract)
            for k in ("x", "y")}
    return common.linen_train_step(lambda: model.init(jax.random.key(0), x)["params"],
                                   loss_fn, data)


def _layer_specs(plan, scan: bool) -> dict[str, tuple]:
    """path inside a block (params and optimizer state) -> spec entries without the layer
    axis, for every layer (one entry per layer)."""
    out: dict[str, list] = {}
    for path, sharding in zip(plan.in_paths, jax.tree_util.tree_leaves(plan.in_shardings)):
        name = re.search(r"\['(blocks|block_\d+)'\]", path)
        if name is None:
            continue
        key = path.replace(name.group(0), "[block]")
        spec = tuple(sharding.spec)
        out.setdefault(key, []).append(spec[1:] if scan else spec)
    return out


def test_scanned_and_unrolled_twins_get_equivalent_plans():
    plans = {}
    for scan in (False, True):
        fn, args = train_step(scan=scan, hidden=2048, batch=16, abstract=True)
        plans[scan] = autopar.plan(fn, *args, mesh=MESH, hardware="h100")
    unrolled, scanned = _layer_specs(plans[False], False), _layer_specs(plans[True], True)
    assert sorted(unrolled) == sorted(scanned)
    assert any(any(e is not None for e in specs[0]) for specs in unrolled.values()), \
        "everything is replicated: the comparison would be vacuous"
    for key, specs in unrolled.items():
        assert len(set(specs)) == 1, key            # every copy the same
        norm = tuple(e for e in specs[0])
        got = scanned[key][0]
        assert norm + (None,) * (len(got) - len(norm)) == got + (None,) * (
            len(norm) - len(got)), key
    assert "while" in plans[True].compile().as_text()       # the scan is kept
    assert "while" not in plans[False].compile().as_text()


def test_scanned_stack_matches_one_device():
    fn, args = train_step(scan=True, hidden=16, batch=8, abstract=False)
    plan = autopar.plan(fn, *args, mesh=MESH, hardware="h100",
                        in_shardings=(None, None, {"x": P("data"), "y": P("data")}))
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    got = jax.tree_util.tree_leaves(plan.jit()(*args))
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)


def test_layer_axis_of_a_stack_may_be_sharded():
    """Stacked parameters (and their optimizer state) held sharded over the layer axis: the
    planned program gathers them for the loop, keeps the loop, and stays exact."""
    fn, args = train_step(scan=True, hidden=16, batch=8, abstract=False)

    def hint(path, leaf):
        return P("data") if "'blocks'" in jax.tree_util.keystr(path) else None

    hints = jax.tree_util.tree_map_with_path(hint, args)
    plan = autopar.plan(fn, *args, mesh=MESH, hardware="h100", in_shardings=hints)
    specs = [s.spec for p, s in zip(plan.in_paths, jax.tree_util.tree_leaves(plan.in_shardings))
             if "'blocks'" in p]
    assert specs and all(spec[0] == "data" for spec in specs)
    assert "while" in plan.compile().as_text()
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    got = jax.tree_util.tree_leaves(plan.jit()(*args))
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)
