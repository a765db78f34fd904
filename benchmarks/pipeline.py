"""The pipeline suite: does ``pipeline="auto"`` pipeline where it pays, and beat the
hand-written plans that do not?

A scanned GPT of about 26B parameters (hidden 8192, 32 layers, bf16 compute) with a global
batch of eight sequences of 1024 tokens, compiled from ``ShapeDtypeStruct`` arguments on
simulated CPU devices, in two cases:

* ``two-node``: ``{"node": 2, "gpu": 8}`` on the ``h100`` profile with ``node`` on InfiniBand
  (16 devices);
* ``one-node``: ``{"data": 2, "model": 4}`` (8 devices, all NVLink).

Each case plans with ``pipeline="auto"`` and compiles that plan, the plan it did not choose
(``pipeline=None`` when it pipelined, else a pipeline over the axis its search predicted
fastest) and the hand-written baselines (:func:`baseline_specs`). Every
program is priced from its compiled HLO by the simulated timeline
(``cost_model.timeline.simulate``: every kernel at its roofline, loops at their trip counts,
each collective on the link level its device groups cross); ``reference_s`` is the sum of
flops and collectives ``autopar.compare`` reports, which counts a loop body's flops once
(XLA's cost analysis does). Each program is priced twice: with its collectives as XLA:CPU
compiled them (16-bit floats widened to float32) and as a GPU compiles them
(``step_program_dtypes_s``: at the program's own dtypes, and each all-reduce XLA:CPU slices
per device as the reduce-scatter it stands for). A pipelined row also
gives the predicted bubble beside the schedule's formula and the predicted per-stage peak.

    python -m benchmarks.run --suite pipeline [--cases two-node,one-node]
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar import baselines
from autopar._compare import measure
from autopar._judge import simulated_step_s
from autopar.cost_model.hardware import get_profile
from autopar.models import common, gpt
from autopar.passes.stages.schedules import Schedule, bubble_fraction

#: The model: about 26B parameters.
CONFIG = gpt.Config(vocab=32768, seq=1024, hidden=8192, heads=64, layers=32, batch=8,
                    dtype=jnp.bfloat16, scan_layers=True)

#: name -> (mesh axes, axis_level_overrides)
CASES = {
    "two-node": ({"node": 2, "gpu": 8}, {"node": "infiniband"}),
    "one-node": ({"data": 2, "model": 4}, None),
}
DEVICES = 16   # the suite's process simulates this many (the largest case)


def train_step_and_args(config: gpt.Config = CONFIG):
    """(train_step, abstract (params, opt_state, batch)); the step marks its loss with
    ``autopar.value_and_grad``."""
    tx = common.make_optimizer()
    _, args = gpt.make_train_step(config, abstract=True, tx=tx)
    loss_fn = gpt._loss_fn(config)

    def train_step(params, opt_state, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt_state, loss

    return train_step, args


def make_mesh(axes: dict[str, int]) -> Mesh:
    n = int(np.prod(list(axes.values())))
    return Mesh(np.array(jax.devices()[:n]).reshape(tuple(axes.values())), tuple(axes),
                axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def baseline_specs(args, mesh: Mesh) -> dict[str, tuple]:
    """Hand-written plans that do not pipeline, as input PartitionSpecs: on a mesh with a
    ``node`` axis, data parallel over nodes with FSDP or Megatron over ``gpu`` inside, and FSDP
    over all devices; else :func:`autopar.baselines.baseline_kinds`' own."""
    names = mesh.axis_names
    if "node" not in names:
        return {kind: baselines.baseline_shardings(kind, args, mesh,
                                                   **baselines.baseline_kwargs(mesh, kind))
                for kind in baselines.baseline_kinds(mesh, args)}
    # eight sequences do not split 16 ways: the FSDP plans split the batch over nodes and
    # each sequence's tokens over the GPUs of a node
    tokens = jax.tree.map(lambda _: P("node", "gpu"), args[-1])
    inside = baselines.baseline_shardings("fsdp", args, mesh, batch_axes=("gpu",))
    every = baselines.baseline_shardings("fsdp", args, mesh, batch_axes=tuple(names))
    return {
        "dp(node)+fsdp(gpu)": (*inside[:-1], tokens),
        "dp(node)+megatron(gpu)": baselines.baseline_shardings(
            "megatron", args, mesh, batch_axes=("node",), model_axis="gpu"),
        "fsdp(all)": (*every[:-1], tokens),
    }


def _compile_specs(fn, args, mesh, specs):
    named = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                         is_leaf=lambda s: isinstance(s, P))
    outs = (named[0], named[1], NamedSharding(mesh, P()))
    return jax.jit(fn, in_shardings=named, out_shardings=outs).lower(*args).compile()


def _row(name, compiled, profile) -> dict:
    """``compiled``'s measures; ``step_program_dtypes_s`` is its simulated step with the
    collectives read as a GPU compiles them (``simulate(..., program_dtypes=True)``): what
    ``pipeline="auto"`` judges candidates by (``autopar._judge``)."""
    m = measure(name, compiled, profile, jnp.bfloat16)
    return {"step_time_s": m.makespan_s, "exposed_comm_s": m.exposed_comm_s,
            "step_program_dtypes_s": simulated_step_s(compiled, profile, jnp.bfloat16),
            "reference_s": m.step_time_s, "wire_bytes": m.wire_bytes,
            "peak_memory_bytes": m.peak_memory_bytes, "fits": m.fits(profile)}


