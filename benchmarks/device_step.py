"""A real train step on this machine's first device beside the timeline model's prediction.

``python -m benchmarks.device_step --out DIR`` builds the bundled models' realistic-width
train steps with real arrays, compiles each for the first device, and prints per workload:

* the measured step: the median (and minimum) wall time of ``--repeats`` runs after
  ``--warmup``, each ended by ``block_until_ready``;
* the simulated step of the same compiled program on the device's hardware profile
  (``cost_model.timeline.simulate_compiled``), and its ratio to the measured one;
* the compiled program's peak memory (XLA's memory analysis).

It also measures the device's matmul rate and memory bandwidth the way ``autopar profile``
does, and lists which of the backend options (``passes.backend_options``) the device accepts.
DIR receives ``results.json``, the compiled HLO of every workload (``hlo.tar.gz``) and, with
``--trace``, a Perfetto trace of one step of each (``traces.tar.gz``), so per-kernel times can
be compared with the simulator's events on another machine.

``python -m benchmarks.device_step --compare DIR`` needs no device: it reads such a folder
(``benchmarks/results/device_h200`` holds one from an H200) and prints, per workload, the
measured step, the traced device span and the simulation of its compiled HLO on the current
cost model, split into matmul kernels and the rest, so a change to the cost model can be
checked against the hardware without it.

On the test machine's CPU this runs the tiny configurations (``--tiny``); on a GPU it is the
one check here that prices the simulator against real hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import shutil
import statistics
import sys
import tarfile
import time


def workloads(tiny: bool):
    """name -> (model module, config): the realistic single-device train steps."""
    from autopar.models import bert, gpt, llama_nnx, mlp, moe
    if tiny:
        return {"gpt": (gpt, gpt.TINY), "gpt-scan": (gpt, gpt.TINY_SCAN),
                "mlp": (mlp, mlp.TINY)}
    return {
        "gpt": (gpt, gpt.REALISTIC),
        "gpt-scan": (gpt, gpt.REALISTIC_SCAN),
        "gpt-wide": (gpt, dataclasses.replace(gpt.REALISTIC, hidden=4096, heads=32, layers=2,
                                              batch=8)),
        "bert": (bert, bert.REALISTIC),
        "llama": (llama_nnx, llama_nnx.REALISTIC),
        "moe": (moe, moe.REALISTIC),
        "mlp": (mlp, mlp.REALISTIC),
    }


def _say(message: str) -> None:
    print(f"[device_step] {message}", file=sys.stderr, flush=True)


def _time_step(compiled, args, warmup: int, repeats: int) -> list[float]:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        samples.append(time.perf_counter() - t0)
    return samples


def measure_workload(module, config, profile, warmup: int, repeats: int) -> tuple[dict, str]:
    """(result row, compiled HLO text) of one workload."""
    import jax

    from autopar.cost_model.timeline import simulate_compiled

    step, args = module.make_train_step(config)
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    samples = _time_step(compiled, args, warmup, repeats)
    measured = statistics.median(samples)
    timeline = simulate_compiled(compiled, profile)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float((cost or {}).get("flops", 0.0))
    memory = compiled.memory_analysis()
    row = {
        "compile_s": compile_s,
        "measured_s": measured,
        "measured_min_s": min(samples),
        "simulated_s": timeline.step_time_s,
        "simulated_over_measured": timeline.step_time_s / measured,
        "trip_counts_known": timeline.trip_counts_known,
        "simulated_compute_busy_s": timeline.compute_busy_s,
        "xla_flops": flops,  # XLA:GPU counts no flops in cuBLAS custom-calls
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "argument_bytes": getattr(memory, "argument_size_in_bytes", None),
    }
    return row, compiled.as_text()


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One workload's measured and simulated step, in seconds."""

    name: str
    measured_s: float  # wall time of a step, dispatch included
    span_s: float  # first kernel's start to last kernel's end, from the trace
    simulated_s: float
    matmul_kernels_s: float  # traced
    other_kernels_s: float  # traced
    simulated_matmul_s: float
    simulated_other_s: float
    slowest_other: tuple[str, float, float]  # (kernel, traced s, simulated s) most under-priced


def _is_gemm_kernel(name: str) -> bool:
    """cuBLAS (nvjet, cutlass) kernels and XLA's Triton gemm fusions, for kernels the
    compiled program does not name."""
    return name.startswith(("nvjet", "sm90_", "sm80_")) or "cutlass" in name or "gemm" in name


