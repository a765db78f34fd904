"""The random-program fuzz suite: hundreds of random programs planned end to end, each
checked against one device.

    python -m benchmarks.run --suite fuzz [--count 300] [--start 0] [--out benchmarks/results]

Each seed draws a program of 2-D tensors (:func:`draw_program`): matmuls with weights,
elementwise ops, broadcast biases, transposes, reshapes, concatenations, slices, softmax,
mean-centring, a scanned layer with stacked weights and a ``jax.checkpoint``-ed (remat) block;
half of them are differentiated (value and gradient of a loss, as a train step is). It is
planned on a 1-D, 2-D or 3-D mesh of the 8 simulated devices, or on a sub-mesh of 4 of them,
with random input hints (PartitionSpecs, or NamedShardings on the plan's mesh); every fourth
by propagation alone (``search=False``). Each plan must compute what one device computes, and
its JSON must load back to the same text. ``tests/autopar/test_random_programs.py`` runs a
sample of the same programs in CI. The table goes to ``OUT/fuzz.md``, every case to
``OUT/fuzz.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

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




#: Mesh shapes the suite cycles through (axis names data, model, expert); "4 of 8" is a
#: (2, 2) mesh over devices 4..7.
SUITE_MESHES = ("8", "2x4", "4x2", "2x2x2", "4 of 8")


def mesh_of(name: str):
    """The mesh a suite case plans on: a dict, or a jax Mesh for the sub-mesh."""
    from jax.sharding import AxisType, Mesh
    if name == "4 of 8":
        return Mesh(np.array(jax.devices()[4:8]).reshape(2, 2), ("data", "model"),
                    axis_types=(AxisType.Auto,) * 2)
    sizes = [int(s) for s in name.split("x")]
    return dict(zip(("data", "model", "expert"), sizes))


def run_case(seed: int) -> dict:
    """Plans program ``seed`` and checks it against one device: a row of the table."""
    from jax.sharding import Mesh, NamedSharding

    import autopar
    from autopar.errors import ShardingConflictWarning, SolverFallbackWarning
    mesh_name = SUITE_MESHES[seed % len(SUITE_MESHES)]
    mesh = mesh_of(mesh_name)
    sizes = dict(mesh.shape) if isinstance(mesh, Mesh) else mesh
    fn, args = make_case(seed)
    hints = random_hints(args, sizes, seed)
    if isinstance(mesh, Mesh) and seed % 2:  # the same hints as NamedShardings on the mesh
        hints = [h if h is None else NamedSharding(mesh, h) for h in hints]
    search = seed % 4 != 3
    row = {"seed": seed, "mesh": mesh_name, "search": search,
           "hints": sum(h is not None for h in hints), "ok": False}
    start = time.perf_counter()
    try:
        expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SolverFallbackWarning)
            warnings.simplefilter("ignore", ShardingConflictWarning)  # random hints disagree
            plan = autopar.plan(fn, *args, mesh=mesh, hardware="h100", search=search,
                                in_shardings=tuple(hints), verbose=False)
        got = jax.tree_util.tree_leaves(plan.jit()(*args))
        errors = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))
                               / (np.abs(np.asarray(b)) + 1e-3)))
                  for a, b in zip(got, expected)]
        row["max_rel_error"] = max(errors, default=0.0)
        row["ok"] = len(got) == len(expected) and all(
            np.allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)
            for a, b in zip(got, expected))
        if autopar.Plan.from_json(plan.to_json()).to_json() != plan.to_json():
            row["ok"], row["error"] = False, "the plan's JSON does not load back to itself"
        row["source"] = plan.stats["source"]
    except Exception as e:  # a failure is a row of the table, not the end of the suite
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc()
    row["seconds"] = time.perf_counter() - start
    return row


def table(rows: list[dict]) -> str:
    """Markdown: the counts per mesh and the failures."""
    lines = ["| mesh | programs | search=False | passed | failed |",
             "| --- | --- | --- | --- | --- |"]
    for name in SUITE_MESHES:
        mine = [r for r in rows if r["mesh"] == name]
        lines.append(f"| {name} | {len(mine)} | {sum(not r['search'] for r in mine)} "
                     f"| {sum(r['ok'] for r in mine)} | {sum(not r['ok'] for r in mine)} |")
    failed = [r for r in rows if not r["ok"]]
    lines += ["", f"{len(rows) - len(failed)} of {len(rows)} programs equal one device."]
    for r in failed:
        lines.append(f"- seed {r['seed']} on {r['mesh']}: {r.get('error', 'numbers differ')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run --suite fuzz",
                                description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=300, help="programs to run (default 300)")
    p.add_argument("--start", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"),
                   help="folder for fuzz.md and fuzz.json")
    args = p.parse_args(argv)
    if jax.device_count() < 8:
        p.error(f"the suite plans on 8 devices and {jax.device_count()} exist: run it as "
                "python -m benchmarks.run --suite fuzz (it simulates 8 CPU devices)")
    rows = []
    for seed in range(args.start, args.start + args.count):
        rows.append(run_case(seed))
        r = rows[-1]
        print(f"seed {seed:4d} {r['mesh']:>7} search={r['search']!s:5} "
              f"{'ok' if r['ok'] else 'FAILED ' + r.get('error', 'numbers differ')} "
              f"({r['seconds']:.1f} s)", flush=True)
    text = table(rows)
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fuzz.md"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "fuzz.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1
