"""autopar._stack: planning runs below a frame large enough that CPython gives it a chunk of
the frame stack with room for the whole trace."""

import sys

import jax.numpy as jnp
import pytest

import autopar
from autopar import _stack


def _frames_of(code) -> int:
    frame, n = sys._getframe(), 0
    while frame is not None:
        n += frame.f_code is code
        frame = frame.f_back
    return n


def test_the_roomy_frame_is_more_than_half_its_chunk():
    code = _stack._roomy_call.__code__
    assert sys.implementation.name == "cpython"  # the interpreter this is about
    # CPython sizes a chunk by doubling from 16 KiB until it holds the frame: over half of
    # CHUNK_BYTES asks for the whole of it, and leaves room below.
    assert _stack.CHUNK_BYTES // 2 < code.co_nlocals * 8 < _stack.CHUNK_BYTES * 3 // 4


def test_with_roomy_stack_passes_arguments_results_and_errors():
    def f(a, *, b):
        if b is None:
            raise KeyError("no b")
        return a + b, _frames_of(_stack._roomy_call.__code__)

    wrapped = _stack.with_roomy_stack(f)
    assert wrapped.__name__ == "f"
    assert wrapped(1, b=2) == (3, 1)
    with pytest.raises(KeyError, match="no b"):
        wrapped(1, b=None)


def test_the_plan_traces_below_the_roomy_frame():
    seen = []

    def step(x):
        seen.append(_frames_of(_stack._roomy_call.__code__))
        return jnp.tanh(x) * 2.0

    autopar.plan(step, jnp.ones((8, 4)), mesh={"data": 8})
    assert seen and seen[0] == 1


def test_compare_traces_the_baselines_below_the_roomy_frame():
    seen = []

    def step(x):
        seen.append(_frames_of(_stack._roomy_call.__code__))
        return jnp.tanh(x) * 2.0

    autopar.compare(step, (jnp.ones((8, 4)),), {"data": 8}, kinds=("dp",))
    assert len(seen) >= 2 and min(seen) >= 1   # the plan's trace and the baseline's


def test_validate_compiles_below_the_roomy_frame(monkeypatch):
    plan = autopar.plan(lambda x: jnp.tanh(x) * 2.0, jnp.ones((8, 4)), mesh={"data": 8})
    seen, compile_plan = [], type(plan).compile

    def counted(self, *args, **kwargs):
        seen.append(_frames_of(_stack._roomy_call.__code__))
        return compile_plan(self, *args, **kwargs)

    monkeypatch.setattr(type(plan), "compile", counted)
    plan.validate()
    assert seen and seen[0] == 1
