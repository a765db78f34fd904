"""The CLI's inputs, as a user gives them: `export` plans as `report` does, output paths and
device counts are checked before planning, and module targets import from the current folder.

Most cases run ``cli.main`` in-process with ``autopar.plan`` replaced, so that a check which
comes too late shows as a call to the planner."""

import errno
import os
import subprocess
import sys

import pytest

import autopar
from autopar import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = os.path.join(ROOT, "examples", "report_targets.py")
MLP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "export_target.py") + ":mlp_step"


def _cli(argv, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def planned(monkeypatch):
    """The calls made to ``autopar.plan`` (each refused, so a test never plans for long)."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(kwargs)
        raise RuntimeError("planning started")
    monkeypatch.setattr(autopar, "plan", refuse)
    return calls


# ----- export plans as report does
def test_export_takes_reports_planning_defaults():
    parser = cli.build_parser()
    common = [TARGETS + ":gpt_tiny", "--mesh", "data=2,model=4"]
    report = parser.parse_args(["report", *common])
    export = parser.parse_args(["export", *common, "--out", "specs.py"])
    for flag in ("hardware", "time_limit", "memory_budget", "simulate_devices"):
        assert getattr(export, flag) == getattr(report, flag), flag
    assert export.hardware is None and export.time_limit == 300


def test_export_help_shows_the_defaults(capsys):
    code, out, _ = _cli(["export", "--help"], capsys)
    out = " ".join(out.split())   # argparse wraps to the terminal's width
    assert code == 0
    assert "default 300" in out and "default: this backend's" in out, out


def test_export_refuses_a_negative_device_count(capsys):
    code, _, err = _cli(["export", MLP, "--mesh", "data=8", "--out", "specs.py",
                         "--simulate-devices", "-3"], capsys)
    assert code == 2 and "not an integer of at least 1" in err, err


def test_export_names_the_hardware_profile_and_where_it_wrote(tmp_path, capsys):
    out = tmp_path / "mlp_specs.py"
    code, stdout, err = _cli(["export", MLP, "--mesh", "data=2,model=4", "--out", str(out),
                              "--simulate-devices", "8", "--quiet"], capsys)
    assert code == 0, err
    assert "hardware profile `cpu` (the default, this backend's" in stdout.splitlines()[0]
    assert f"wrote {out}: run it with `import mlp_specs as plan; mesh = plan.make_mesh()" in stdout
    assert "on the `cpu` profile" in out.read_text()


# ----- output paths, before planning
_NO_PROC = pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc here")


@pytest.mark.parametrize("argv, words", [
    (["export", MLP, "--mesh", "data=8", "--out", "{tmp}"], "it is a folder"),
    (["report", MLP, "--mesh", "data=8", "--html", "{tmp}/plan.out", "--json", "{tmp}/plan.out"],
     "name the same file"),
    # root may write anywhere, except where the kernel says no
    pytest.param(["export", MLP, "--mesh", "data=8", "--out", "/proc/specs.py"],
                 "cannot write `--out /proc/specs.py`", marks=_NO_PROC),
    pytest.param(["report", MLP, "--mesh", "data=8", "--html", "/proc/x.html"],
                 "cannot write `--html /proc/x.html`", marks=_NO_PROC),
])
def test_output_paths_are_refused_before_planning(argv, words, tmp_path, planned, capsys):
    code, _, err = _cli([a.format(tmp=tmp_path) for a in argv], capsys)
    assert code == 2 and not planned, err
    assert words in err and "free space" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(str(tmp_path / "plan.out"))


def test_a_failed_write_advises_free_space_only_for_a_full_disk(monkeypatch):
    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr(cli, "open", fail, raising=False)
    said = {}
    for error in (OSError(errno.ENOSPC, "No space left on device"),
                  OSError(errno.EIO, "Input/output error")):
        with pytest.raises(autopar.errors.CLIError, match="--json") as e:
            cli.write_output("plan.json", "--json", "{}")
        said[error.errno] = str(e.value)
    assert "free space" in said[errno.ENOSPC], said
    assert "free space" not in said[errno.EIO] and "give another path" in said[errno.EIO], said


# ----- device counts
@pytest.mark.parametrize("argv, asked", [
    (["report", TARGETS + ":gpt_tiny", "--mesh", "data=2,model=4", "--simulate-devices", "8"],
     "--simulate-devices 8"),
    (["demo", "--no-baselines"], "the demo"),
])
def test_xla_flags_setting_another_device_count_is_named(argv, asked, monkeypatch, planned,
                                                         capsys):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    code, out, err = _cli(argv, capsys)
    assert code == 2 and not planned and not out, (out, err)
    assert asked in err and "XLA_FLAGS" in err and "=4" in err and "8" in err, err


# ----- targets
def test_a_module_target_imports_from_the_current_folder(tmp_path, monkeypatch, capsys):
    (tmp_path / "cwd_targets_for_cli.py").write_text(
        "import jax.numpy as jnp\n\n\n"
        "def ok():\n    return (lambda x: x * 2), (jnp.ones((8, 8)),)\n")
    monkeypatch.chdir(tmp_path)   # the console script's sys.path does not hold the folder
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p) != str(tmp_path)])
    code, out, err = _cli(["report", "cwd_targets_for_cli:ok", "--mesh", "data=8",
                           "--simulate-devices", "8", "--quiet", "--no-baselines"], capsys)
    assert code == 0, err
    assert "autopar plan on mesh data=8" in out


def test_a_missing_module_target_suggests_the_file_form(capsys):
    code, _, err = _cli(["report", "no_such_module_here:f", "--mesh", "data=8"], capsys)
    assert code == 2 and "no_such_module_here.py:f" in err, err


def test_a_directory_target_is_named_a_directory(capsys):
    code, _, err = _cli(["report", os.path.join(ROOT, "examples") + os.sep + ":gpt_tiny",
                         "--mesh", "data=8"], capsys)
    assert code == 2 and "is a directory" in err and "no file" not in err, err


# ----- small ones
def test_demo_checks_the_hardware_before_its_header(planned, capsys):
    code, out, err = _cli(["demo", "--hardware", "h1000"], capsys)
    assert code == 2 and not out and "unknown hardware 'h1000'" in err, (out, err)


def test_a_mesh_axis_of_size_zero_is_named(capsys):
    code, _, err = _cli(["report", TARGETS + ":gpt_tiny", "--mesh", "data=0"], capsys)
    assert code == 2 and "at least 1" in err and "malformed" not in err, err


def test_debug_keeps_the_exit_code_and_adds_the_traceback():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-m", "autopar.cli", "--debug", "report",
                        TARGETS + ":gpt_tiny", "--mesh", "data=8", "--hardware", "h999"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 2, r.stderr
    assert "Traceback" in r.stderr and "autopar: error: unknown hardware 'h999'" in r.stderr


def test_a_reader_closing_the_pipe_is_no_error():
    """`autopar report ... | head` stops reading early: no error line, the status a shell
    gives a program whose pipe closed."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    reader = subprocess.Popen([sys.executable, "-m", "autopar.cli", "report",
                               TARGETS + ":gpt_tiny", "--mesh", "data=8",
                               "--simulate-devices", "8", "--quiet"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                              env=env)
    reader.stdout.close()   # as `| true` does: nothing reads what it prints
    _, err = reader.communicate(timeout=600)
    assert reader.returncode == 141, err.decode()
    assert b"error" not in err
