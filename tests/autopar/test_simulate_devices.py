"""autopar.simulate_cpu_devices: effective before jax makes its devices, and says so after."""

import os
import subprocess
import sys

import pytest

CODE = """
import warnings
warnings.simplefilter("error")
import jax, autopar
{before}
try:
    took = autopar.simulate_cpu_devices(8)
    print(took, len(jax.devices("cpu")))
except autopar.HardwareWarning as w:
    print("warning:", w)
"""


@pytest.mark.parametrize("late", [False, True])
def test_simulated_devices_are_made_or_a_late_call_is_named(late):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    code = CODE.format(before="jax.devices()" if late else "")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    if late:
        assert done.stdout.startswith("warning:") and "too late" in done.stdout
        assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in done.stdout
    else:
        assert done.stdout.split() == ["True", "8"]
