"""Random programs, planned end to end (hints, propagation, the ILP, emission), compute what
one device computes.

Each seed draws a program of 2-D tensors: matmuls with weights, elementwise ops, broadcast
biases, transposes, reshapes, concatenations, slices, softmax, mean-centring, a scanned layer
with stacked weights and a ``jax.checkpoint``-ed block, half of them differentiated (value
and gradient of a loss, as a train step is). Random hints on the
inputs make the plan split and reshard values even at these small shapes, where replicating
everything would otherwise be the fastest plan."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autopar
from autopar.errors import ShardingConflictWarning
from autopar.passes.estimate import value_specs
from autopar.errors import SolverFallbackWarning

DIMS = (8, 16, 32)
MESHES = ({"data": 8}, {"data": 2, "model": 4}, {"data": 2, "model": 2, "expert": 2})
UNARY = {"tanh": jnp.tanh, "relu": jax.nn.relu, "sin": jnp.sin, "half": lambda x: 0.5 * x,
         "abs": jnp.abs}
BINARY = {"add": jnp.add, "mul": jnp.multiply, "sub": jnp.subtract, "max": jnp.maximum}


def draw_program(seed: int, ops: int = 14):
    """(input shapes, ops, output value numbers, whether to differentiate). An op is (kind,
    operand value numbers, extra), and makes the next value; ("input", (), k) takes
    argument k."""
    rng = np.random.default_rng(seed)
    inputs, shapes, program = [], [], []

    def new_input(shape):
        program.append(("input", (), len(inputs)))
        inputs.append(shape)
        shapes.append(shape)
        return len(shapes) - 1

    def add(kind, operands, extra, shape):
        program.append((kind, tuple(operands), extra))
        shapes.append(shape)

    for _ in range(int(rng.integers(1, 3))):
        new_input((int(rng.choice(DIMS)), int(rng.choice(DIMS))))
    while len(program) - len(inputs) < ops:
        i = int(rng.choice([j for j, s in enumerate(shapes) if len(s) == 2]))
        m, n = shapes[i]
        kind = str(rng.choice(["matmul", "unary", "binary", "bias", "transpose", "center",
                               "softmax", "reshape", "concat", "slice", "scan", "remat"]))
        if kind == "matmul":
            w = new_input((n, int(rng.choice(DIMS))))
            add(kind, (i, w), None, (m, shapes[w][1]))
        elif kind == "unary":
            add(kind, (i,), str(rng.choice(sorted(UNARY))), (m, n))
        elif kind == "binary":
            same = [j for j, s in enumerate(shapes) if s == (m, n) and j != i]
            j = int(rng.choice(same)) if same else new_input((m, n))
            add(kind, (i, j), str(rng.choice(sorted(BINARY))), (m, n))
        elif kind == "bias":
            add(kind, (i, new_input((n,))), None, (m, n))
        elif kind == "transpose":
            add(kind, (i,), None, (n, m))
        elif kind == "center":
            add(kind, (i,), int(rng.integers(2)), (m, n))
        elif kind == "softmax":
            add(kind, (i,), None, (m, n))
        elif kind == "reshape":
            fits = [d for d in DIMS if (m * n) % d == 0 and 8 <= m * n // d <= 128]
            d = int(rng.choice(fits))
            add(kind, (i,), (m * n // d, d), (m * n // d, d))
        elif kind == "concat":
            rows = [j for j, s in enumerate(shapes) if len(s) == 2 and s[0] == m
                    and s[1] + n <= 64]
            if rows:
                j = int(rng.choice(rows))
                add(kind, (i, j), None, (m, n + shapes[j][1]))
        elif kind == "scan":
            add(kind, (i, new_input((2, n, n))), None, (m, n))
        elif kind == "remat":
            add(kind, (i,), None, (m, n))
        elif kind == "slice" and n >= 16:
            add(kind, (i,), n // 2, (m, n // 2))
    made = [j for j, (kind, _, _) in enumerate(program) if kind != "input"]
    outputs = sorted({len(shapes) - 1, int(rng.choice(made))})
    return inputs, program, outputs, bool(rng.integers(2))


def run_program(program, outputs, args):
    values = []
    for kind, ops, extra in program:
        if kind == "input":
            values.append(args[extra])
            continue
        x = values[ops[0]]
        if kind == "matmul":
            y = x @ values[ops[1]]
        elif kind == "unary":
            y = UNARY[extra](x)
        elif kind == "binary":
            y = BINARY[extra](x, values[ops[1]])
        elif kind == "bias":
            y = x + values[ops[1]][None, :]
        elif kind == "transpose":
            y = x.T
        elif kind == "center":
            y = x - x.mean(axis=extra, keepdims=True)
        elif kind == "softmax":
            y = jax.nn.softmax(x, axis=-1)
        elif kind == "reshape":
            y = x.reshape(extra)
        elif kind == "concat":
            y = jnp.concatenate([x, values[ops[1]]], axis=1)
        elif kind == "scan":  # a layer applied twice, with stacked weights
            y, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, values[ops[1]])
        elif kind == "remat":
            y = jax.checkpoint(lambda a: jnp.tanh(a) * a)(x)
        else:
            y = x[:, :extra]
        values.append(y)
    return [values[i] for i in outputs]


def make_case(seed: int):
    inputs, program, outputs, train = draw_program(seed)
    rng = np.random.default_rng(1000 + seed)
    args = [jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32) for s in inputs]

    def forward(*xs):
        return run_program(program, outputs, xs)

    if not train:
        return forward, args

    def step(*xs):
        loss = lambda ps: sum(jnp.mean(y ** 2) for y in forward(*ps))  # noqa: E731
        value, grads = jax.value_and_grad(loss)(list(xs))
        return value, [x - 0.1 * g for x, g in zip(xs, grads)]
    return step, args


def random_hints(args, mesh: dict, seed: int):
    """A PartitionSpec or None per argument: a random dim split over a random mesh axis that
    divides it; at least the first argument gets one."""
    rng = np.random.default_rng(2000 + seed)
    hints = []
    for k, x in enumerate(args):
        splits = [(d, a) for d in range(x.ndim) for a, size in mesh.items()
                  if x.shape[d] % size == 0]
        if not splits or (k > 0 and rng.random() < 0.5):
            hints.append(None)
            continue
        d, axis = splits[int(rng.integers(len(splits)))]
        hints.append(P(*[axis if i == d else None for i in range(x.ndim)]))
    return hints


@pytest.mark.parametrize("seed", range(40))
def test_random_program_matches_one_device(seed):
    fn, args = make_case(seed)
    mesh = MESHES[seed % len(MESHES)]
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverFallbackWarning)
        warnings.simplefilter("ignore", ShardingConflictWarning)  # random hints can disagree
        plan = autopar.plan(fn, *args, mesh=mesh, hardware="h100",
                            in_shardings=tuple(random_hints(args, mesh, seed)),
                            search=seed % 4 != 3)  # every fourth: propagation alone
    graph, strats, choice, _ = plan._details
    specs = value_specs(graph, strats, choice)
    assert any(spec.axes for spec in specs.values()), "the hints should split some values"
    got = jax.tree_util.tree_leaves(plan.jit()(*args))
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)
