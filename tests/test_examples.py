"""Every example script plans its model at realistic size and runs 2 training steps of it at
toy size with those shardings, on 8 simulated CPU devices, as a user runs it
(``python examples/X.py --steps 2 --mesh data=2,model=4`` from the repository root)."""

import math
import os
import re
import subprocess
import sys
import tempfile

import pytest

from tests.compile_cache import cache_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("mlp", "gpt2", "llama", "moe", "resnet", "bert")
#: Examples whose realistic plan must shard weights (tensor or expert parallelism): at toy
#: size alone every weight is replicated, which shows nothing.
SHARDS_WEIGHTS = ("mlp", "gpt2", "llama", "moe", "bert")
_SHARDED = re.compile(r"parameters: (\d+) of (\d+) sharded")
_STEP = re.compile(r"^\s*step (\d+): loss (\S+)", re.MULTILINE)


def _run(*argv, timeout_s=300):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the script asks for its own simulated devices
    env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory(prefix="autopar-example-compiled-") as compiled:
        return subprocess.run([sys.executable, *argv], check=False, cwd=ROOT,
                              env={**env, **cache_env(compiled)}, capture_output=True,
                              text=True, timeout=timeout_s)


@pytest.mark.parametrize("name", SCRIPTS)
def test_example_trains_two_steps(name):
    done = _run(f"examples/{name}.py", "--steps", "2", "--mesh", "data=2,model=4")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "8 simulated CPU devices" in out, out
    assert "autopar plan: mesh {'data': 2, 'model': 4}, hardware profile `h100`" in out, out
    assert "At realistic size (planned from ShapeDtypeStructs" in out, out
    assert "data parallel (every weight replicated) would take" in out, out
    (big, _), (toy, _) = [(int(a), int(b)) for a, b in _SHARDED.findall(out)]
    if name in SHARDS_WEIGHTS:
        assert big > 0 and toy > 0, out
    losses = [float(loss) for _, loss in _STEP.findall(out)]
    assert len(losses) == 2, out
    assert all(math.isfinite(x) for x in losses), losses
    # One fixed batch: the optimizer must make progress on it.
    assert losses[1] < losses[0], losses


def test_example_rejects_a_mesh_that_does_not_fit():
    done = _run("examples/mlp.py", "--steps", "1", "--mesh", "data=3,model=4",
                "--simulate-devices", "8")
    assert done.returncode == 2
    assert "needs 12 devices" in done.stderr and "Traceback" not in done.stderr, done.stderr
