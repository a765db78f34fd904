"""Candidate plans: starts of the same seeds share one propagation and one step time."""

from autopar.cost_model.spec import Spec
from autopar.models import gpt
from autopar.passes import candidates
from tests.passes.test_propagate import _setup


def _problem():
    """The TINY GPT step on (2, 4), with the batch split over `data` as a seed."""
    fn, args = gpt.make_train_step(gpt.TINY, abstract=True)
    _, graph, strats, mesh, _ = _setup(fn, args)
    batch = {n: Spec((("data",),) + ((),) * (graph.values[graph.nodes[n].outs[0]].rank - 1))
             for n in graph.input_nodes[-2:]}
    return graph, strats, mesh, batch


def test_equal_seeds_are_propagated_and_timed_once(monkeypatch):
    graph, strats, mesh, batch = _problem()
    calls = {"propagate": 0, "estimate": 0}
    for name in calls:
        real = getattr(candidates, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(candidates, name, counted)
    model = {n: Spec(((),) * (len(s.dims) - 1) + (("model",),)) for n, s in batch.items()}
    plans = candidates.propagated_plans(graph, strats, mesh, {}, (),
                                        {"dp": batch, "dp again": dict(batch), "other": model})
    assert calls["propagate"] == 2
    dp, again, other = (plans[f"propagated ({n})"] for n in ("dp", "dp again", "other"))
    assert dp == again and dp != other
    times = candidates.step_times(graph, strats, mesh, plans)
    assert calls["estimate"] == 2
    assert times["propagated (dp)"] == times["propagated (dp again)"]
    # Each plan is the one a propagation of its seeds alone makes.
    alone = candidates.propagated_plans(graph, strats, mesh, {}, (), {"dp": batch})
    assert alone["propagated (dp)"] == dp
