"""plan.to_python and `autopar export`: the plan as a standalone module that plain jax.jit runs.

The module gives only the shardings of the arguments and results; jax infers the rest. So a
plan is reproduced by plain jax.jit where the plan's intermediate shardings are those jax
infers, which ``plain_jit_check`` tells (the module says so when written with ``fn``), and
always for a plan made with ``exportable=True`` (what ``autopar export`` makes).
"""

import ast
import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autopar
from autopar.errors import PlanFormatError
from autopar._export import logical_rules, plain_jit_check
from autopar._sizes import format_bytes, format_seconds
from autopar.cost_model.hlo import analyze

from .export_target import mlp_step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESH = {"data": 2, "model": 4}


def _load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _imports(path) -> set[str]:
    tree = ast.parse(Path(path).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}


def _collectives(compiled):
    return sorted((c.kind.value, c.group_size, c.in_bytes, c.out_bytes, c.trip_count)
                  for c in analyze(compiled).collectives)


@pytest.fixture(scope="module")
def mlp_plan():
    step, args = mlp_step()
    return step, args, autopar.plan(step, *args, mesh=MESH, hardware="h100")


def test_exported_plan_runs_under_plain_jit_as_planned(mlp_plan, tmp_path):
    step, args, plan = mlp_plan
    path = tmp_path / "plan_specs.py"
    text = plan.to_python(path, fn=step)
    assert "plain jax.jit with these shardings compiles to the plan's collectives" in text
    assert not any(name.startswith("autopar") for name in _imports(path))
    specs = _load(str(path))
    assert specs.MESH == MESH
    assert specs.IN_SPECS[0]["w1"] == jax.sharding.PartitionSpec(None, "model")
    mesh = specs.make_mesh()
    plain = jax.jit(step, in_shardings=specs.in_shardings(mesh),
                    out_shardings=specs.out_shardings(mesh))
    assert _collectives(plain.lower(*args).compile()) == _collectives(plan.compile())
    assert len(_collectives(plan.compile())) >= 2   # Megatron: the plan communicates
    got = plain(*jax.device_put(args, specs.in_shardings(mesh)))
    want = plan.jit()(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_a_data_parallel_gpt_runs_under_plain_jit_as_planned(tmp_path):
    """Where every intermediate split follows from the arguments' (a data-parallel GPT), the
    exported shardings compile under plain jax.jit to the plan's collectives."""
    from dataclasses import replace

    from autopar.models import gpt
    config = replace(gpt.TINY, batch=64, seq=128, hidden=256)
    fn, args = gpt.make_train_step(config, abstract=True)
    plan = autopar.plan(fn, *args, mesh=MESH, hardware="h100", verbose=False)
    assert "batch over data(2) x model(4)" in plan.summary()
    text = plan.to_python(tmp_path / "gpt_specs.py", fn=fn)
    assert "compiles to the plan's collectives" in text
    specs = _load(str(tmp_path / "gpt_specs.py"))
    mesh = specs.make_mesh()
    plain = jax.jit(fn, in_shardings=specs.in_shardings(mesh),
                    out_shardings=specs.out_shardings(mesh))
    assert _collectives(plain.lower(*args).compile()) == _collectives(plan.compile())


def test_an_exportable_tensor_parallel_plan_is_what_plain_jit_compiles(tmp_path):
    """A tensor-parallel plan pins intermediate shardings that argument and result shardings
    cannot carry, so plain jax.jit compiles other collectives. With `exportable=True` the
    plan is the program plain jax.jit compiles from its shardings (the fastest of the
    searched plan's and the baselines' under plain jax.jit), and the module written from it
    compiles to the plan's collectives."""
    from autopar.models import targets
    fn, args = targets.gpt_realistic()
    kw = dict(mesh=MESH, hardware="h100", batch_axes=("data",), verbose=False)
    pinned = autopar.plan(fn, *args, pipeline=None, **kw)
    assert not plain_jit_check(pinned, fn)[0]   # the case `exportable` is for
    plan = autopar.plan(fn, *args, exportable=True, **kw)
    judged = plan.stats["exportable"]
    assert {"autopar", "dp", "fsdp", "megatron"} <= set(judged["step_s"])
    assert judged["step_s"][judged["chosen"]] == min(judged["step_s"].values())
    assert "Megatron TP over model(4)" in plan.summary()
    path = tmp_path / "tp_specs.py"
    assert "compiles to the plan's collectives" in plan.to_python(path, fn=fn)
    specs = _load(str(path))
    mesh = specs.make_mesh()
    plain = jax.jit(fn, in_shardings=specs.in_shardings(mesh),
                    out_shardings=specs.out_shardings(mesh))
    collectives = _collectives(plan.compile())
    assert _collectives(plain.lower(*args).compile()) == collectives
    assert collectives != _collectives(pinned.compile())
    report = plan.report()
    assert "Exportable (plain jax.jit" in report and "intermediate shardings pinned" in report
    kept_peak = format_bytes(judged["peak_bytes"][judged["chosen"]])
    assert f"compiled     peak memory {kept_peak} per device" in report
    kept_step = format_seconds(judged["step_s"][judged["chosen"]])
    assert f"compiled     step time {kept_step}, that program simulated" in report


def test_an_exportable_plan_computes_the_single_device_step():
    from autopar.models import gpt
    fn, args = gpt.make_train_step(gpt.TINY)
    plan = autopar.plan(fn, *args, mesh=MESH, hardware="h100", exportable=True, verbose=False)
    got, want = plan.jit()(*args), jax.jit(fn)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)
    # the module's check reads the plain program the choice compiled, as compiling it again
    # would say; another function is compiled afresh
    assert plan._plain_summary[0] is fn
    fresh = plain_jit_check(dataclasses.replace(plan, _plain_summary=None), fn)
    assert plain_jit_check(plan, fn) == fresh and fresh[0]


