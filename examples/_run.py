"""The command line and training loop every example script shares.

An example script only says how to build its train step; :func:`main` does the rest::

    python examples/gpt2.py --mesh data=2,model=4 --steps 5 --hardware h100

parses the arguments, asks XLA for simulated CPU devices when there is no accelerator (before
jax is imported, which is why this module imports jax only inside functions), plans the step
with ``autopar.plan``, prints a summary of the plan, and trains a few steps on one fixed
batch (so the loss falls as the model learns it), printing the loss of each step.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

_SIMULATE_FLAG = "--xla_force_host_platform_device_count"

#: Built-in profile used when the devices are simulated CPU devices and no --hardware is given:
#: planning for the CPU itself would say little about a real accelerator.
SIMULATED_HARDWARE = "h100"


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default="data=2,model=4",
                        help="mesh axes as name=size pairs (default: data=2,model=4)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default: 5)")
    parser.add_argument("--hardware", default=None,
                        help="hardware profile to plan for: a name (h100, tpu-v5e, ...) or a "
                             "profile JSON; default: this accelerator's profile, or "
                             f"{SIMULATED_HARDWARE} on simulated CPU devices")
    parser.add_argument("--simulate-devices", type=int, default=None, metavar="N",
                        help="simulated CPU devices when there is no accelerator (default: as "
                             "many as the mesh needs; 0: none)")
    parser.add_argument("--size", choices=("tiny", "realistic"), default="tiny",
                        help="model size: tiny (CPU-friendly, default) or realistic (for an "
                             "accelerator)")
    parser.add_argument("--report", action="store_true",
                        help="print autopar's full report instead of the summary")
    return parser


def simulate_devices(n: int) -> None:
    """Ask XLA for ``n`` host (CPU) devices (``autopar.simulate_cpu_devices``). Only the CPU
    platform is affected: on a TPU or GPU host jax still runs on the accelerator."""
    import autopar
    autopar.simulate_cpu_devices(n)


def _fmt_s(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t >= 1e-4 else f"{t * 1e6:.1f} us"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def plan_summary(plan, params, planning_s: float, top: int = 6) -> str:
    """A few lines: mesh, hardware, the prediction, and the largest parameters' shardings."""
    import jax
    mesh = dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape))
    e = plan.estimate
    lines = [(f"autopar plan: mesh {mesh}, hardware profile `{plan.hardware}`, "
              f"planned in {planning_s:.1f} s"),
             (f"  predicted per device: step {_fmt_s(e.step_time_s)} (compute "
              f"{_fmt_s(e.compute_time_s)}, communication {_fmt_s(e.comm_time_s)}), wire "
              f"{_fmt_bytes(e.comm_bytes)}, peak memory {_fmt_bytes(e.peak_memory_bytes)}")]
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = jax.tree_util.tree_leaves(plan.in_shardings[0])
    rows = sorted(((math.prod(leaf.shape), jax.tree_util.keystr(path), leaf.shape, s.spec)
                   for (path, leaf), s in zip(leaves, specs)), key=lambda r: -r[0])
    sharded = sum(1 for r in rows if any(r[3]))
    lines.append(f"  parameters: {sharded} of {len(rows)} sharded; the largest:")
    width = max(len(r[1]) for r in rows[:top])
    lines += [f"    {path:<{width}}  {tuple(shape)!s:<16} {spec}"
              for _, path, shape, spec in rows[:top]]
    return "\n".join(lines)


def _device_note(jax, simulated: int) -> str:
    devices = jax.devices()
    platform = devices[0].platform
    if platform == "cpu":
        return (f"No accelerator found: running on {len(devices)} simulated CPU devices "
                f"(XLA_FLAGS={_SIMULATE_FLAG}={simulated}).")
    return f"Running on {len(devices)} {platform.upper()} devices ({devices[0].device_kind})."


def train(run, state, steps: int, say: Callable[[str], None] = print) -> list[float]:
    """``steps`` calls of ``run(params, opt_state, batch)`` on one batch; returns the losses."""
    params, opt_state, batch = state
    losses = []
    for i in range(steps):
        start = time.perf_counter()
        params, opt_state, loss = run(params, opt_state, batch)
        loss = float(loss)
        note = " (includes compiling)" if i == 0 else ""
        say(f"  step {i}: loss {loss:.4f}  {(time.perf_counter() - start) * 1e3:8.1f} ms{note}")
        losses.append(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"the loss of step {i} is {loss}")
    return losses


def main(build: Callable, description: str, argv=None) -> int:
    """Run an example: ``build(size)`` returns ``(train_step, (params, opt_state, batch))``
    for ``size`` "tiny" or "realistic"; it is called after jax is set up."""
    args = build_parser(description).parse_args(argv)
    from autopar._meshspec import parse_mesh_spec
    from autopar.errors import AutoparError
    try:
        mesh = parse_mesh_spec(args.mesh)
        simulated = (math.prod(mesh.values()) if args.simulate_devices is None
                     else args.simulate_devices)
        simulate_devices(simulated)
        return _run(build, args, mesh, simulated)
    except AutoparError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(build: Callable, args, mesh: dict, simulated: int) -> int:
    import jax

    import autopar
    from autopar._mesh import as_auto_mesh
    print(_device_note(jax, simulated))
    mesh = as_auto_mesh(mesh)  # a mesh the devices cannot hold fails here, before any work
    hardware = args.hardware
    if hardware is None and jax.default_backend() == "cpu":
        hardware = SIMULATED_HARDWARE
    step, state = build(args.size)
    start = time.perf_counter()
    plan = autopar.plan(step, *state, mesh=mesh, hardware=hardware)
    planning_s = time.perf_counter() - start
    print(plan.report() if args.report else plan_summary(plan, state[0], planning_s))
    print(f"\nTraining {args.steps} steps on one batch:")
    train(plan.jit(donate_argnums=(0, 1)), jax.device_put(state, plan.in_shardings),
          args.steps)
    return 0
