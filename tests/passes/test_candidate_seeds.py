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


def test_seeds_referee_a_proven_plan_only_on_a_small_graph(monkeypatch):
    """A plan HiGHS proves optimal from an integral relaxation is compared with the seeds'
    plans on a graph of at most REFEREE_MAX_NODES nodes; on a larger one it is taken without
    making the seeds or their plans. A plan it did not prove optimal (the time limit: the
    warm start's plan) is compared with every seed's, on any graph."""
    import pytest
    import autopar
    from autopar.errors import SolverFallbackWarning
    from autopar.models import mlp

    made = []
    seeded, seeds_by_node = candidates._seeded, candidates.seeds_by_node
    monkeypatch.setattr(candidates, "_seeded", lambda *a: made.append("plans") or seeded(*a))
    monkeypatch.setattr(candidates, "seeds_by_node",
                        lambda *a: made.append("seeds") or seeds_by_node(*a))
    fn, args = mlp.make_train_step(mlp.TINY)
    mesh = {"data": 2, "model": 4}
    small = autopar.plan(fn, *args, mesh=mesh)
    assert small.stats["solver_status"] == "optimal" and made == ["plans", "seeds"]
    assert {"propagated (dp)", "propagated (megatron)"} <= set(small.stats["candidates_step_s"])
    made.clear()
    monkeypatch.setattr(candidates, "REFEREE_MAX_NODES", small.stats["nodes"] - 1)
    large = autopar.plan(fn, *args, mesh=mesh)
    assert large.stats["solver_status"] == "optimal" and large.stats["source"] == "ilp"
    assert made == [] and list(large.stats["candidates_step_s"]) == ["optimal"]
    with pytest.warns(SolverFallbackWarning):
        unproven = autopar.plan(fn, *args, mesh=mesh, time_limit_s=1e-6)
    assert made == ["plans", "seeds"]
    times = unproven.stats["candidates_step_s"]
    assert {"propagated (dp)", "propagated (megatron)"} <= set(times)
    assert unproven.estimate.step_time_s == min(times.values())
