"""The memory budget checked against what XLA compiled, not only against autopar's prediction.

The memory model (``cost_model.memory``) predicts the per-device peak; XLA's buffer
assignment decides it. Where the two differ, a plan predicted to fit can compile over the
budget. :func:`check_compiled_memory` compiles the plan from abstract arguments (nothing runs),
reads the peak XLA reports, and when it is over the budget, plans again under a budget lowered
by the miss (the predicted peak scaled by budget / compiled peak), a few times, before giving
up with an ``InfeasiblePlanError`` that says both numbers.
"""

from __future__ import annotations

from collections.abc import Callable

from autopar._plan import Plan
from autopar._sizes import format_bytes
from autopar.errors import InfeasiblePlanError
from autopar.cost_model.hlo import compiled_peak_bytes

#: Plans made again under a lowered budget after the first one compiles over the budget.
CHECK_MEMORY_ROUNDS = 2
#: How far under the budget, as a fraction of it, a lowered budget aims the compiled peak.
CHECK_MEMORY_MARGIN = 0.02


def compiled_peak(plan: Plan) -> int:
    """Per-device peak bytes of ``plan``'s program as XLA compiles it for the plan's devices."""
    platform = plan.mesh.devices.flat[0].platform
    return compiled_peak_bytes(plan.compile().memory_analysis(), platform)


def _mib(n: float) -> str:
    return format_bytes(n)


def check_compiled_memory(plan: Plan, budget_bytes: float,
                          replan: Callable[[float], Plan], progress) -> Plan:
    """``plan``, or one made by ``replan(lowered budget)``, whose compiled peak fits
    ``budget_bytes``. Each round's (budget planned under, predicted peak, compiled peak) goes
    to ``stats["memory_checks"]`` of the plan returned. InfeasiblePlanError when none fits."""
    target, rounds = float(budget_bytes), []
    while True:
        progress(f"compiling the plan to check its memory (predicted peak "
                 f"{_mib(plan.estimate.peak_memory_bytes)})")
        compiled = compiled_peak(plan)
        rounds.append({"target_bytes": target, "predicted_bytes": plan.estimate.peak_memory_bytes,
                       "compiled_bytes": compiled})
        plan.stats["memory_checks"] = list(rounds)
        if compiled <= budget_bytes:
            return plan
        said = "; ".join(f"planned under {_mib(r['target_bytes'])}: predicted "
                         f"{_mib(r['predicted_bytes'])}, compiled {_mib(r['compiled_bytes'])}"
                         for r in rounds)
        if len(rounds) > CHECK_MEMORY_ROUNDS:
            raise _over(budget_bytes, said, "", rounds)
        # Aim the prediction where it compiles under the budget, if XLA keeps as much more
        # as this time. (Scaling the target the plan was made under instead left a plan
        # predicted well under it unchanged: scanned GPT, 12.05 MiB budget, 10.1 predicted,
        # 12.2 compiled, three rounds of the same plan.)
        target = (budget_bytes * plan.estimate.peak_memory_bytes / compiled
                  * (1 - CHECK_MEMORY_MARGIN))
        progress(f"XLA compiled the plan to {_mib(compiled)} per device, over the budget of "
                 f"{_mib(budget_bytes)}: planning again under {_mib(target)}")
        try:
            plan = replan(target)
        except InfeasiblePlanError as err:
            raise _over(budget_bytes, said, f" No plan fits the lowered budget either: {err}",
                        rounds) from err


def _over(budget_bytes: float, said: str, more: str, rounds: list) -> InfeasiblePlanError:
    """The error, with the rounds checked as its ``memory_checks``."""
    predicted_fit = all(r["predicted_bytes"] <= budget_bytes for r in rounds)
    why = (f", though they fit it as autopar predicts memory ({said}; XLA's buffer assignment "
           "keeps more than the memory model counts)" if predicted_fit else f" ({said})")
    error = InfeasiblePlanError(
        f"no plan autopar found compiles within `memory_budget` = {_mib(budget_bytes)} per "
        f"device{why}.{more} Raise `memory_budget`, or pass `check_memory=False` to take the "
        "plan as predicted.")
    error.memory_checks = rounds
    return error
