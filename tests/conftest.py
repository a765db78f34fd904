"""Test setup: 8 simulated CPU devices, strict jax config, and mesh fixtures."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from autopar._compat import xla_cpu_dots_in_f32  # noqa: E402
from tests.compile_cache import cache_settings  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

#: Each test process keeps every program it compiles in a persistent compilation cache of its
#: own (``tests.compile_cache``): the suite compiles many programs more than once (a plan's
#: compiled check and then its run, the one-device references), and compiling is a large part
#: of its time. pytest_unconfigure removes it; atexit too, for a process that does not run that
#: hook.
_COMPILED = tempfile.mkdtemp(prefix="autopar-tests-compiled-")
atexit.register(shutil.rmtree, _COMPILED, ignore_errors=True)
for _name, _value in cache_settings(_COMPILED).items():
    jax.config.update(_name, _value)


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


@pytest.fixture
def mesh_1d():
    return _mesh((8,), ("data",))


@pytest.fixture
def mesh_2d():
    return _mesh((2, 4), ("data", "model"))


@pytest.fixture
def mesh_3d():
    return _mesh((2, 2, 2), ("data", "model", "expert"))


@pytest.fixture
def make_mesh():
    return _mesh


#: Predictions calibrated on XLA:CPU 0.10.2's compiled programs that XLA:CPU 0.12 compiles
#: differently: a single-device bf16 GPT that peaks at 1.41 GB compiled against 1.10 GB
#: predicted (there, float32 copies of the MLP's bf16 cotangents feed the bias gradients'
#: reductions, which the memory model does not count). Known gaps on jax 0.12, marked strict:
#: each must still fail there.
KNOWN_GAPS_ON_JAX_0_12 = frozenset({
    "tests/passes/test_memory_compiled.py::test_single_device_peak_matches_compiled[bfloat16]",
})


def pytest_collection_modifyitems(config, items):
    if xla_cpu_dots_in_f32():   # jaxlib 0.10: the line these predictions are calibrated on
        return
    mark = pytest.mark.xfail(strict=True, reason="calibrated on XLA:CPU 0.10 (tests/conftest.py)")
    for item in items:
        if item.nodeid in KNOWN_GAPS_ON_JAX_0_12:
            item.add_marker(mark)


def pytest_unconfigure(config):
    """Removes this process's compilation cache (an xdist worker may end without atexit)."""
    shutil.rmtree(_COMPILED, ignore_errors=True)
