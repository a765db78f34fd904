"""``cost_model.estimate.plan_timeline``: a plan's memory timeline, kept on the graph for the
plans priced last, is the one ``cost_model.memory.memory_timeline`` computes for it; and
``plan_collectives``, kept the same way, is the plan's own."""

import dataclasses

from autopar.passes import estimate
from autopar.passes.estimate import plan_timeline, reductions, value_specs
from autopar.passes.liveness import memory_timeline
from autopar.models import gpt
from autopar.passes.candidates import propagated_plans
from tests.passes.test_propagate import _setup


def _direct(graph, strats, choice, sizes):
    held, live = memory_timeline(graph, value_specs(graph, strats, choice), sizes,
                                 results_held=True,
                                 operand_specs={n.id: strats[n.id][choice[n.id]].in_specs
                                                for n in graph.nodes},
                                 reductions=reductions(graph, strats, choice, sizes))
    return held, tuple(live)


def test_kept_timelines_are_the_plans_own():
    fn, args = gpt.make_train_step(gpt.TINY)
    _, graph, strats, ctx, labels = _setup(fn, args)
    seeds = {"fsdp": {n: s for n, s in zip(graph.input_nodes, _fsdp_specs(graph, strats))}}
    plans = [[0] * len(graph.nodes),
             *propagated_plans(graph, strats, ctx, labels, seeds=seeds).values()]
    sizes = ctx.axis_sizes
    first = [plan_timeline(graph, strats, p, sizes, True) for p in plans]
    assert first[0] != first[1], "two different plans, two timelines"
    for plan, timeline in zip(plans, first):
        assert timeline == _direct(graph, strats, plan, sizes)
        assert plan_timeline(graph, strats, plan, sizes, True) is timeline  # kept
    # Other strategy lists, even with the same contents, do not share the kept timelines.
    copied = [list(s) for s in strats]
    assert plan_timeline(graph, copied, plans[1], sizes, True) is not first[1]
    # Only the newest are kept.
    for k in range(estimate.KEPT + 1):
        plan_timeline(graph, strats, plans[1], sizes, True, frozenset(graph.input_nodes[:k]))
    assert plan_timeline(graph, strats, plans[0], sizes, True) is not first[0]


def test_kept_collectives_are_the_plans_own():
    fn, args = gpt.make_train_step(gpt.TINY)
    _, graph, strats, ctx, labels = _setup(fn, args)
    seeds = {"fsdp": {n: s for n, s in zip(graph.input_nodes, _fsdp_specs(graph, strats))}}
    plans = [[0] * len(graph.nodes),
             *propagated_plans(graph, strats, ctx, labels, seeds=seeds).values()]
    first = [estimate.plan_collectives(graph, strats, p, ctx) for p in plans]
    assert first[0] != first[1], "two different plans, two sets of collectives"
    for plan, comms in zip(plans, first):
        assert comms == estimate._collectives(graph, strats, plan, ctx)
        comms.clear()  # a caller's copy: the kept one does not change
        assert estimate.plan_collectives(graph, strats, plan, ctx) == (
            estimate._collectives(graph, strats, plan, ctx))
    # Another mesh context (another profile's levels) is not served the kept collectives.
    other = dataclasses.replace(ctx)
    kept = graph.analyses["estimate.plan_collectives"]
    estimate.plan_collectives(graph, strats, plans[1], other)
    assert any(owners[1] is other for owners, _ in kept.values())


def _fsdp_specs(graph, strats):
    """Each input's strategy splitting the most (an FSDP-like seed)."""
    return [max((s.out_specs[0] for s in strats[n]), key=lambda sp: len(sp.axes))
            for n in graph.input_nodes]
