"""The CLI, driven as a user drives it: as a subprocess, and in-process (``cli.main``) for the
inputs it refuses (more in ``test_bad_inputs.py``)."""

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = os.path.join(ROOT, "examples", "report_targets.py")


def _run(*argv, env_extra=None):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "autopar.cli", *argv], check=False,
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def _said(stderr: str) -> list[str]:
    """stderr's lines but the progress lines (``[autopar   1.2s] ...``)."""
    return [line for line in stderr.strip().splitlines() if not line.startswith("[autopar ")]


def test_report_writes_json_and_html(tmp_path):
    out, page = tmp_path / "plan.json", tmp_path / "plan.html"
    # no --simulate-devices: with no GPU or TPU plugin for jax, the CLI simulates the mesh's
    r = _run("report", f"{TARGETS}:gpt_tiny", "--mesh", "data=2,model=4", "--json", str(out),
             "--html", str(page), "--quiet", "--validate")
    assert r.returncode == 0, r.stderr
    for section in ("Input shardings", "Validation", "Per layer", "block_1", "fsdp"):
        assert section in r.stdout, section
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.count("<svg") >= 4
    assert "block_0" in text and "PartitionSpec" in text
    assert "Validation: predicted beside compiled" in text   # --validate's results
    d = json.loads(out.read_text())
    assert {"mesh", "estimate", "in_shardings", "out_shardings"} <= set(d)
    assert d["stats"]["validation"]["by_kind"]
    assert d["mesh"] == {"axis_names": ["data", "model"], "axis_sizes": [2, 4],
                         "device_ids": list(range(8))}
    # the baselines it compared with are saved with it, and shown beside it when loaded
    import autopar
    assert set(d["stats"]["baselines"]) == {"dp", "fsdp"}
    loaded = autopar.Plan.load(out)
    shown = loaded.report()
    said = r.stdout[r.stdout.index("Beside hand-written baselines"):].split("\n\n")[0]
    assert said in shown and "XLA's all-reduce combiner" in shown   # --validate's too
    assert "fsdp" in loaded.to_html()