def _kernels(trace: bytes) -> list[dict]:
    """A trace's kernels in time order: the device's events on a GPU or TPU, the thunks
    XLA:CPU ran (events naming their ``hlo_op``) on the CPU."""
    import gzip

    doc = json.loads(gzip.decompress(trace))
    events = [e for e in (doc["traceEvents"] if isinstance(doc, dict) else doc)
              if e.get("ph") in ("X", "M")]
    devices = {e["pid"] for e in events if e["ph"] == "M" and e.get("name") ==
               "process_name" and "/device:" in str(e.get("args", {}).get("name", ""))}
    kernels = [e for e in events if e["ph"] == "X" and (
        e.get("pid") in devices if devices else "hlo_op" in (e.get("args") or {}))]
    return sorted(kernels, key=lambda e: e["ts"])


def _members(path: str) -> dict[str, bytes]:
    if not os.path.exists(path):
        return {}
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def compare(folder: str, profile=None) -> list[Comparison]:
    """Every traced workload of a ``device_step --out`` folder, simulated on ``profile``
    (default: the one the run used) with the current cost model."""
    import collections
    import re

    from autopar.cost_model.hardware import get_profile
    from autopar.cost_model.hlo_ir import parse_module
    from autopar.cost_model.hlo_roofline import matmuls
    from autopar.cost_model.timeline import simulate

    with open(os.path.join(folder, "results.json")) as f:
        results = json.load(f)
    profile = get_profile(profile or results["profile"])
    hlo = _members(os.path.join(folder, "hlo.tar.gz"))
    traces = _members(os.path.join(folder, "traces.tar.gz"))
    out = []
    for name, row in results["workloads"].items():
        if "error" in row or f"{name}.hlo.txt" not in hlo or f"{name}.trace.json.gz" not in traces:
            continue
        text = hlo[f"{name}.hlo.txt"].decode()
        module = parse_module(text)
        timeline = simulate(text, profile)
        where = {i.name: (c, i) for c, body in module.computations.items() for i in body}
        # XLA:GPU names a kernel after its fusion, or the fusion it deduplicated it with.
        kernel_of = dict(re.findall(r'%(\S+) = [^\n]*deduplicated_name="([^"]+)"', text))
        simulated = collections.Counter()
        is_matmul: dict[str, bool] = {}
        sim_gemm = sim_other = 0.0
        for event in timeline.events:
            if event.level is not None:
                continue
            computation, instruction = where[event.name]
            took = event.end_s - event.start_s
            kernel = kernel_of.get(event.name, event.name).replace(".", "_")
            is_matmul[kernel] = bool(matmuls(module, computation, instruction))
            if is_matmul[kernel]:
                sim_gemm += took
            else:
                sim_other += took
                simulated[kernel] += took
        kernels = _kernels(traces[f"{name}.trace.json.gz"])
        traced = collections.Counter()
        gemm = other = 0.0
        for k in kernels:
            took, kernel = k["dur"] * 1e-6, k["name"].replace(".", "_")
            if is_matmul.get(kernel, _is_gemm_kernel(kernel)):
                gemm += took
            else:
                other += took
                traced[kernel] += took
        # Among kernels both sides name alike (XLA:GPU may rename a deduplicated one).
        worst = max((k for k in traced if k in simulated),
                    key=lambda k: traced[k] - simulated[k], default="")
        out.append(Comparison(
            name=name, measured_s=row["measured_s"],
            span_s=(kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) * 1e-6,
            simulated_s=timeline.step_time_s, matmul_kernels_s=gemm, other_kernels_s=other,
            simulated_matmul_s=sim_gemm, simulated_other_s=sim_other,
            slowest_other=(worst, traced.get(worst, 0.0), simulated.get(worst, 0.0))))
    return out


