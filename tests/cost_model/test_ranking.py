"""The cost model ranks plans as their compiled programs rank.

Candidates, on the (2, 4) mesh and the ``h100`` profile: autopar's plan, and for every
hand-written baseline that applies (``autopar.compare.baseline_kinds``: dp, fsdp, megatron,
megatron_vocab, and expert on MoE) the plan whose inputs and outputs are pinned to that
baseline's shardings (``autopar.compare.predict_baselines``). A candidate's *predicted* step
time is its ``plan.estimate``; its *reference* step time is computed from its own compiled HLO
(``cost_model.reference``: the compiled flops at the profile's matmul rate plus the
alpha-beta time of every compiled collective). Realistic shapes (``examples/models/
workloads.py``), compiled from ShapeDtypeStruct arguments, never run.

Tolerance: two candidates whose reference times are within ``TIE`` (5%) of each other may be
predicted in either order. The reference is itself a model, and a coarser one than the
estimate on exactly the terms that separate such candidates: it prices every flop at one rate
(no tile padding, no memory-bound elementwise time), and it takes XLA:CPU's collective
combining as it compiled (a GPU build combines differently). On the GPT below, the dp and
megatron candidates are 3.8% apart by reference (1.273 and 1.322 ms) and 0.6% by prediction
(1.620 and 1.629 ms): megatron computes 17% more flops and moves 14% fewer wire bytes, so
their order turns on those terms. (It did swap while the estimate charged no latency at all
for the gradient all-reduces XLA merges into one; it now charges one per merged group, see
``cost_model.estimate``.) Measured now, the GPT's five and the MoE's six candidates come out in the
same order by prediction and by reference. Any pair further apart than 5% must be predicted
in the reference's order, and autopar's plan must be the best by both.

Not covered: the hand-written baseline's own program, whose inner shardings XLA's
propagation picks. With only its inputs and outputs pinned, autopar plans the inside
differently (on the GPT, the data-parallel baseline's own program moves 396 MiB of wire bytes,
the pinned plan 360 MiB); predicting XLA's choice needs the propagation pass (``search=False``).
"""

import jax.numpy as jnp
import pytest

from cost_model.reference import reference_step_time_s
from tests.cost_model.compiled_cases import H100, autopar_case, baseline_cases

#: Reference step times closer than this (relative) are a tie: see the module docstring.
TIE = 0.05


def _times(model: str) -> dict[str, tuple[float, float]]:
    """Candidate -> (predicted, reference) step time in seconds."""
    cases = {"autopar": autopar_case(model, "2d"), **baseline_cases(model, "2d")}
    return {name: (c.plan.estimate.step_time_s,
                   reference_step_time_s(c.truth, H100, jnp.bfloat16))
            for name, c in cases.items()}


@pytest.mark.parametrize("model, n_baselines", [("gpt", 4), ("moe", 5)])
def test_predicted_ranking_equals_compiled_ranking(model, n_baselines):
    times = _times(model)
    table = "\n".join(f"{k:<15} predicted {p * 1e3:8.3f} ms  reference {r * 1e3:8.3f} ms"
                      for k, (p, r) in sorted(times.items(), key=lambda kv: kv[1][1]))
    assert len(times) == n_baselines + 1, table
    for a, (pa, ra) in times.items():
        for b, (pb, rb) in times.items():
            if ra < rb * (1 - TIE):
                assert pa < pb, f"{a} compiles faster than {b} but is predicted slower\n{table}"
    assert min(times, key=lambda k: times[k][0]) == "autopar", table
    assert min(times, key=lambda k: times[k][1]) == "autopar", table