def run_case(case: str, hardware: str = "h100", time_limit_s: float = 60.0) -> dict:
    """Plan, compile and price one case (see the module docstring)."""
    axes, overrides = CASES[case]
    fn, args = train_step_and_args()
    mesh = make_mesh(axes)
    profile = get_profile(hardware)
    kw = dict(mesh=mesh, hardware=profile, axis_level_overrides=overrides,
              time_limit_s=time_limit_s, verbose=False)
    start = time.perf_counter()
    auto = autopar.plan(fn, *args, pipeline="auto", **kw)
    planning_s = time.perf_counter() - start
    programs = {"autopar": _row("autopar", auto.jit().lower(*args).compile(), profile)}
    pipelined = ("autopar", auto) if auto.pipeline is not None else None
    other = _other_choice(auto)
    if other is not None:
        name, option = other
        alternative = autopar.plan(fn, *args, pipeline=option, **kw)
        programs[name] = _row(name, alternative.jit().lower(*args).compile(), profile)
        if alternative.pipeline is not None:
            pipelined = (name, alternative)
    for name, specs in baseline_specs(args, mesh).items():
        programs[name] = _row(name, _compile_specs(fn, args, mesh, specs), profile)
    row = {"case": case, "mesh": axes, "overrides": overrides, "planning_s": planning_s,
           "predicted_step_s": auto.estimate.step_time_s, "pipeline": auto.pipeline,
           "pipeline_search": auto.stats.get("pipeline_search"),
           "pipeline_search_compiled": auto.stats.get("pipeline_search_compiled"),
           "programs": programs}
    if auto.pipeline is not None:
        row["bubble_formula"] = _formula(auto.pipeline)
    if pipelined is not None:   # the pipelined program, chosen or not
        name, plan = pipelined
        row["pipelined"] = {"program": name, "pipeline": plan.pipeline,
                            "bubble_formula": _formula(plan.pipeline)}
    return row


def _formula(pipeline: dict) -> float:
    return bubble_fraction(Schedule(pipeline["schedule"]), pipeline["stages"],
                           pipeline["microbatches"])


def _other_choice(auto) -> tuple[str, object] | None:
    """The program ``pipeline="auto"`` did not choose, as (row name, ``pipeline=`` option):
    no pipeline when it pipelined, else the pipeline over the axis its search predicted
    fastest (None when it tried none)."""
    if auto.pipeline is not None:
        return "autopar (no pipeline)", None
    tried = {axis: s for axis, s in (auto.stats.get("pipeline_search") or {}).items()
             if axis != "none"}
    if not tried:
        return None
    axis = min(tried, key=tried.get)
    return f"autopar (pipelined over {axis})", autopar.Pipeline(axis=axis)


def _ms(t) -> str:
    """A candidate's step time in ms, or why it could not pipeline."""
    return t if isinstance(t, str) else f"{t * 1e3:.1f} ms"


def table(rows: list[dict]) -> str:
    """A markdown table: each program's compiled step time and its ratio to autopar's, with
    the collectives as XLA:CPU compiled them (16-bit floats widened to float32) and at the
    program's own dtypes."""
    lines = ["| case | program | step (ms) | autopar / program | at bf16 collectives (ms) "
             "| autopar / program | peak (GiB) | fits |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        mine = row["programs"]["autopar"]
        for name, m in row["programs"].items():
            widened, native = m["step_time_s"], m["step_program_dtypes_s"]
            lines.append(f"| {row['case']} | {name} | {widened * 1e3:.1f} | "
                         f"{mine['step_time_s'] / widened:.3f} | {native * 1e3:.1f} | "
                         f"{mine['step_program_dtypes_s'] / native:.3f} | "
                         f"{m['peak_memory_bytes'] / 2**30:.1f} | {'yes' if m['fits'] else 'no'} |")
    lines.append("")
    for row in rows:
        compiled = row.get("pipeline_search_compiled") or {}
        search = ", ".join(
            f"{name} {_ms(t)}" + (f" (compiled {_ms(compiled[name])})" if name in compiled else "")
            for name, t in (row["pipeline_search"] or {}).items())
        chose = ("no pipeline" if row["pipeline"] is None
                 else f"pipeline over `{row['pipeline']['axis']}`")
        lines.append(f"- {row['case']}: autopar chose {chose}; candidates predicted: {search}; "
                     f"planned in {row['planning_s']:.1f} s")
        if row.get("pipelined"):
            q = row["pipelined"]
            p, peak = q["pipeline"], row["programs"][q["program"]]["peak_memory_bytes"]
            lines.append(
                f"  - {q['program']}: {p['stages']} stages, {p['microbatches']} microbatches, "
                f"{p['schedule']}; predicted bubble {p['bubble_fraction']:.3f} (formula "
                f"{q['bubble_formula']:.3f}); per-stage peak "
                f"{', '.join(f'{b / 2**30:.1f}' for b in p['stage_peak_bytes'])} GiB predicted, "
                f"{peak / 2**30:.1f} GiB compiled")
    return "\n".join(lines)
