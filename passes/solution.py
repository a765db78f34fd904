"""The plan a planning attempt takes: a strategy per node, how the solver ended, and where the
plan came from (the ILP, a propagation, a plan cache)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SolveStatus(enum.Enum):
    """How the ILP's solve ended (``passes.solve``). The values are what
    ``plan.stats["solver_status"]`` shows for the ILP's plan."""
    OPTIMAL = "optimal"          # proven optimal, within the solver's gap
    TIME_LIMIT = "time_limit"    # the best plan found in the time limit, not proven optimal
    WARM_START = "warm start"    # the warm start's plan: nothing better found in time
    DIVE = "dive"                # a dive's plan, not proven optimal: no MIP at this size
    GREEDY = "greedy"            # no plan found in time: the greedy plan
    NOT_RUN = "not run"          # no ILP ran (search=False, or a cached plan)


class Source(enum.Enum):
    """Where a plan came from."""
    ILP = "ilp"                  # the solve (passes.solve), whatever its status
    PROPAGATED = "propagated"    # a complete propagation (passes.gspmd): search=False's plan,
                                 # or a candidate predicted faster (passes.candidates.best_of)
    CACHED = "cached"            # a plan cache's choice


@dataclass
class Solution:
    choice: list[int]          # node -> chosen strategy index
    objective_us: float
    status: SolveStatus
    num_variables: int
    num_constraints: int
    solve_time_s: float
    edges_before: int = 0      # graph edges
    edges_after: int = 0       # edge classes the ILP prices (passes.dedup)
    memory_rows: int = 0       # liveness rows the memory budget needed (passes.memory_budget)
    fits_budget: bool = True   # False: no plan found fits the memory budget (this one ignores it)
    least_peak_bytes: float | None = None  # the least peak found, when the budget was refitted
    least_peak_choice: list[int] | None = None  # ... and its plan
    source: Source = Source.ILP
    candidate: str = ""        # a propagated plan's name (passes.candidates.candidate_starts)
    overlap_solves: int = 0    # solves that priced overlap (passes.solve._with_overlap)
    state_at_rest: int = 0     # state arrays kept in their update's sharding (passes.at_rest)
    rings_dropped: bool = False  # the plan found with rings charged in full was shorter (solve)

    @property
    def name(self) -> str:
        """The plan's name in messages and ``plan.stats``: the solver's status for the ILP's
        plan, the candidate's name for a propagated one, "cached" for a cached one."""
        if self.source is Source.ILP:
            return self.status.value
        if self.source is Source.PROPAGATED:
            return self.candidate
        return self.source.value
