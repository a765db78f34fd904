"""The command line and training loop every example script shares.

An example script only says how to build its train step; :func:`main` does the rest::

    python examples/gpt2.py --mesh data=2,model=4 --steps 5 --hardware h100

parses the arguments, asks XLA for simulated CPU devices when there is no accelerator (before
jax is imported, which is why this module imports jax only inside functions), and then:

1. plans the step at realistic size from ``jax.ShapeDtypeStruct`` arguments (nothing is
   allocated or run) and prints what was chosen for the largest parameters and what it buys
   against plain data parallelism (predicted step time and memory per device);
2. carries those shardings to the model at toy size (as ``in_shardings`` hints) and trains a
   few steps on one fixed batch (so the loss falls as the model learns it).

At toy size alone every plan is "replicate the weights": compute is too cheap for any
sharding to pay. ``--plan-size tiny`` plans and trains the toy model as it is.
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
    parser.add_argument("--steps", type=int, default=5,
                        help="training steps (default: 5; 0: plan only)")
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
    parser.add_argument("--plan-size", choices=("realistic", "tiny"), default="realistic",
                        help="size the shardings are planned at: realistic (from "
                             "ShapeDtypeStructs, default; carried to the trained model) or tiny")
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


def _axes_of(spec) -> str:
    names = [a for entry in spec if entry is not None
             for a in (entry if isinstance(entry, tuple) else (entry,))]
    return f"over {'+'.join(names)}" if names else "replicated"


def _per_device(shape, spec, sizes: dict) -> tuple:
    out = list(shape)
    for d, entry in enumerate(spec):
        for a in (() if entry is None else entry if isinstance(entry, tuple) else (entry,)):
            out[d] //= sizes[a]
    return tuple(out)


def _params(tree):
    """The parameters in a plan's first argument: its ``params`` collection where it holds
    flax variables (``{"params": ..., "batch_stats": ...}``), else all of it."""
    return tree["params"] if isinstance(tree, dict) and "params" in tree else tree


def sharded_count(plan) -> tuple[int, int]:
    """(parameters sharded, parameters) of a plan whose first argument is the parameters."""
    import jax
    specs = [s.spec for s in jax.tree_util.tree_leaves(_params(plan.in_shardings[0]))]
    return sum(1 for s in specs if any(e is not None for e in s)), len(specs)


def plan_summary(plan, params, planning_s: float, top: int = 6, baseline=None) -> str:
    """A few lines: mesh, hardware, the prediction (beside data parallelism's, ``baseline``),
    and the largest parameters' shardings, global and per device."""
    import jax

    from autopar.cost_model.spec import pspec_text
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape))
    e = plan.estimate
    lines = [(f"autopar plan: mesh {sizes}, hardware profile `{plan.hardware}`, "
              f"planned in {planning_s:.1f} s"),
             (f"  predicted per device: step {_fmt_s(e.step_time_s)} (compute "
              f"{_fmt_s(e.compute_time_s)}, communication {_fmt_s(e.comm_time_s)}), wire "
              f"{_fmt_bytes(e.comm_bytes)}, peak memory {_fmt_bytes(e.peak_memory_bytes)}")]
    if baseline is not None:
        b = baseline.estimate
        lines.append(f"  data parallel (every weight replicated) would take: step "
                     f"{_fmt_s(b.step_time_s)}, peak memory {_fmt_bytes(b.peak_memory_bytes)} "
                     f"({b.step_time_s / e.step_time_s:.2f}x the time, "
                     f"{b.peak_memory_bytes / max(e.peak_memory_bytes, 1):.2f}x the memory)")
    leaves = jax.tree_util.tree_flatten_with_path(_params(params))[0]
    specs = jax.tree_util.tree_leaves(_params(plan.in_shardings[0]))
    rows = sorted(((math.prod(leaf.shape), jax.tree_util.keystr(path), tuple(leaf.shape),
                    s.spec) for (path, leaf), s in zip(leaves, specs)), key=lambda r: -r[0])
    sharded, total = sharded_count(plan)
    lines.append(f"  parameters: {sharded} of {total} sharded; the largest:")
    width = max(len(r[1]) for r in rows[:top])
    lines += [f"    {path:<{width}}  {shape!s:<16} {pspec_text(spec):<22} {_axes_of(spec):<16} "
              f"per device {_per_device(shape, spec, sizes)}"
              for _, path, shape, spec in rows[:top]]
    return "\n".join(lines)


def carried_hints(plan, args):
    """``plan``'s input shardings (made for other shapes of the same model) as hints for
    ``args``: each leaf takes the spec of the leaf at the same path where its dims divide,
    else autopar decides it (None)."""
    import jax
    from jax.sharding import PartitionSpec
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape))
    by_path = {p: s.spec for p, s in zip(plan.in_paths,
                                          jax.tree_util.tree_leaves(plan.in_shardings))}

    def hint(path, leaf):
        spec = by_path.get(jax.tree_util.keystr(path))
        if spec is None or len(spec) > len(leaf.shape):
            return None
        entries = []
        for dim, entry in zip(leaf.shape, spec):
            axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            entries.append(entry if dim % math.prod(sizes[a] for a in axes) == 0 else None)
        return PartitionSpec(*entries)
    return jax.tree_util.tree_map_with_path(hint, tuple(args))


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
    """Run an example: ``build(size, abstract=False)`` returns ``(train_step, (params,
    opt_state, batch))`` for ``size`` "tiny" or "realistic" (``jax.ShapeDtypeStruct`` leaves
    when ``abstract``); it is called after jax is set up."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    if args.steps < 0:
        parser.error(f"argument --steps: {args.steps} is not an integer of at least 0")
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
    from autopar._compare import predict_baselines
    from autopar._mesh import as_auto_mesh
    print(_device_note(jax, simulated))
    mesh = as_auto_mesh(mesh)  # a mesh the devices cannot hold fails here, before any work
    hardware = args.hardware
    if hardware is None and jax.default_backend() == "cpu":
        hardware = SIMULATED_HARDWARE
    step, state = build(args.size)
    hints = None
    if args.plan_size == "realistic":
        big_step, big_state = build("realistic", abstract=True)
        start = time.perf_counter()
        big = autopar.plan(big_step, *big_state, mesh=mesh, hardware=hardware)
        planning_s = time.perf_counter() - start
        dp = predict_baselines(big_step, big_state, mesh, hardware=hardware, kinds=("dp",))
        print("At realistic size (planned from ShapeDtypeStructs, nothing allocated):")
        print(big.report() if args.report else
              plan_summary(big, big_state[0], planning_s, baseline=dp["dp"]))
        hints = carried_hints(big, state)
    start = time.perf_counter()
    # With the realistic plan's shardings pinned, propagation places the rest (no search).
    plan = autopar.plan(step, *state, mesh=mesh, hardware=hardware, in_shardings=hints,
                        search=hints is None)
    planning_s = time.perf_counter() - start
    if hints is None:
        print(plan.report() if args.report else plan_summary(plan, state[0], planning_s))
    else:
        sharded, total = sharded_count(plan)
        print(f"\nAt {args.size} size, with the realistic plan's shardings as hints: "
              f"parameters: {sharded} of {total} sharded")
    print(f"\nTraining {args.steps} steps on one batch:")
    train(plan.jit(donate_argnums=(0, 1)), jax.device_put(state, plan.in_shardings),
          args.steps)
    return 0
