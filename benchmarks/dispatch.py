"""What ``autopar.parallelize`` costs per call against ``jax.jit``, once planned and compiled.

A train state of ``leaves`` small arrays (half parameters, half optimizer state) and a host
(numpy) batch are stepped ``calls`` times by the same function, once through ``jax.jit`` with
the plan's shardings and once through ``autopar.parallelize``, each fed its own results, as a
training loop does. Arrays are tiny, so the time per call is dispatch: argument checks,
placement, launching the program, freeing the last step's buffers.
"""

from __future__ import annotations

import time

#: Leaves of the train state (the size issue #29 measured: an 879-leaf state).
LEAVES = 800
CALLS = 200


def _state(leaves: int):
    import numpy as np
    rng = np.random.default_rng(0)
    half = leaves // 2
    params = {f"w{i}": rng.normal(size=(8, 16)).astype(np.float32) for i in range(half)}
    moments = {f"w{i}": np.zeros((8, 16), np.float32) for i in range(half)}
    return params, moments


def _step(params, moments, x):
    import jax
    import jax.numpy as jnp
    moments = jax.tree.map(lambda m, p: 0.9 * m + 0.1 * p, moments, params)
    params = jax.tree.map(lambda p, m: p - 0.01 * m, params, moments)
    return params, moments, jnp.sum(x)


def _per_call_s(run, state, calls: int) -> float:
    import jax
    params, moments, x = state
    params, moments, _ = run(params, moments, x)  # compiled; placed as the program puts them
    jax.block_until_ready((params, moments))
    start = time.perf_counter()
    for _ in range(calls):
        params, moments, loss = run(params, moments, x)
    jax.block_until_ready(loss)
    return (time.perf_counter() - start) / calls


def run(leaves: int = LEAVES, calls: int = CALLS, mesh=None) -> dict:
    """{"jit_s", "parallelize_s", "ratio", "leaves"}: seconds per call of each, best of 3."""
    import jax
    import numpy as np

    import autopar
    mesh = mesh or {"data": len(jax.devices())}
    params, moments = _state(leaves)
    x = np.ones((len(jax.devices()) * 2, 4), np.float32)
    step = autopar.parallelize(_step, mesh=mesh, search=False, verbose=False)
    step(params, moments, x)  # planned and compiled
    jitted = jax.jit(_step, in_shardings=step.plan.in_shardings,
                     out_shardings=step.plan.out_shardings)
    jit_s = min(_per_call_s(jitted, (params, moments, x), calls) for _ in range(3))
    ours_s = min(_per_call_s(step, (params, moments, x), calls) for _ in range(3))
    return {"leaves": leaves, "jit_s": jit_s, "parallelize_s": ours_s,
            "ratio": ours_s / jit_s, "overhead_s": ours_s - jit_s}


def report(result: dict) -> str:
    return (f"dispatch, {result['leaves']}-leaf train state, per call: jax.jit "
            f"{result['jit_s'] * 1e3:.3f} ms, autopar.parallelize "
            f"{result['parallelize_s'] * 1e3:.3f} ms (ratio {result['ratio']:.2f}, "
            f"{result['overhead_s'] * 1e3:+.3f} ms)")