def comparison_table(rows: list[Comparison]) -> str:
    """Markdown: measured beside simulated, whole steps and by kernel kind."""
    lines = ["| workload | step ms (wall) | kernel span ms | simulated ms | simulated / span "
             "| matmul kernels ms: traced, simulated | other kernels ms: traced, simulated "
             "| most under-priced kernel: traced, simulated ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kernel, traced, sim = r.slowest_other
        lines.append(
            f"| {r.name} | {r.measured_s * 1e3:.2f} | {r.span_s * 1e3:.2f} | "
            f"{r.simulated_s * 1e3:.2f} | {r.simulated_s / r.span_s:.2f} | "
            f"{r.matmul_kernels_s * 1e3:.2f}, {r.simulated_matmul_s * 1e3:.2f} | "
            f"{r.other_kernels_s * 1e3:.2f}, {r.simulated_other_s * 1e3:.2f} | "
            f"`{kernel}`: {traced * 1e3:.2f}, {sim * 1e3:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for results.json and hlo.tar.gz")
    parser.add_argument("--tiny", action="store_true", help="tiny configurations (CPU)")
    parser.add_argument("--only", default=None, help="comma-separated workload names")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--trace", action="store_true",
                        help="write a Perfetto trace of one step of each workload")
    parser.add_argument("--compare", metavar="DIR", default=None,
                        help="no device: simulate a --out folder's programs and compare")
    args = parser.parse_args(argv)
    if args.compare:
        print(comparison_table(compare(args.compare)))
        return 0

    import jax

    from autopar.cost_model.hardware import get_profile
    from autopar.cost_model.profiler import measure_copy_bandwidth, measure_matmul
    from autopar.passes.backend_options import choose

    device = jax.devices()[0]
    profile = get_profile(None)
    _say(f"jax {jax.__version__} on {device.platform} {device.device_kind}; "
         f"profile {profile.name}")
    results = {"jax": jax.__version__, "device": f"{device.platform} {device.device_kind}",
               "profile": profile.name, "workloads": {}}

    sizes = (256, 512) if device.platform == "cpu" else (1024, 2048, 4096, 8192)
    import jax.numpy as jnp
    results["matmul_bf16"] = measure_matmul(device, jnp.bfloat16, sizes)
    # At jax's default precision: on a GPU with TF32 tensor cores this runs at their rate.
    results["matmul_f32"] = measure_matmul(device, jnp.float32, sizes)
    results["copy_bytes_per_s"] = measure_copy_bandwidth(
        device, 2**24 if device.platform == "cpu" else 2**30)
    results["profile_peak_bf16"] = profile.peak_flops_per_s.get("bfloat16")
    results["profile_hbm_bytes_per_s"] = profile.hbm_bandwidth_bytes_per_s
    _say(f"matmul bf16 {[(s, round(r / 1e12, 1)) for s, r in results['matmul_bf16']]}, f32 "
         f"{[(s, round(r / 1e12, 1)) for s, r in results['matmul_f32']]} TFLOP/s; copy {results['copy_bytes_per_s'] / 1e9:.0f} GB/s (profile: "
         f"{profile.hbm_bandwidth_bytes_per_s / 1e9:.0f} GB/s)")
    results["backend_options"] = [n.to_dict() for n in choose(profile, device)]
    for note in results["backend_options"]:
        _say(f"option {note['name']}={note['value']}: {'set' if note['set'] else 'not set'}"
             f" ({note['why'][:90]})")

    chosen = workloads(args.tiny)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    hlo = {}
    for i, (name, (module, config)) in enumerate(chosen.items()):
        try:
            row, text = measure_workload(module, config, profile, args.warmup, args.repeats)
        except Exception as e:  # one workload's failure (memory, say) must not lose the rest
            _say(f"{name}: {type(e).__name__}: {str(e)[:300]}")
            results["workloads"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        hlo[name] = text
        results["workloads"][name] = row
        _say(f"{name}: measured {row['measured_s'] * 1e3:.2f} ms, simulated "
             f"{row['simulated_s'] * 1e3:.2f} ms ({row['simulated_over_measured']:.2f}x), compile "
             f"{row['compile_s']:.0f} s")
        if args.trace:
            _trace(name, module, config, args.out)

        _save(args.out, results, hlo)  # after each workload: a timeout keeps what was done
    _save(args.out, results, hlo)
    print(json.dumps(results, indent=1))
    return 0


def _save(out: str | None, results: dict, hlo: dict[str, str]) -> None:
    if out is None:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with tarfile.open(os.path.join(out, "hlo.tar.gz"), "w:gz") as tar:
        for name, text in hlo.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}.hlo.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _trace(name: str, module, config, out: str | None) -> None:
    """A Perfetto trace of one step of workload ``name`` into ``out``/traces.tar.gz."""
    import jax

    if out is None:
        return
    step, args = module.make_train_step(config)
    fn = jax.jit(step)
    jax.block_until_ready(fn(*args))
    folder = os.path.join(out, "trace")
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        jax.block_until_ready(fn(*args))
    found = [os.path.join(root, f) for root, _, files in os.walk(folder) for f in files
             if f == "perfetto_trace.json.gz"]
    archive = os.path.join(out, "traces.tar.gz")
    kept = {}
    if os.path.exists(archive):
        with tarfile.open(archive) as tar:
            kept = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    if found:
        with open(found[0], "rb") as f:
            kept[f"{name}.trace.json.gz"] = f.read()
    with tarfile.open(archive, "w") as tar:
        for member, data in kept.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    shutil.rmtree(folder)


if __name__ == "__main__":
    sys.exit(main())