def test_show_explains_a_saved_plan_where_its_devices_are_not(tmp_path):
    """`autopar show` reads a plan saved on 8 devices in a process of one (no simulated
    devices asked), as on a laptop: the report, its mesh said to be elsewhere, and the HTML."""
    import jax.numpy as jnp

    import autopar
    path, page = tmp_path / "plan.json", tmp_path / "plan.html"
    plan = autopar.plan(lambda w, x: jnp.tanh(x @ w).sum(), jnp.ones((16, 16)),
                        jnp.ones((8, 16)), mesh={"data": 2, "model": 4}, hardware="h100")
    plan.save(path)
    r = _run("show", str(path), "--html", str(page))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("autopar plan on mesh data=2 x model=4 (8 devices, 7 of them not "
                               "in this process), hardware profile `h100`")
    assert "Input shardings" in r.stdout and _said(r.stderr) == []
    # the report it was saved with, but for where its devices are and the planner's times
    shown = r.stdout.split("\n\nwrote")[0].splitlines()
    made = plan.report().splitlines()
    assert "Collectives chosen" in r.stdout and len(shown) == len(made)
    assert [a for a, b in zip(shown, made) if a != b] == [shown[0], shown[-1]]
    assert page.read_text().startswith("<!DOCTYPE html>")
    # on the simulated devices it was planned on, its first line is the made plan's too
    here = _run("show", str(path), "--simulate-devices", "8")
    assert here.returncode == 0, here.stderr
    assert here.stdout.splitlines()[:-1] == made[:-1]
    bad = _run("show", str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and _said(bad.stderr) == [
        f"autopar: error: no plan file at `{tmp_path / 'missing.json'}`"]


@pytest.mark.parametrize("argv, message", [
    (["report", "nope.py:f", "--mesh", "data=8"], "no file `nope.py`"),
    (["report", f"{TARGETS}:missing", "--mesh", "data=8"],
     "has no `missing`; it should define a zero-argument function returning (fn, "
     "example_args_tuple); its zero-argument functions: gpt_pipelined, gpt_realistic, "
     "gpt_tiny, mlp_wide"),
    (["report", f"{TARGETS}:__all__", "--mesh", "data=8"], "not a function"),
    (["report", "autopar.models.targets:missing", "--mesh", "data=8"], "has no `missing`"),
    (["report", "autopar.models.targets:gpt", "--mesh", "data=8"],
     "`gpt` in `autopar.models.targets` is not a function"),
    (["export", f"{TARGETS}:gpt_tiny", "--mesh", "data=8", "--out", TARGETS],
     "names a file this command reads"),
    (["export", f"{TARGETS}:gpt_tiny", "--mesh", "data=8", "--out", "my-plan.py"],
     "must be a Python module to import: a `.py` file whose name is a Python identifier, "
     "such as my_plan.py"),
    (["export", f"{TARGETS}:gpt_tiny", "--mesh", "data=8", "--out", "plan.txt"],
     "such as plan.py"),
    (["report", f"{TARGETS}:gpt_tiny", "--mesh", "data=8", "--html", ""],
     "`--html` was given an empty path"),
    (["report", "no_such_module_here:f", "--mesh", "data=8"], "no file or module"),
    (["report", f"{TARGETS}:gpt_tiny", "--mesh", "data=64", "--simulate-devices", "8"],
     "xla_force_host_platform_device_count"),
    (["report", TARGETS, "--mesh", "data=8"], "must look like FILE.py:NAME"),
    (["report", f"{TARGETS}:gpt_tiny", "--mesh", "data=2,model"],
     "malformed mesh `data=2,model` at `model`"),
    (["report", f"{TARGETS}:gpt_tiny", "--mesh", "data=two"],
     "the size of axis `data` is `two`, not a whole number"),
    (["report", f"{TARGETS}:gpt_tiny", "--mesh", "data=2,data=4"], "give each axis once"),
    (["report", f"{TARGETS}:gpt_tiny", "--mesh", "data=8", "--hardware", "h999"],
     "unknown hardware"),
    (["report", f"{TARGETS}:gpt_tiny", "--mesh", "data=8", "--memory-budget", "12x"],
     "`12x` is not a size"),
    (["report", f"{TARGETS}:gpt_tiny", "--mesh", "data=8", "--time-limit", "0"],
     "not a positive number of seconds"),
    (["report", f"{TARGETS}:gpt_tiny", "--mesh", "data=2,model=4", "--memory-budget",
      "100KiB", "--simulate-devices", "8", "--no-baselines"],
     "no sharding plan fits `memory_budget` (CLI: `--memory-budget`) = 100.0 KiB"),
    (["report", f"{TARGETS}:gpt_pipelined", "--mesh", "stage=4,data=2", "--pipeline",
      "axis=stage,bogus=1"], "is not auto, off or pipeline fields"),
    (["report", f"{TARGETS}:gpt_pipelined", "--mesh", "stage=4,data=2", "--pipeline",
      "stage,microbatches=0"], "`0` is not an integer of at least 1"),
    (["report", f"{TARGETS}:gpt_pipelined", "--mesh", "stage=4,data=2", "--pipeline",
      "stage,batch_argnums=1+y"], "`y` is not an integer of at least 0"),
    (["report", f"{TARGETS}:gpt_pipelined", "--mesh", "stage=4,data=2", "--pipeline",
      "stage,schedule=2f2b", "--simulate-devices", "8"], "is not a schedule"),
    (["report", f"{TARGETS}:gpt_pipelined", "--mesh", "stage=4,data=2", "--pipeline",
      "axis=stage,schedule=1f1b,microbatches=8", "--simulate-devices", "8", "--no-baselines"],
     "leaves one example a microbatch"),
    (["report", f"{TARGETS}:gpt_pipelined", "--mesh", "stage=4,data=2", "--pipeline",
      "axis=stage,schedule=1f1b,microbatches=8", "--simulate-devices", "8", "--no-baselines"],
     "On one example: `gather` mixes examples"),
    (["report", f"{TARGETS}:gpt_tiny", "--mesh", "stage=4,data=2", "--pipeline", "stage",
      "--simulate-devices", "8", "--no-baselines"], "autopar.value_and_grad"),
])
def test_bad_input_exits_nonzero_without_traceback(argv, message, capsys):
    from autopar import cli
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's errors
        code = e.code
    err = capsys.readouterr().err
    assert code != 0
    assert message.lower() in err.lower(), err
    assert "Traceback" not in err


def test_report_plans_under_a_memory_budget(tmp_path):
    """``--memory-budget`` reaches the planner and the compiled memory check: the tiny GPT
    peaks at 2.7 MiB unconstrained, and under 2 MiB as compiled."""
    out = tmp_path / "plan.json"
    r = _run("report", "autopar.models.targets:gpt_tiny", "--mesh", "data=2,model=4",
             "--memory-budget", "2MiB", "--remat", "off", "--time-limit", "5", "--json", str(out),
             "--simulate-devices", "8", "--quiet", "--no-baselines")
    assert r.returncode == 0, r.stderr
    compiled = re.search(r"compiled +peak memory ([\d.]+) MiB per device", r.stdout)
    assert compiled and float(compiled.group(1)) <= 2.0, r.stdout
    assert json.loads(out.read_text())["estimate"]["peak_memory_bytes"] <= 2 * 2**20


def test_a_mesh_the_simulated_devices_do_not_fit_names_the_flag_to_change():
    """The CLI's own --simulate-devices set XLA_FLAGS: the fix is the flag, not XLA_FLAGS."""
    r = _run("report", f"{TARGETS}:gpt_tiny", "--mesh", "data=3", "--simulate-devices", "8")
    assert r.returncode == 2 and "--simulate-devices 3" in r.stderr, r.stderr
    assert "from XLA_FLAGS" not in r.stderr and len(_said(r.stderr)) == 1


def test_autopar_alone_shows_its_help_and_a_stray_flag_names_the_command_s(capsys):
    from autopar import cli
    assert cli.main([]) == 0
    assert "report" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli.main(["report", f"{TARGETS}:gpt_tiny", "--mesh", "data=8", "--bogus-flag"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.strip() == (
        "autopar: error: unrecognized arguments: --bogus-flag (see `autopar report --help`)")


def test_error_in_the_users_file_is_one_line(tmp_path, capsys):
    from autopar import cli
    bad = tmp_path / "broken.py"
    bad.write_text("raise ValueError('boom')\n")
    assert cli.main(["report", f"{bad}:f", "--mesh", "data=8"]) != 0
    err = capsys.readouterr().err
    assert "ValueError: boom" in err and "Traceback" not in err, err


@pytest.mark.parametrize("body,words", [
    # the user's own message runs over two lines
    ("def f():\n    raise ValueError('first line\\nsecond line')\n",
     "ValueError: first line second line"),
    # a leaf jax cannot trace: autopar's words, not jax's two-line ones
    ("import numpy as np\ndef f():\n    return (lambda x, s: x), (np.ones(8), np.array(['a']))\n",
     "example argument leaf `args[1]` is an array of dtype <U1"),
], ids=["a message over two lines", "a string array leaf"])
def test_an_error_that_spans_lines_is_one_line(tmp_path, capsys, body, words):
    from autopar import cli
    target = tmp_path / "target.py"
    target.write_text(body)
    assert cli.main(["report", f"{target}:f", "--mesh", "data=8"]) != 0
    err = capsys.readouterr().err
    assert words in err and len(_said(err)) == 1, err


def test_demo_trains_on_simulated_devices_and_points_at_real_hardware():
    r = _run("demo", "--no-baselines")
    assert r.returncode == 0, r.stderr
    assert re.search(r"\[autopar +[0-9.]+s\] solving the ILP", r.stderr)  # progress while planning
    steps = re.findall(r"step (\d): loss ([\d.]+) \(single device ([\d.]+)\), max parameter "
                       r"difference ([\d.e+-]+)", r.stdout)
    assert [s[0] for s in steps] == ["0", "1", "2"], r.stdout
    losses = [float(s[1]) for s in steps]
    assert losses[2] < losses[1] < losses[0]
    for _, loss, single, diff in steps:
        assert abs(float(loss) - float(single)) <= 2e-3 * float(single) and float(diff) < 1e-3
    assert "Per layer" in r.stdout and "autopar profile --mesh" in r.stdout
    assert "autopar.models.targets:gpt_realistic" in r.stdout
    assert "Warning" not in r.stderr, r.stderr   # the plan's own shardings, carried, are no conflict
    assert "batch over data(4)" in r.stdout and "axis names:" not in r.stdout  # names hold


def test_version():
    r = _run("--version")
    assert r.returncode == 0 and re.fullmatch(r"autopar \S+\n", r.stdout), (r.stdout, r.stderr)


def test_report_pipelines_the_marked_step_as_asked(tmp_path):
    """``--pipeline`` reaches the planner as an ``autopar.Pipeline``: the marked GPT's four
    scanned layers run as four 1F1B stages, and the compiled program holds the schedule's
    tick loops."""
    out = tmp_path / "plan.json"
    r = _run("report", f"{TARGETS}:gpt_pipelined", "--mesh", "stage=4,data=2", "--pipeline",
             "axis=stage,schedule=1f1b,microbatches=4", "--json", str(out),
             "--simulate-devices", "8", "--quiet", "--no-baselines", "--validate")
    assert r.returncode == 0, r.stderr
    assert "Pipeline over `stage`: 4 stages (layers 0, 1, 2, 3), 1f1b, 4 microbatches" in r.stdout
    ticks = re.search(r"pipeline tick loops +(\[[\d, ]+\]) +(\[[\d, ]+\])", r.stdout)
    assert ticks and ticks.group(1) == ticks.group(2), r.stdout
    assert json.loads(out.read_text())["pipeline"]["schedule"] == "1f1b"


@pytest.mark.parametrize("flags, pipeline, overlap", [
    ([], "auto", True),
    (["--pipeline", "off", "--no-overlap"], None, False),
    (["--pipeline", "none"], None, True),  # as pipeline=None
    (["--pipeline", "node,schedule=interleaved,virtual_stages=2"],
     {"axis": "node", "schedule": "interleaved", "virtual_stages": 2}, True),
    (["--pipeline", "node,batch_argnums=2+1"], {"axis": "node", "batch_argnums": (1, 2)}, True),
])
def test_report_passes_pipeline_and_overlap_to_plan(flags, pipeline, overlap, monkeypatch):
    """``--pipeline`` and ``--no-overlap`` become ``plan(pipeline=..., overlap=...)``."""
    import autopar
    from autopar import cli

    seen = {}

    def plan(*args, **kwargs):
        seen.update(kwargs)
        raise autopar.errors.ArgumentError("stop here")

    monkeypatch.setattr(autopar, "plan", plan)
    assert cli.main(["report", "autopar.models.targets:gpt_tiny", "--mesh", "data=8",
                     "--quiet", *flags]) == 2
    got = seen["pipeline"]
    if isinstance(pipeline, dict):
        assert got == autopar.Pipeline(**pipeline)
    else:
        assert got == pipeline
    assert seen["overlap"] is overlap


def test_an_unexpected_error_points_to_debug_only_without_it():
    from autopar.cli import _one_line
    error = RuntimeError("boom")
    assert "rerun with --debug" in _one_line(error)
    assert "rerun with --debug" not in _one_line(error, debug=True)
    assert "traceback is above" in _one_line(error, debug=True)


def test_autopar_s_warnings_are_one_line_once_on_the_command_line(capsys):
    import warnings

    from autopar import cli
    from autopar.errors import HardwareWarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with cli._warnings_as_lines(True):
            for _ in range(2):
                warnings.warn("a profile\n  measured elsewhere", HardwareWarning)
            with pytest.warns(UserWarning, match="not autopar's"):  # shown as Python shows it
                warnings.warn("not autopar's", UserWarning)
            warnings.warn("autopar: HiGHS stopped: raise `time_limit_s`", HardwareWarning)
    err = capsys.readouterr().err.splitlines()
    assert err == ["autopar: warning: HardwareWarning: a profile measured elsewhere",
                   # one "autopar:", and the flag beside the option
                   "autopar: warning: HardwareWarning: HiGHS stopped: raise `time_limit_s` "
                   "(CLI: `--time-limit`)"]


def test_a_budget_over_the_device_s_memory_is_one_warning_line_naming_the_flag():
    r = _run("report", f"{TARGETS}:gpt_tiny", "--mesh", "data=8", "--hardware", "t4",
             "--memory-budget", "1TiB", "--no-baselines", "--quiet")
    assert r.returncode == 0, r.stderr
    (warning,) = _said(r.stderr)
    assert warning.startswith("autopar: warning: MemoryBudgetWarning: the `memory_budget` "
                              "(CLI: `--memory-budget`) of 1.00 TiB is over t4's memory")


def test_errors_give_the_flag_beside_each_plan_option_they_suggest():
    from autopar import cli
    text = cli._with_flags('plan with `pipeline=None`, or `Pipeline(schedule="gpipe")`')
    assert text == ('plan with `pipeline=None` (CLI: `--pipeline off`), or '
                    '`Pipeline(schedule="gpipe")` (CLI: `schedule=gpipe` in `--pipeline`)')
    text = cli._with_flags("fits `memory_budget` = 1 B. Raise `memory_budget`.")
    assert text == "fits `memory_budget` (CLI: `--memory-budget`) = 1 B. Raise `memory_budget`."
    text = cli._with_flags("name them: `autopar.Pipeline(batch_argnums=...)`.")
    assert text == ("name them: `autopar.Pipeline(batch_argnums=...)` "
                    "(CLI: `batch_argnums=...` in `--pipeline`).")


def test_the_demo_s_advice_names_the_profile_it_ran_with():
    from autopar import cli
    hint = cli._real_hardware_hint("my_cluster.json", {"data": 4, "model": 2})
    assert "hardware='my_cluster.json'" in hint and "--hardware my_cluster.json" in hint
    assert hint.count("h100") == 1   # only among the built-in profiles


def test_logical_axis_rules_flag_parses_as_plan_takes_them():
    from autopar.cli import _logical_axis_rules_option
    assert _logical_axis_rules_option("batch=data, mlp=model,embed=none,heads=data+model") == [
        ("batch", "data"), ("mlp", "model"), ("embed", None), ("heads", ("data", "model"))]
    for bad in ("embed", "=data", "mlp=", "mlp=data+", "batch=data,"):
        with pytest.raises(argparse.ArgumentTypeError, match="batch=data,mlp=model"):
            _logical_axis_rules_option(bad)


_BOXED_TARGET = '''
import flax.linen as nn
import jax.numpy as jnp


def boxed():
    box = nn.LogicallyPartitioned(jnp.ones((16, 24)), ("embed", "mlp"))
    return (lambda p, x: jnp.tanh(x @ nn.unbox(p)["w"]).sum()), ({"w": box}, jnp.ones((8, 16)))
'''


def test_logical_axis_rules_flag_maps_a_flax_box_to_mesh_axes(tmp_path):
    """A box without rules is no hint, and the warning names the flag; with
    ``--logical-axis-rules`` the box is the hint the plan keeps."""
    (tmp_path / "boxed_target.py").write_text(_BOXED_TARGET)
    target = f"{tmp_path / 'boxed_target.py'}:boxed"
    bare = _run("report", target, "--mesh", "data=4,model=2", "--no-baselines", "--quiet")
    assert bare.returncode == 0, bare.stderr
    (warning,) = _said(bare.stderr)
    assert "UnusedAnnotationWarning" in warning and "`--logical-axis-rules" in warning
    out = tmp_path / "plan.json"
    ruled = _run("report", target, "--mesh", "data=4,model=2", "--no-baselines", "--quiet",
                 "--logical-axis-rules", "embed=none,mlp=model", "--json", str(out))
    assert ruled.returncode == 0, ruled.stderr
    assert _said(ruled.stderr) == []
    specs = {s["path"]: s["spec"] for s in json.loads(out.read_text())["in_shardings"]}
    assert specs["[0]['w'].value"] == [None, "model"], specs
