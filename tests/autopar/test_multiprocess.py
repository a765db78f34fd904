"""Multi-process (multi-host) use: two processes of 4 CPU devices each, joined over gloo by
``jax.distributed``, plan one train step on their 8-device mesh and run it on global arrays,
through ``plan.jit()`` and ``autopar.parallelize`` (``multiprocess_worker.py``)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_plan_and_run_one_step_as_one_device_does():
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.autopar.multiprocess_worker",
                               str(port), str(i)], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
        assert f"process {i}: ok" in out
