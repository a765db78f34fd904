"""State at rest in its update's sharding: where a train step updates a state array (new
parameters) in a finer sharding than the one it keeps between steps, the update is gathered
at the step's end, after the last compute, where nothing can hide it. Kept between steps in
the update's sharding instead, the array is gathered where the next step first reads it, and
that gather can run beside the compute before it: FSDP's weight prefetch across the step
boundary. The bytes moved are the same where the step's readers share one gather (the
estimate moves a value once per spec), and the array takes less memory between steps.

:func:`rest_in_update_sharding` makes that move for one such state group at a time and keeps
it when the plan's simulated makespan (``passes.estimate.plan_makespan``) is shorter. The
ILP cannot see it: its overlap terms are priced around a reference plan
(``passes.solve._with_overlap``), which credits a move only with what the reference's
timeline hid at that edge, and the reference moved nothing there."""

from __future__ import annotations

from autopar.passes.dedup import Groups
from autopar.passes.estimate import Hidden
from autopar.passes.ir import Graph, NodeKind


def state_gathered_at_end(graph: Graph, strats, groups: Groups, choice: list[int]
                          ) -> dict[int, int]:
    """group -> the group strategy whose rest spec is its update's spec, for every group of a
    step input tied to a result (state the step replaces) whose update arrives in another
    spec than the group keeps. The update is the value the result is made from, or, where
    that op follows the state's group (``passes.cluster``: an elementwise ``p + delta``), the
    spec its other operand of the state's shape is made in."""
    inputs = {groups.group_of[n] for n in graph.input_nodes}
    moves: dict[int, int] = {}
    for node in graph.nodes:
        g = groups.group_of[node.id]
        if node.kind is not NodeKind.OUTPUT or g not in inputs or node.ins[0] is None:
            continue
        rest = strats[node.id][choice[node.id]].in_specs[0]
        update = _update_spec(graph, strats, groups, choice, node.ins[0], g)
        if update is None or update == rest:
            continue
        match = [i for i in range(groups.sizes[g])
                 if strats[node.id][groups.index_map[node.id][i]].in_specs[0] == update]
        if match:
            moves[g] = match[0]
    return moves


def _update_spec(graph: Graph, strats, groups: Groups, choice: list[int], vid: int, g: int):
    """The spec the new state ``vid`` is made in, looking through an op of the state's group
    to its operand made elsewhere (None when there is no single one)."""
    u, k = graph.producer[vid]
    if groups.group_of[u] != g:
        return strats[u][choice[u]].out_specs[k]
    shape = graph.values[vid].shape
    made = set()
    for operand in graph.nodes[u].ins:
        if operand is None or graph.values[operand].shape != shape:
            continue
        p, j = graph.producer[operand]
        if groups.group_of[p] != g:
            made.add(strats[p][choice[p]].out_specs[j])
    return made.pop() if len(made) == 1 else None


def rest_in_update_sharding(graph: Graph, strats, groups: Groups, choice: list[int],
                            makespan, hidden: Hidden) -> tuple[list[int], int]:
    """(``choice`` with the state groups of :func:`state_gathered_at_end` kept in their
    update's spec where that shortens the plan's makespan, the number of state arrays moved).
    ``makespan``: choice -> seconds; ``hidden``: what ``choice``'s timeline hides of its
    moves (``passes.estimate.hidden_comm``). Only the groups whose own moves are exposed in
    that timeline are tried (a gather hidden at the step's end has nothing to gain), one at a
    time, the largest state first, each kept when the makespan is shorter with it (a state the
    next step reads first, such as an embedding table, is exposed there instead, and stays)."""
    exposed: dict[int, float] = {}
    for (node, vid), total_s in hidden.reshard_totals.items():
        exposed[node] = exposed.get(node, 0.0) + total_s - hidden.reshards.get((node, vid), 0.0)
    moves = {g: i for g, i in state_gathered_at_end(graph, strats, groups, choice).items()
             if sum(exposed.get(n, 0.0) for n in groups.members[g]) > 0}
    size = {g: sum(graph.values[graph.nodes[n].outs[0]].nbytes for n in groups.members[g]
                   if graph.nodes[n].kind is NodeKind.INPUT) for g in moves}
    best, best_s, moved = choice, makespan(choice), 0
    for g in sorted(moves, key=lambda g: (-size[g], g))[:MAX_TRIED]:
        trial = list(best)
        for n in groups.members[g]:
            trial[n] = int(groups.index_map[n][moves[g]])
        trial_s = makespan(trial)
        if trial_s < best_s * (1 - 1e-9):
            best, best_s = trial, trial_s
            moved += sum(graph.nodes[n].kind is NodeKind.INPUT for n in groups.members[g])
    return best, moved


#: State groups tried at most (each costs a simulation of the plan's timeline).
MAX_TRIED = 32
#: Graphs of more nodes are not tried: each try simulates the whole plan, which takes seconds
#: on a deep unrolled model, where a weight gathered where the next step reads it queues with
#: every other layer's at the step's start and does not pay (docs/design.md, "State at rest").
MAX_NODES = 20_000
