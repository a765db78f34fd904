"""One plan on every process of a multi-process (multi-host) run.

Each process plans on its own, from the same program and arguments, and every process must
then compile the same SPMD program: a process whose collectives differ from the others' hangs
or computes garbage. Planning is deterministic given its inputs, but not every input is: HiGHS
may return a different one of equally good ILP solutions in another process, and each
process has its own plan cache. So process 0's plan is taken everywhere: its strategy choice
and rematerialized layers are broadcast, and a process that planned otherwise plans again
with them (the solve is skipped, as for a cached plan).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import jax
import numpy as np

from autopar._plan import Plan


def process_0_plan(planned: Plan, replan: Callable[[list[int], dict | None], Plan],
                   progress=lambda msg: None) -> Plan:
    """``planned`` when process 0 planned the same, else ``replan(choice, remat)`` with process
    0's choice and rematerialization. Every process must call it (it broadcasts); with one
    process it returns ``planned``."""
    if jax.process_count() == 1:
        return planned
    from jax.experimental import multihost_utils

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
