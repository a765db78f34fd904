"""Collective overlap: the simulated step of autopar's compiled plan with overlap on and off.

``python -m benchmarks.overlap`` plans and compiles (from ShapeDtypeStructs, nothing runs) a
wide BERT on an 8-way model axis and a GPT 13B-like model on (4, 2), each with
``overlap=True`` and ``overlap=False``, and prints per program: autopar's estimate, the
rewrites taken, the compiled collectives, and the simulated timeline on the h100 profile
(``cost_model.timeline.simulate``) read two ways:

* as compiled: XLA:CPU compiles every collective synchronously, so the simulation holds
  compute while any collective runs, and nothing overlaps;
* as a GPU schedules it (:func:`as_async`): every collective split into a start, issued as
  soon as its operands are ready, and a done, waited for at its first use, as XLA:GPU's
  latency-hiding scheduler runs async collectives. Kernels are the CPU-compiled ones (their
  bf16-to-f32 converts included).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import time

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_LINE = re.compile(r"^(?P<indent>\s*)(?P<root>ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<rest>.*)$")


def _collective(rest: str):
    """(result type, opcode, the text after the opcode) of a synchronous collective, or None."""
    from autopar.cost_model.hlo_ir import split_type
    result_type, after = split_type(rest)
    opcode = after.split("(", 1)[0].strip()
    if opcode not in _KINDS:
        return None
    return result_type, opcode, after[after.index("(") + 1:]


def _uses(rest: str, name: str) -> bool:
    return re.search(rf"%{re.escape(name)}\b(?![.\-\w])", rest) is not None


def as_async(hlo_text: str) -> str:
    """``hlo_text`` with every synchronous collective made an async start/done pair: the
    start right after its operands' producers, the done right before its first user."""
    out, block = [], None
    for line in hlo_text.splitlines():
        if block is None:
            out.append(line)
            if line.rstrip().endswith("{") and not line.startswith("HloModule"):
                block = []
            continue
        if line.strip() == "}":
            out += _reorder(block)
            out.append(line)
            block = None
        else:
            block.append(line)
    return "\n".join(out) + "\n"


def _reorder(lines: list[str]) -> list[str]:
    """One computation's lines, its collectives split into starts and dones (see
    :func:`as_async`), ordered by (position, order made)."""
    keyed, defined = [], {}  # (position, seq, line); name -> position of its definition
    for i, line in enumerate(lines):
        m = _LINE.match(line)
        found = m and _collective(m["rest"])
        if not found:
            keyed.append((float(i), len(keyed), line))
            if m:
                defined[m["name"]] = float(i)
            continue
        result_type, opcode, tail = found
        name, indent = m["name"], m["indent"]
        operands = tail.split(")", 1)[0]
        ready = max((k for n, k in defined.items() if _uses(operands, n)), default=-1.0)
        users = [j for j in range(i + 1, len(lines)) if _uses(lines[j].split("=", 1)[-1], name)]
        done_at = (users[0] if users else len(lines)) - 0.5
        start_type = result_type if opcode == "all-reduce" else f"({result_type}, {result_type})"
        keyed.append((ready + 0.25, len(keyed),
                      f"{indent}%{name}.start = {start_type} {opcode}-start({tail}"))
        keyed.append((done_at, len(keyed), f"{indent}{m['root'] or ''}%{name} = "
                                           f"{result_type} {opcode}-done(%{name}.start)"))
        defined[name] = done_at
    return [line for _, _, line in sorted(keyed)]


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
    from autopar.cost_model.timeline import simulate
    fn, args, mesh = workloads()[name]
    profile = get_profile(hardware)
    start = time.perf_counter()
    plan = autopar.plan(fn, *args, mesh=mesh, hardware=profile, overlap=overlap, verbose=False)
    text = plan.compile().as_text()
    compiled = simulate(text, profile, jnp.bfloat16)
    scheduled = simulate(as_async(text), profile, jnp.bfloat16)
    kinds = re.findall(r"= \S+ (" + "|".join(_KINDS) + r")\(", text)
    return {"workload": name, "overlap": overlap, "estimate_ms": plan.estimate.step_time_s * 1e3,
            "sim_ms": compiled.step_time_s * 1e3, "sim_exposed_ms": compiled.exposed_comm_s * 1e3,
            "async_ms": scheduled.step_time_s * 1e3,
            "async_exposed_ms": scheduled.exposed_comm_s * 1e3,
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
          "rewrites | collectives |")
    print("|---|---|---|---|---|---|---|")
    for name in options.workloads.split(","):
        for overlap in (False, True):
            r = measure(name, overlap, options.hardware)
            print(f"| {name} | {'on' if overlap else 'off'} | {r['estimate_ms']:.2f} | "
                  f"{r['sim_ms']:.2f} ({r['sim_exposed_ms']:.2f}) | {r['async_ms']:.2f} "
                  f"({r['async_exposed_ms']:.2f}) | {r['rewrites']} | {r['collectives']} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
