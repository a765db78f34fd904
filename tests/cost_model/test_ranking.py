"""The cost model ranks plans as the compiled programs rank.

Candidates: autopar's plan, and for every hand-written baseline that applies
(autopar/compare.py) the plan whose inputs and outputs are pinned to that baseline's compiled
shardings. A candidate's *predicted* step time is its estimate; its *reference* step time is
computed from its own compiled HLO (cost_model/reference.py) on the same profile. The two
orders must agree. Realistic shapes, compiled from ShapeDtypeStruct arguments, never run. Predictions within 2% of each other
count as a tie (see TIE).

Not covered yet: the hand-written baseline's own program, whose inner shardings XLA's
propagation picks. Predicting it needs the propagation pass (`search=False`, issue 7); with
only its inputs and outputs pinned, autopar plans the inside differently (on the GPT below,
the data-parallel baseline compiles to 396 MiB of wire bytes, the pinned plan to 312 MiB).
"""

import jax
import pytest

import autopar
from autopar._mesh import as_auto_mesh
from autopar.compare import baseline_kinds, compile_baseline, measure
from cost_model.hardware import get_profile
from examples.models.workloads import abstract_train_step

H100 = get_profile("h100")
def _candidates(model):
    fn, args = abstract_train_step(model)
    mesh = as_auto_mesh({"data": 2, "model": 4})
    plan = autopar.plan(fn, *args, mesh=mesh, hardware=H100)
    out = {"autopar": (plan.estimate.step_time_s,
                       measure("autopar", plan.compile(), H100, jax.numpy.bfloat16).step_time_s)}
    for kind in baseline_kinds(mesh, args):
        compiled = compile_baseline(fn, args, mesh, kind)
        pinned = autopar.plan(fn, *args, mesh=mesh, hardware=H100,
                              in_shardings=compiled.input_shardings[0],
                              out_shardings=compiled.output_shardings)
        out[kind] = (pinned.estimate.step_time_s,
                     measure(kind, pinned.compile(), H100, jax.numpy.bfloat16).step_time_s)
    return out


#: Predictions closer than this are a tie, in either order. The estimate prices compute per op
#: (roofline with tile padding), the reference prices the compiled program's total flops at
#: one rate, so gaps this small are below what the estimate resolves.
TIE = 0.02


@pytest.mark.parametrize("model", ["gpt", "moe"])
def test_predicted_ranking_equals_compiled_ranking(model):
    times = _candidates(model)
    table = "\n".join(f"{k:<15} predicted {p * 1e3:8.3f} ms  reference {r * 1e3:8.3f} ms"
                      for k, (p, r) in times.items())
    assert len(times) >= 4
    for a, (pa, ra) in times.items():
        for b, (pb, rb) in times.items():
            if pa < pb * (1 - TIE):
                assert ra < rb, f"{a} is predicted faster than {b} but compiles slower\n{table}"
    best = min(times, key=lambda k: times[k][0])
    assert best == "autopar" and best == min(times, key=lambda k: times[k][1]), table
