"""One plan on every process of a multi-process (multi-host) run.

Each process plans on its own, from the same program and arguments, and every process must
then compile the same SPMD program: a process whose collectives differ from the others' hangs
or computes garbage. Planning is deterministic given its inputs, but not every input is: HiGHS
may return a different one of equally good ILP solutions in another process, and each
process has its own plan cache. So process 0's plan is taken everywhere: its strategy choice
and rematerialized layers are broadcast, and a process that planned otherwise plans again
with them (the solve is skipped, as for a cached plan).

Planning can also fail on one process only (its own bad input, a plan cache it cannot read,
a bug). Before the broadcast, every process says whether it planned: when one did not, it
raises its own error and every other raises :class:`~autopar.errors.OtherProcessError`
naming it, instead of waiting in the broadcast until the distributed runtime times out.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import jax
import numpy as np

from autopar._plan import Plan
from autopar.errors import OtherProcessError


def process_0_plan(planned: Plan | None, replan: Callable[[list[int], dict | None], Plan],
                   progress=lambda msg: None, failure: Exception | None = None) -> Plan:
    """``planned`` when process 0 planned the same, else ``replan(choice, remat)`` with process
    0's choice and rematerialization. ``failure``: what this process's planning raised (then
    ``planned`` is None); it is raised here, and every other process raises
    :class:`OtherProcessError`. Every process must call it (it gathers and broadcasts); with
    one process it returns ``planned`` or raises ``failure``."""
    if jax.process_count() == 1:
        if failure is not None:
            raise failure
        return planned
    from jax.experimental import multihost_utils

    _raise_if_any_failed(failure, multihost_utils)

    _, _, choice, _ = planned._details
    mine = json.dumps({"choice": [int(c) for c in choice],
                       "remat": planned.stats["remat"]}).encode()
    length = int(multihost_utils.broadcast_one_to_all(np.int64(len(mine))))
    buffer = np.zeros(length, np.uint8)
    if jax.process_index() == 0:
        buffer[:] = np.frombuffer(mine, np.uint8)
    theirs = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer), np.uint8))
    if theirs == mine:
        return planned
    progress(f"process {jax.process_index()} planned otherwise than process 0: taking "
             "process 0's plan")
    chosen = json.loads(theirs)
    agreed = replan(chosen["choice"], chosen["remat"])
    agreed.stats["plan_from_process_0"] = True
    return agreed


def _raise_if_any_failed(failure: Exception | None, multihost_utils) -> None:
    """Every process's planning outcome, gathered: this process's ``failure`` is raised; when
    another process failed, :class:`OtherProcessError` with the first such process's error."""
    said = b"" if failure is None else f"{type(failure).__name__}: {failure}".encode()
    lengths = np.asarray(multihost_utils.process_allgather(np.int64(len(said)))).reshape(-1)
    if not lengths.any():
        return
    buffer = np.zeros(int(lengths.max()), np.uint8)
    buffer[:len(said)] = np.frombuffer(said, np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(buffer)).reshape(len(lengths), -1)
    if failure is not None:
        raise failure
    k = int(np.flatnonzero(lengths)[0])
    cause = bytes(everyone[k, :lengths[k]]).decode(errors="replace")
    raise OtherProcessError(
        f"planning failed on process {k} of {len(lengths)} ({cause}), so this process "
        f"({jax.process_index()}) stops too. Fix what process {k} reports; every process must "
        "call autopar.plan (or the parallelized step) with the same program, arguments and "
        "options.", k, cause)
