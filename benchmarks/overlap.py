"""Collective overlap: the simulated step of autopar's compiled plan with overlap on and off.

``python -m benchmarks.overlap`` plans and compiles (from ShapeDtypeStructs, nothing runs) a
wide BERT on an 8-way model axis and a GPT 13B-like model on (4, 2), each with
``overlap=True`` and ``overlap=False``, and prints per program: autopar's estimate, the
rewrites taken, the compiled collectives, and the simulated timeline on the h100 profile
(``cost_model.timeline.simulate``) read two ways:

* as compiled: XLA:CPU compiles every collective synchronously, so the simulation holds
  compute while any collective runs, and nothing overlaps;
* as a GPU schedules it (``cost_model.hlo_async.as_async``): every collective split into a
  start, issued as soon as its operands are ready, and a done, waited for at its first use,
  as XLA:GPU's latency-hiding scheduler runs async collectives. Kernels are the CPU-compiled
  ones (their bf16-to-f32 converts included);
* the same, with the collectives read as a GPU compiles them
  (``simulate(..., program_dtypes=True)``): every one XLA:CPU carries in float32 for bf16
  values priced at bf16, and every all-reduce XLA:CPU slices per device priced as the
  reduce-scatter it stands for.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import time

def workloads():
    """name -> (train step, ShapeDtypeStruct args, mesh): the wide BERT on (8,) and the GPT
    13B-like model (hidden 5120, 40 heads, sequence 2048) on (4, 2), two layers each."""
    from autopar.models import bert, gpt
    wide_bert = dataclasses.replace(bert.REALISTIC, vocab=16384, seq=512, hidden=4096,
                                    heads=32, layers=2, batch=8)
    gpt_13b = dataclasses.replace(gpt.REALISTIC, vocab=32768, seq=2048, hidden=5120, heads=40,
                                  layers=2, batch=8)
    return {"bert-wide": (*bert.make_train_step(wide_bert, abstract=True), {"model": 8}),
            "gpt-13b": (*gpt.make_train_step(gpt_13b, abstract=True), {"data": 4, "model": 2})}


def measure(name: str, overlap: bool, hardware: str = "h100") -> dict:
    """One workload planned with ``overlap``, compiled and simulated both ways."""
    import jax.numpy as jnp
    import autopar
    from autopar.cost_model.hardware import get_profile
    from autopar.cost_model.hlo_async import KINDS, as_async
    from autopar.cost_model.timeline import simulate
    fn, args, mesh = workloads()[name]
    profile = get_profile(hardware)
    start = time.perf_counter()
    plan = autopar.plan(fn, *args, mesh=mesh, hardware=profile, overlap=overlap, verbose=False)
    text = plan.compile().as_text()
    compiled = simulate(text, profile, jnp.bfloat16)
    scheduled = simulate(as_async(text), profile, jnp.bfloat16)
    native = simulate(as_async(text), profile, jnp.bfloat16, program_dtypes=True)
    kinds = re.findall(r"= \S+ (" + "|".join(KINDS) + r")\(", text)
    return {"workload": name, "overlap": overlap, "estimate_ms": plan.estimate.step_time_s * 1e3,
            "sim_ms": compiled.step_time_s * 1e3, "sim_exposed_ms": compiled.exposed_comm_s * 1e3,
            "async_ms": scheduled.step_time_s * 1e3,
            "async_exposed_ms": scheduled.exposed_comm_s * 1e3,
            "bf16_ms": native.step_time_s * 1e3, "bf16_exposed_ms": native.exposed_comm_s * 1e3,
            "rewrites": plan.stats["rewrites"],
            "collectives": {k: kinds.count(k) for k in sorted(set(kinds))},
            "seconds": time.perf_counter() - start}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="bert-wide,gpt-13b")
    parser.add_argument("--hardware", default="h100")
    options = parser.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if "device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    print("| workload | overlap | estimate ms | sim ms (exposed) | async sim ms (exposed) | "
          "async, bf16 collectives ms (exposed) | rewrites | collectives |")
    print("|---|---|---|---|---|---|---|---|")
    for name in options.workloads.split(","):
        for overlap in (False, True):
            r = measure(name, overlap, options.hardware)
            print(f"| {name} | {'on' if overlap else 'off'} | {r['estimate_ms']:.2f} | "
                  f"{r['sim_ms']:.2f} ({r['sim_exposed_ms']:.2f}) | {r['async_ms']:.2f} "
                  f"({r['async_exposed_ms']:.2f}) | {r['bf16_ms']:.2f} "
                  f"({r['bf16_exposed_ms']:.2f}) | {r['rewrites']} | {r['collectives']} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
