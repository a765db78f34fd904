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


def test_two_processes_plan_and_run_one_step_as_one_device_does(tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    logs = [tmp_path / f"process_{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as out:  # a file, not a pipe: a full pipe would stall its process
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.autopar.multiprocess_worker", str(port), str(i)],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            p.kill()
    for i, (p, log) in enumerate(zip(procs, logs)):
        text = log.read_text()
        assert p.returncode == 0, f"process {i} failed:\n{text[-4000:]}"
        assert f"process {i}: ok" in text
