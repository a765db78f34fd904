"""Fixtures of the cost-model tests."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def sixteen_device_hlo() -> dict[str, str]:
    """Name -> compiled HLO text of the programs of ``sixteen_devices.py``, compiled on 16
    simulated CPU devices in a process of their own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-m", "tests.cost_model.sixteen_devices"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)
