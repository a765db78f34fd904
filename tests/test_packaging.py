"""What `pip install .` puts on a user's machine: the `autopar` package alone, which works beside
a user project that has its own `passes/` and `examples/` packages."""

import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USER_STEP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import passes, examples
    assert passes.MINE and examples.MINE, "the user's own packages"
    import autopar
    def step(w, x):
        return jnp.tanh(x @ w).sum()
    w = jnp.ones((16, 16)); x = jnp.ones((8, 16))
    plan = autopar.plan(step, w, x, mesh={"data": 2, "model": 4}, hardware="cpu")
    got = plan.jit()(w, x)
    np.testing.assert_allclose(got, step(w, x), rtol=1e-5)
    print("planned from", autopar.__file__)
""")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out),
                        ROOT], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (path,) = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".whl")]
    return path


def test_wheel_installs_autopar_alone(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"autopar"}
    for module in ("autopar/passes/ir.py", "autopar/cost_model/hardware.py",
                   "autopar/models/gpt.py"):
        assert module in names


def test_user_project_with_its_own_passes_and_examples_plans(wheel, tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                        str(site), wheel], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    project = tmp_path / "project"
    for package in ("passes", "examples"):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text("MINE = True\n")
    (project / "train.py").write_text(USER_STEP)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(project), str(site)]),
               XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "train.py"], cwd=project, env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert f"planned from {site}" in r.stdout
