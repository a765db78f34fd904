"""The long-context suite: a Llama-like train step at sequence 8k, 32k and 128k.

    python -m benchmarks.run --suite long-context [--cases 32k-8,32k-2x4] [--hardware h100]

The step is the scanned NNX Llama of ``autopar.models.llama_nnx`` (GQA 32/8 heads, hidden
4096, SwiGLU 14336, vocabulary 32768, bfloat16, two layers to keep compiles affordable), its
loss marked with ``autopar.value_and_grad`` so that autopar recognizes the attention. Each
case compiles, from ShapeDtypeStruct arguments on simulated CPU devices, autopar's plan
(80 GB budget) and the hand-written programs: Megatron TP (+DP), FSDP, and the Ulysses and
ring context-parallel programs of ``autopar.baselines`` (``autopar._context_baselines``).
Each compiled program is priced on the hardware profile: its step time simulated over the
compiled text (``cost_model.timeline``), its wire bytes and compiled peak
(``autopar._compare.measure``), and the attention strategy it runs.
"""

from __future__ import annotations

import platform
import re
import time

import jax
import jax.numpy as jnp
import optax

import autopar
from autopar import baselines
from autopar._compare import compile_baseline, measure
from autopar._mesh import as_auto_mesh
from autopar._sizes import parse_bytes
from autopar.cost_model.hardware import get_profile
from autopar.cost_model.hlo import permute_loops
from autopar.models import common, llama_nnx

#: name -> (sequence, mesh axes, global batch)
CASES = {
    "8k-8": (8192, {"model": 8}, 1),
    "8k-2x4": (8192, {"data": 2, "model": 4}, 2),
    "32k-8": (32768, {"model": 8}, 1),
    "32k-2x4": (32768, {"data": 2, "model": 4}, 2),
    "128k-8": (131072, {"model": 8}, 1),
    "128k-2x4": (131072, {"data": 2, "model": 4}, 2),
}
DEVICES = 8
BUDGET = "80GB"
LAYERS = 2
BASELINES = ("megatron", "fsdp", "ulysses", "ring")


def config(seq: int, batch: int) -> llama_nnx.Config:
    return llama_nnx.Config(vocab=32768, seq=seq, hidden=4096, heads=32, kv_heads=8,
                            ffn=14336, layers=LAYERS, batch=batch, dtype=jnp.bfloat16,
                            scan_layers=True)


def train_step_and_args(seq: int, batch: int):
    """``(step, (state, opt_state, batch))``, every leaf a ShapeDtypeStruct."""
    c = config(seq, batch)
    graphdef, state = llama_nnx._split(c, abstract=True)
    tx = common.make_optimizer()
    loss = llama_nnx._loss_fn(graphdef)

    def step(params, opt_state, batch):
        value, grads = autopar.value_and_grad(loss)(params, batch)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt_state, value

    return step, (state, jax.eval_shape(tx.init, state), llama_nnx._batch(c, abstract=True))


def evidence(hlo_text: str) -> str:
    """What the compiled program shows of sequence-parallel attention."""
    a2a = len(re.findall(r"\ball-to-all(?:-start)?\(", hlo_text))
    loops = len(permute_loops(hlo_text))
    return f"{a2a} all-to-all, {loops} loop(s) of collective-permute"


def _row(compiled, profile, attention: str) -> dict:
    m = measure("", compiled, profile, jnp.bfloat16)
    return {"step_time_s": m.makespan_s, "wire_bytes": m.wire_bytes,
            "peak_memory_bytes": m.peak_memory_bytes,
            "fits": m.peak_memory_bytes <= parse_bytes(BUDGET),
            "attention": attention, "hlo": evidence(compiled.as_text())}


def _compile_baseline(name, fn, args, mesh):
    if name in ("ulysses", "ring"):
        return baselines.compile_context_baseline(fn, args, mesh, name)
    return compile_baseline(fn, args, mesh, name)


_BASELINE_ATTENTION = {"megatron": "heads (XLA)", "fsdp": "as XLA propagates",
                       "ulysses": "ulysses(cp)", "ring": "ring(cp)"}