def test_exportable_refuses_what_plain_jit_cannot_run():
    step, args = mlp_step()
    with pytest.raises(autopar.ArgumentError, match="`exportable=True` plans without a pipeline"):
        autopar.plan(step, *args, mesh={"stage": 2, "data": 4}, exportable=True,
                     pipeline=autopar.Pipeline(axis="stage"))
    with pytest.raises(autopar.ArgumentError, match="`exportable` must be True or False"):
        autopar.plan(step, *args, mesh=MESH, exportable="yes")


def test_an_exportable_plan_over_the_budget_is_refused_or_warned(monkeypatch):
    """When no candidate's compiled peak fits: a given budget raises, the default one warns."""
    from autopar import _api
    real = _api._judge_plain
    def over(*a):
        judged, compiled = real(*a)
        return {name: (t, 10**15) for name, (t, _) in judged.items()}, compiled
    monkeypatch.setattr(_api, "_judge_plain", over)
    step, args = mlp_step()
    with pytest.raises(autopar.InfeasiblePlanError, match="no exportable plan fits"):
        autopar.plan(step, *args, mesh=MESH, hardware="h100", memory_budget="70GB",
                     exportable=True, verbose=False)
    with pytest.warns(autopar.MemoryBudgetWarning, match="the least compiled peak is"):
        plan = autopar.plan(step, *args, mesh=MESH, hardware="h100", exportable=True,
                            verbose=False)
    assert plan.stats["exportable"]["chosen"] in plan.stats["exportable"]["step_s"]


class _State(NamedTuple):   # defined in a test module: importable, so written as code
    w: jax.Array
    count: jax.Array


def test_named_tuples_are_written_as_code(tmp_path):
    def step(state, x):
        return _State(state.w - 0.1 * jnp.mean(x @ state.w), state.count + 1), jnp.sum(x)
    args = (_State(jnp.ones((64, 64)), jnp.zeros((), jnp.int32)), jnp.ones((64, 64)))
    plan = autopar.plan(step, *args, mesh=MESH, hardware="h100")
    path = tmp_path / "specs.py"
    text = plan.to_python(path)
    assert "_State(" in text and "IN_SPECS = " in text
    specs = _load(str(path))
    assert isinstance(specs.IN_SPECS[0], _State)
    out = jax.jit(step, in_shardings=specs.in_shardings(), out_shardings=specs.out_shardings())(
        *args)
    assert float(out[1]) == 64 * 64


