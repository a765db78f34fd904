"""One process of ``test_multiprocess.py``: ``python -m tests.autopar.multiprocess_worker PORT
PROCESS_ID``. Two such processes, 4 CPU devices each, form one 8-device mesh over gloo; each
plans a GPT train step on (2, 4), as it is and with every layer rematerialized, runs it on
global arrays, and checks the result against its own single-device run. Process 1's planner
is made to return another plan than process 0's: it must take process 0's, remat layers
included (``autopar._multiprocess``). Then planning is made to fail on process 1 only: both
processes must raise (process 0 an ``OtherProcessError``), not wait for each other. Exits
non-zero on any difference."""

import dataclasses
import hashlib
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np

PROCESSES = 2


def main(port: int, process_id: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=PROCESSES,
                               process_id=process_id)
    from jax.experimental import multihost_utils

    import autopar
    from autopar.models import gpt

    assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    fn, args = gpt.make_train_step(gpt.TINY)
    host = jax.tree_util.tree_map(np.asarray, args)
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), host)
    if process_id == 1:
        _take_the_slowest_candidate()
    mesh = {"data": 2, "model": 4}
    plan = autopar.plan(fn, *abstract, mesh=mesh, hardware="h100")
    # with every layer rematerialized: process 0's remat layers are taken too
    remat = autopar.plan(fn, *abstract, mesh=mesh, hardware="h100", remat="dots_saveable")
    for p in (plan, remat):
        # Process 1 planned otherwise, and took process 0's plan.
        assert p.stats.get("plan_from_process_0", False) == (process_id == 1)
        held = str(([s.spec for s in jax.tree_util.tree_leaves(p.in_shardings)],
                    p.stats["remat"])).encode()
        digests = multihost_utils.process_allgather(
            np.frombuffer(hashlib.sha256(held).digest(), np.uint8))
        assert (digests[0] == digests[1]).all(), "the processes hold different plans"
    assert remat.stats["remat"]["layers"]

    local = jax.local_devices()[0]
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*jax.device_put(host, local)))
    step = autopar.parallelize(fn, mesh=mesh, hardware="h100")
    for name, p, run in (("plan.jit()", plan, plan.jit()), ("remat", remat, remat.jit()),
                         ("parallelize", plan, step)):
        out = run(*_global(host, p.in_shardings))
        got = jax.tree_util.tree_leaves(multihost_utils.process_allgather(out, tiled=True))
        assert len(got) == len(expected), name
        for a, b in zip(got, expected):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5,
                                       err_msg=name)
    _planning_fails_on_process_1(fn, abstract, mesh, process_id)
    print(f"process {process_id}: ok", flush=True)


def _planning_fails_on_process_1(fn, abstract, mesh, process_id: int) -> None:
    """Planning raises on process 1 only: it raises its own error, and process 0 raises
    OtherProcessError naming it, rather than wait in the plan broadcast for ever."""
    import autopar
    from autopar import _api
    from autopar.errors import ArgumentError

    if process_id == 1:
        def broken(*args, **kwargs):
            raise ArgumentError("an argument only process 1 has")
        _api._plan_once = broken
    try:
        autopar.plan(fn, *abstract, mesh=mesh, hardware="h100")
    except autopar.OtherProcessError as e:
        assert process_id == 0 and e.process_index == 1, e
        assert "ArgumentError: an argument only process 1 has" in str(e), e
    except ArgumentError as e:
        assert process_id == 1 and "only process 1" in str(e), e
    else:
        raise AssertionError("planning failed on process 1, and this process planned")


def _global(host, shardings):
    """Global arrays of ``host`` (every process holds all of it) in ``shardings``."""
    leaves, tree = jax.tree_util.tree_flatten(host)
    return jax.tree_util.tree_unflatten(tree, [
        jax.make_array_from_callback(a.shape, s, lambda index, a=a: a[index])
        for a, s in zip(leaves, jax.tree_util.tree_leaves(shardings))])


def _take_the_slowest_candidate() -> None:
    """Make this process plan otherwise than the others: its planner returns the slowest of
    the propagated candidate plans instead of the best one."""
    from autopar.passes import candidates
    from autopar.passes.solution import Source
    best_of = candidates.best_of

    def slowest(solution, graph, strats, mesh, candidates, *rest):
        best, times, peaks = best_of(solution, graph, strats, mesh, candidates, *rest)
        name = max(candidates, key=times.get)
        return (dataclasses.replace(best, choice=candidates[name], source=Source.PROPAGATED,
                                    candidate=name), times, peaks)

    candidates.best_of = slowest


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