def run_case(case: str, hardware: str = "h100", time_limit_s: float = 60.0, say=print) -> dict:
    seq, axes, batch = CASES[case]
    fn, args = train_step_and_args(seq, batch)
    mesh = as_auto_mesh(axes)
    profile = get_profile(hardware)
    start = time.perf_counter()
    plan = autopar.plan(fn, *args, mesh=mesh, hardware=profile, memory_budget=BUDGET,
                        check_memory=False, pipeline=None, time_limit_s=time_limit_s,
                        verbose=False)
    planning_s = time.perf_counter() - start
    labels = sorted(set(plan.stats["attention"]))
    programs = {"autopar": _row(plan.compile(), profile, "; ".join(labels) or "-")}
    say(f"{case}: autopar planned in {planning_s:.0f} s, {programs['autopar']}")
    for name in BASELINES:
        try:
            programs[name] = _row(_compile_baseline(name, fn, args, mesh), profile,
                                  _BASELINE_ATTENTION[name])
        except Exception as e:  # a baseline that cannot take the shape is a row, not a crash
            programs[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        say(f"{case}: {name} {programs[name]}")
    return {"case": case, "seq": seq, "mesh": axes, "batch": batch, "hardware": hardware,
            "planning_s": planning_s, "predicted_step_s": plan.estimate.step_time_s,
            "predicted_peak_bytes": plan.estimate.peak_memory_bytes, "programs": programs}


def table(rows: list[dict]) -> str:
    """A markdown table: every program of every case, autopar first."""
    lines = ["| case | program | step (ms) | autopar / program | wire (GiB) | peak (GiB) | "
             "fits 80 GB | attention | compiled HLO |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        mine = row["programs"]["autopar"]["step_time_s"]
        for name, m in row["programs"].items():
            if "error" in m:
                lines.append(f"| {row['case']} | {name} | - | - | - | - | - | - | {m['error']} |")
                continue
            lines.append(
                f"| {row['case']} | {name} | {m['step_time_s'] * 1e3:.1f} | "
                f"{mine / m['step_time_s']:.2f} | {m['wire_bytes'] / 2**30:.2f} | "
                f"{m['peak_memory_bytes'] / 2**30:.1f} | {'yes' if m['fits'] else 'no'} | "
                f"{m['attention']} | {m['hlo']} |")
    lines.append("")
    for row in rows:
        lines.append(f"- {row['case']}: seq {row['seq']}, mesh {row['mesh']}, batch "
                     f"{row['batch']}; planned in {row['planning_s']:.0f} s, predicted "
                     f"{row['predicted_step_s'] * 1e3:.1f} ms and "
                     f"{row['predicted_peak_bytes'] / 2**30:.1f} GiB")
    return "\n".join(lines)


def _header(hardware: str) -> str:
    """The committed file's title and how its numbers were made."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (
        "# Long-context suite\n\n"
        f"`python -m benchmarks.run --suite long-context` ({when}, jax {jax.__version__}, "
        f"Python {platform.python_version()}, {jax.device_count()} simulated CPU devices, priced "
        f"on the {hardware} profile). Scanned NNX Llama, GQA 32/8 heads, hidden 4096, SwiGLU "
        "14336, vocab 32768, bf16, 2 layers. Step time: the compiled program's simulated "
        "timeline (cost_model.timeline); peak: the compiled peak as XLA:CPU reports it "
        "(arguments + outputs + temporaries, nothing donated); fits: that peak within 80 GB. "
        f"autopar planned with memory_budget={BUDGET!r}.\n\n")


def main(cases: list[str], hardware: str, out: str) -> int:
    """Run ``cases`` (all when empty), print the table, write ``out/long_context.md`` and
    ``.json`` (after each case, so a long run keeps what it has)."""
    import json
    import os
    rows = []
    os.makedirs(out, exist_ok=True)
    for case in cases or list(CASES):
        start = time.perf_counter()
        rows.append(run_case(case, hardware))
        print(f"{case}: {time.perf_counter() - start:.0f} s", flush=True)
        with open(os.path.join(out, "long_context.md"), "w", encoding="utf-8") as f:
            f.write(_header(hardware) + table(rows) + "\n")
        with open(os.path.join(out, "long_context.json"), "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1, default=str)
    print("\n" + table(rows))
    return 0
