"""`autopar profile`, driven as a subprocess; its JSON feeds `autopar report --hardware`."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = os.path.join(ROOT, "examples", "report_targets.py")


def _run(*argv):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "autopar.cli", *argv], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=600)


def test_profile_writes_a_profile_that_report_accepts(tmp_path):
    out = tmp_path / "cpu.json"
    r = _run("profile", "--mesh", "data=2,model=4", "--out", str(out), "--simulate-devices", "8",
             "--min-bytes", "4096", "--max-bytes", "4194304", "--repeats", "3")
    assert r.returncode == 0, r.stderr
    assert "[10/10] collective-permute over `model`" in r.stderr  # progress
    doc = json.loads(out.read_text())
    assert len(doc["collective_fits"]) == 10
    r = _run("report", f"{TARGETS}:mlp_wide", "--mesh", "data=2,model=4", "--hardware", str(out),
             "--simulate-devices", "8", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "hardware profile `cpu-profiled`" in r.stdout


def test_profile_bad_inputs_exit_non_zero_without_traceback(tmp_path):
    cases = [
        (["--mesh", "data=2,model=oops", "--out", str(tmp_path / "p.json")], "mesh"),
        (["--mesh", "data=4,model=4", "--out", str(tmp_path / "p.json"),
          "--simulate-devices", "8"], "devices"),
        (["--mesh", "data=8", "--out", str(tmp_path / "no" / "p.json"),
          "--simulate-devices", "8"], "does not exist"),
    ]
    for argv, words in cases:
        r = _run("profile", *argv)
        assert r.returncode != 0, argv
        assert "Traceback" not in r.stderr, r.stderr
        assert words in r.stderr, r.stderr
