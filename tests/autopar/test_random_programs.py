"""Random programs, planned end to end (hints, propagation, the ILP, emission), compute what
one device computes.

Each seed draws a program of 2-D tensors: matmuls with weights, elementwise ops, broadcast
biases, transposes, reshapes, concatenations, slices, softmax, mean-centring, a scanned layer
with stacked weights and a ``jax.checkpoint``-ed block, half of them differentiated (value
and gradient of a loss, as a train step is). Random hints on the
inputs make the plan split and reshard values even at these small shapes, where replicating
everything would otherwise be the fastest plan. The programs come from ``benchmarks/fuzz.py``,
whose suite (``python -m benchmarks.run --suite fuzz``) runs 300 of them, on sub-meshes and
with NamedSharding hints too; these are a sample of them."""

import warnings

import jax
import numpy as np
import pytest

import autopar
from autopar.errors import ShardingConflictWarning
from autopar.passes.estimate import value_specs
from autopar.errors import SolverFallbackWarning
from benchmarks.fuzz import MESHES, make_case, random_hints


@pytest.mark.parametrize("seed", range(40))
def test_random_program_matches_one_device(seed):
    fn, args = make_case(seed)
    mesh = MESHES[seed % len(MESHES)]
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverFallbackWarning)
        warnings.simplefilter("ignore", ShardingConflictWarning)  # random hints can disagree
        plan = autopar.plan(fn, *args, mesh=mesh, hardware="h100",
                            in_shardings=tuple(random_hints(args, mesh, seed)),
                            search=seed % 4 != 3)  # every fourth: propagation alone
    graph, strats, choice, _ = plan._details
    specs = value_specs(graph, strats, choice)
    assert any(spec.axes for spec in specs.values()), "the hints should split some values"
    got = jax.tree_util.tree_leaves(plan.jit()(*args))
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)


@pytest.mark.parametrize("seed", [4, 9])
def test_fuzz_suite_case_on_a_sub_mesh(seed):
    """The fuzz suite's own runner on its sub-mesh (4 of 8 devices), with PartitionSpec (even
    seed) and NamedSharding (odd) hints: equal to one device, its JSON loading back."""
    from benchmarks.fuzz import run_case
    row = run_case(seed)
    assert row["mesh"] == "4 of 8" and row["ok"], row.get("traceback", row)