def test_trees_not_writable_as_code_are_written_flat(tmp_path):
    class Local(NamedTuple):   # defined in a function: no import reaches it
        w: jax.Array

    def step(state, x):
        return Local(state.w * 2), x + 1
    args = (Local(jnp.ones((8, 8))), jnp.ones((8,)))
    plan = autopar.plan(step, *args, mesh=MESH, hardware="h100")
    path = tmp_path / "flat_specs.py"
    text = plan.to_python(path)
    assert "IN_SPECS_FLAT = [" in text and "# [0].w" in text
    # the usage its docstring shows passes the trees
    assert "in_shardings(mesh, like=args)" in text and "like=jax.eval_shape(step, *args)" in text
    specs = _load(str(path))
    with pytest.raises(TypeError, match="pass like="):
        specs.in_shardings()
    with pytest.raises(ValueError, match="leaves"):
        specs.in_shardings(like=(args[0],))
    run = jax.jit(step, in_shardings=specs.in_shardings(like=args),
                  out_shardings=specs.out_shardings(like=jax.eval_shape(step, *args)))
    np.testing.assert_array_equal(np.asarray(run(*args)[0].w), 2 * np.ones((8, 8)))


def test_cli_export_writes_the_module(tmp_path):
    out = tmp_path / "mlp_specs.py"
    target = os.path.join(os.path.dirname(os.path.abspath(__file__)), "export_target.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-m", "autopar.cli", "export", f"{target}:mlp_step",
                        "--mesh", "data=2,model=4", "--out", str(out), "--simulate-devices", "8",
                        "--hardware", "h100", "--quiet"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "hardware profile `h100`" in r.stdout.splitlines()[0]
    assert "w1: column-parallel over model(4)" in r.stdout and f"wrote {out}" in r.stdout
    assert "Checked when written: plain jax.jit with these shardings compiles to the plan's" \
        in r.stdout
    text = out.read_text()
    assert "MESH = {'data': 2, 'model': 4}" in text and "OUT_SPECS = " in text
    compile(text, str(out), "exec")


def test_check_says_when_plain_jit_differs(mlp_plan, monkeypatch):
    step, _, plan = mlp_plan
    from autopar import _export
    real = _export.analyze
    calls = []

    def fewer(compiled):   # the first compile is plain jax.jit's: pretend it lost a collective
        summary = real(compiled)
        calls.append(summary)
        if len(calls) == 1:
            return summary.__class__(**{**summary.__dict__,
                                        "collectives": summary.collectives[1:]})
        return summary
    monkeypatch.setattr(_export, "analyze", fewer)
    same, said = plain_jit_check(plan, step)
    assert not same and "other collectives than the plan" in said


def test_docstring_does_not_claim_the_plans_program_when_the_check_differs(
        mlp_plan, monkeypatch, tmp_path):
    step, _, plan = mlp_plan
    from autopar import _export
    real = _export.analyze
    calls = []

    def fewer(compiled):   # as in the test above: plain jax.jit's compile loses a collective
        calls.append(compiled)
        summary = real(compiled)
        if len(calls) == 1:
            return summary.__class__(**{**summary.__dict__,
                                        "collectives": summary.collectives[1:]})
        return summary
    monkeypatch.setattr(_export, "analyze", fewer)
    text = plan.to_python(tmp_path / "differs_specs.py", fn=step)
    assert "other collectives than the plan" in text
    opening = text.split("::")[0]
    assert "is the plan's" not in opening, opening
    assert "compute the same numbers" in opening and "collectives" in opening, opening


def test_optax_states_are_imported_by_their_public_names(tmp_path):
    import optax
    params = {"w": jnp.ones((64, 64))}
    opt = optax.adam(1e-3)

    def step(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    args = (params, opt.init(params), jnp.ones((16, 64)))
    plan = autopar.plan(step, *args, mesh=MESH, hardware="h100")
    path = tmp_path / "adam_specs.py"
    text = plan.to_python(path)
    assert "from optax import EmptyState" in text and "from optax import ScaleByAdamState" in text
    assert "optax._src" not in text, text
    specs = _load(str(path))
    assert isinstance(specs.IN_SPECS[1][0], optax.ScaleByAdamState)


@pytest.mark.parametrize("names, specs, rules, unclean", [
    ([["embed", "mlp"], ["mlp", "embed"]], [P(None, "model"), P("model")],
     [("embed", None), ("mlp", "model")], []),
    ([["embed", "mlp"], ["mlp", "embed"]], [P(None, "model"), P()], None, ["mlp"]),
    ([["batch", None]], [P(("data", "model"))], [("batch", ("data", "model"))], []),
    ([None, None], [P(), P()], None, []),
])
def test_logical_rules(names, specs, rules, unclean):
    assert logical_rules(names, specs) == (rules, unclean)


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        w1 = self.param("w1", nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                            ("embed", "mlp")), (64, 256))
        w2 = self.param("w2", nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                            ("mlp", "embed")), (256, 64))
        return jax.nn.relu(x @ w1) @ w2


