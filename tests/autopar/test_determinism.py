"""The same inputs give the same plan, byte for byte, on an idle machine and a busy one: the
solver is bounded by work, not wall time (``passes/highs.py``), and the plan file holds no
wall-clock timings."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp

import autopar

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: A memory budget makes the planner run the LP, penalized MIPs and MIPs under hard memory
#: rows (``passes/memory_fit.py``): every kind of solve a time limit could cut short.
WORKER = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import autopar
from autopar.models import mlp
fn, args = mlp.make_train_step(mlp.TINY)
mesh = {"data": 2, "model": 4}
# 27000 bytes: 60% of the plan without a budget (45516)
plan = autopar.plan(fn, *args, mesh=mesh, hardware="h100", check_memory=False, verbose=False,
                    memory_budget=27000)
assert plan.stats["memory_rows"] >= 1, "the budget should bind"
plan.save(sys.argv[1])
"""

BURNER = "while True: pass"


def _plan_in_a_process(path, busy: bool) -> bytes:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(
        (os.cpu_count() or 1) if busy else 0)]
    try:
        r = subprocess.run([sys.executable, "-c", WORKER, str(path)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert r.returncode == 0, r.stderr
    return path.read_bytes()


def test_same_plan_bytes_on_an_idle_and_a_busy_machine(tmp_path):
    idle = _plan_in_a_process(tmp_path / "idle.json", busy=False)
    busy = _plan_in_a_process(tmp_path / "busy.json", busy=True)
    assert idle == busy
    assert "timings_s" not in json.loads(idle)["stats"]


def test_timings_stay_on_the_plan_not_in_its_file(tmp_path):
    fn = lambda w, x: jnp.tanh(x @ w).sum()  # noqa: E731
    args = (jnp.ones((16, 16)), jnp.ones((8, 16)))
    first = autopar.plan(fn, *args, mesh={"data": 8}, hardware="h100")
    second = autopar.plan(fn, *args, mesh={"data": 8}, hardware="h100")
    assert first.stats["timings_s"]["total"] > 0
    first.save(tmp_path / "a.json")
    second.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert autopar.Plan.load(tmp_path / "a.json").to_json() == first.to_json()
