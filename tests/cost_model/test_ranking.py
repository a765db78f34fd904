"""The cost model ranks programs as their compiled versions rank.

Candidates, on the (2, 4) mesh and the ``h100`` profile: autopar's plan and the hand-written
baselines that apply (``autopar.baselines.baseline_kinds``). Each baseline is a candidate as
its own program (``jax.jit`` with the baseline's input and output shardings, the inside left to
XLA's propagation, ``autopar._compare.compile_baseline``), predicted by propagating its
shardings (``predict_baselines``, ``search=False``), which reproduces that program (see
:func:`test_baseline_programs_are_predicted_by_propagation`).

A candidate's *predicted* step time is autopar's estimate. Its compiled HLO is read two ways:
the *reference* (``cost_model.reference``: the compiled flops at the profile's matmul rate
plus the alpha-beta time of every compiled collective) and the *simulated* step
(``cost_model.timeline.simulate``: every kernel at its roofline, memory traffic included, the
collectives overlapped as a GPU schedules them). Realistic shapes
(``autopar/models/workloads.py``), compiled from ShapeDtypeStruct arguments, never run.

Tolerance: two candidates are ordered when both readings put them more than ``TIE`` (5%)
apart in the same order; the estimate must order them so. Where the readings disagree, the
order turns on memory traffic, which the reference leaves out and the simulation prices as
XLA:CPU fused the program (a GPU build fuses differently). autopar's plan must be the best by
the estimate, the reference and the simulation.
"""

import jax.numpy as jnp
import pytest

from autopar.cost_model.reference import reference_step_time_s
from autopar.cost_model.timeline import simulate
from tests.cost_model.compiled_cases import H100, autopar_case, baseline_cases

#: Reference step times closer than this (relative) are a tie: see the module docstring.
TIE = 0.05


def _times(model: str) -> dict[str, tuple[float, float, float]]:
    """Candidate -> (predicted, reference, simulated) step time in seconds."""
    cases = {"autopar": autopar_case(model, "2d"), **baseline_cases(model, "2d")}
    return {name: (c.plan.estimate.step_time_s,
                   reference_step_time_s(c.truth, H100, jnp.bfloat16),
                   simulate(c.hlo_text, H100, jnp.bfloat16,
                            scheduled=H100.async_collectives).step_time_s)
            for name, c in cases.items()}


@pytest.mark.parametrize("model, n_baselines", [("gpt", 4), ("moe", 5)])
def test_predicted_ranking_equals_compiled_ranking(model, n_baselines):
    times = _times(model)
    table = "\n".join(f"{k:<15} predicted {p * 1e3:8.3f} ms  reference {r * 1e3:8.3f} ms  "
                      f"simulated {s * 1e3:8.3f} ms"
                      for k, (p, r, s) in sorted(times.items(), key=lambda kv: kv[1][1]))
    assert len(times) == n_baselines + 1, table
    for a, (pa, ra, sa) in times.items():
        for b, (pb, rb, sb) in times.items():
            if ra < rb * (1 - TIE) and sa < sb * (1 - TIE):
                assert pa < pb, f"{a} compiles faster than {b} but is predicted slower\n{table}"
    for column in range(3):
        assert min(times, key=lambda k: times[k][column]) == "autopar", table


@pytest.mark.parametrize("model, kind", [
    ("gpt", "dp"), ("gpt", "fsdp"), ("gpt", "megatron"), ("gpt", "megatron_vocab"),
    ("moe", "dp"), ("moe", "fsdp"), ("moe", "megatron"), ("moe", "megatron_vocab"),
    ("moe", "expert"),
])
def test_baseline_programs_are_predicted_by_propagation(model, kind):
    """search=False with a baseline's shardings predicts the hand-written program XLA compiles:
    its wire bytes within 10% (and 1 MiB) and its flops within 5%."""
    case = baseline_cases(model, "2d")[kind]
    e, truth = case.plan.estimate, case.truth
    assert abs(e.comm_bytes - truth.wire_bytes) <= 0.10 * truth.wire_bytes + 2**20, \
        (e.comm_bytes / 2**20, truth.wire_bytes / 2**20)
    assert abs(e.flops - truth.flops) <= 0.05 * truth.flops, (e.flops, truth.flops)