def test_logical_axis_rules_from_flax_metadata(tmp_path):
    model, x = _Mlp(), jnp.ones((16, 64))
    params = model.init(jax.random.key(0), x)   # boxed: nn.LogicallyPartitioned

    def step(params, x):
        return jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
    rules = [("embed", None), ("mlp", "model")]
    plan = autopar.plan(step, params, x, mesh=MESH, hardware="h100", logical_axis_rules=rules)
    text = plan.to_python(tmp_path / "rules_specs.py")
    assert _load(str(tmp_path / "rules_specs.py")).LOGICAL_AXIS_RULES == rules, text


def test_exported_train_state_specs_compute_the_plans_numbers(tmp_path):
    """optax's NamedTuple states are written as code and rebuilt; plain jax.jit with the
    exported shardings computes what plan.jit() computes (whether or not it compiles to the
    same collectives: the module says which)."""
    from autopar.models import gpt
    fn, args = gpt.make_train_step(gpt.TINY)
    plan = autopar.plan(fn, *args, mesh=MESH, hardware="h100")
    path = tmp_path / "gpt_specs.py"
    text = plan.to_python(path, fn=fn)
    assert "ScaleByAdamState(" in text and "Checked when written" in text
    specs = _load(str(path))
    mesh = specs.make_mesh()
    plain = jax.jit(fn, in_shardings=specs.in_shardings(mesh),
                    out_shardings=specs.out_shardings(mesh))
    same = _collectives(plain.lower(*args).compile()) == _collectives(plan.compile())
    assert ("compiles to the plan's collectives" in text) == same
    got, want = plain(*jax.device_put(args, specs.in_shardings(mesh))), plan.jit()(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=1e-5)


def test_a_loaded_plan_says_how_to_run_it_and_its_module_does(tmp_path):
    """A plan loaded from JSON has no program: its error points at to_python, whose module
    (flat specs) runs the step with plain jax.jit given like=."""
    def step(w, x):
        return w - 0.1 * (x.T @ jnp.tanh(x @ w)), x + 1
    args = (jnp.ones((16, 32)), jnp.ones((8, 16)))
    plan = autopar.plan(step, *args, mesh=MESH, hardware="h100")
    plan.save(tmp_path / "plan.json")
    loaded = autopar.Plan.load(tmp_path / "plan.json")
    for method in (loaded.jit, loaded.compile, loaded.validate):
        with pytest.raises(PlanFormatError, match=rf"plan\.{method.__name__}\(\) needs the "
                           r"planned program.*to_python.*like=jax\.eval_shape\(fn, \*args\)"):
            method()
    loaded.to_python(tmp_path / "loaded_specs.py")
    specs = _load(str(tmp_path / "loaded_specs.py"))
    mesh = specs.make_mesh()
    run = jax.jit(step, in_shardings=specs.in_shardings(mesh, like=args),
                  out_shardings=specs.out_shardings(mesh, like=jax.eval_shape(step, *args)))
    for a, b in zip(run(*args), step(*args)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
