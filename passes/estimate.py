"""The plan's own prediction: time, flops, wire bytes and peak memory per device."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from autopar.cost_model.collectives import CommStep
from autopar.passes.liveness import memory_timeline, reduction_bytes
from autopar.passes.ir import Graph
from autopar.passes.reductions import reduction_depths


@dataclass(frozen=True)
class Estimate:
    """Per-device predictions for one call of the planned function. ``step_time_s`` is the
    makespan of the plan's simulated timeline (:func:`plan_makespan`): compute and
    communication overlap where the dataflow lets them; ``exposed_comm_s`` is the part of it
    no compute hides. ``comm_time_s`` is every collective's time, hidden or not."""
    step_time_s: float
    compute_time_s: float
    comm_time_s: float
    flops: float
    comm_bytes: float
    peak_memory_bytes: int
    exposed_comm_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ChosenComm:
    """One collective the plan expects, with where it comes from (for the report)."""
    step: CommStep
    trips: int
    node: int
    reason: str   # "reduce" (a partial result), "reshard" (an operand in another spec) or
    #               "overlap" (a step of a rewrite that overlaps its compute: exposed part)
    time_s: float = 0.0  # one execution, on the plan's mesh and profile
    value: int | None = None  # the value a reshard moves (None for a reduction)


def plan_collectives(graph: Graph, strats, choice, mesh) -> list[ChosenComm]:
    """Every collective the plan runs. A value resharded to the same spec for several
    consumers moves once: XLA computes the identical resharding once and shares it (CSE), as
    for a forward activation the backward pass needs in the same layout. A value a rewrite
    returns moved (``Rewrite.keeps``) does not move again for its later readers.

    The last :data:`KEPT` plans' collectives are kept on the graph (:func:`_kept`): the plan
    taken is priced when it is compared with the propagated ones and again for its
    estimate."""
    return list(_kept(graph, "estimate.plan_collectives", (id(strats), id(mesh), tuple(choice)),
                      (strats, mesh), lambda: tuple(_collectives(graph, strats, choice, mesh))))


def _collectives(graph: Graph, strats, choice, mesh) -> list[ChosenComm]:
    """:func:`plan_collectives`, computed."""
    out = []
    moved = set()
    for node in graph.nodes:
        s = strats[node.id][choice[node.id]]
        if s.rewrite is not None:  # run beside its compute: only its exposed part is charged
            out += [ChosenComm(c, node.trip_count, node.id, "overlap",
                               s.comm_s / len(s.collectives)) for c in s.collectives]
        else:
            out += [ChosenComm(c, node.trip_count, node.id, "reduce", c.time_s(mesh.levels))
                    for c in s.collectives]
        for pos, vid in enumerate(node.ins):
            if vid is None or (vid, s.in_specs[pos]) in moved:
                continue
            moved.add((vid, s.in_specs[pos]))
            u, k = graph.producer[vid]
            src = strats[u][choice[u]].out_specs[k]
            v = graph.values[vid]
            for step in mesh.reshard(src, s.in_specs[pos], v):
                out.append(ChosenComm(step, node.edge_trip(pos), node.id, "reshard",
                                      step.time_s(mesh.levels), value=vid))
        for pos, spec in s.rewrite.keeps if s.rewrite is not None else ():
            moved.add((node.ins[pos], spec))  # the rewrite returns it moved
    return _with_combined_latency(out, mesh.levels, reduction_depths(graph))


def by_kind(comms) -> dict[str, tuple[int, float]]:
    """Kind -> (executions per call, wire bytes per device) of ``comms``."""
    totals: dict[str, list] = {}
    for c in comms:
        if c.step.kind is not None and c.step.wire_bytes:
            total = totals.setdefault(c.step.kind.value, [0, 0.0])
            total[0] += c.trips
            total[1] += c.step.wire_bytes * c.trips
    return {k: (n, b) for k, (n, b) in totals.items()}


def combiner_key(step: CommStep, trips: int, depth: int) -> tuple:
    """Reductions of partial results with equal keys are merged by XLA's combiner into one
    collective, which pays the latency once: one kind over the same devices, run as often, and
    of equal depth (``passes.reductions.reduction_depths``: as many reductions wait for each)."""
    return (step.kind, step.axes, step.group_size, step.axis_sizes, trips, depth)


def combined_latency_s(step: CommStep, levels) -> float:
    """The latency one merged group of reductions keyed as ``step``'s pays, once."""
    return CommStep(step.kind, step.axes, step.group_size, 0, 0,
                    axis_sizes=step.axis_sizes).time_s(levels)


def without_latency_s(step: CommStep, levels) -> float:
    """``step``'s time once merged with others: its bytes, no latency of its own."""
    return replace(step, combined=True).time_s(levels)


def _with_combined_latency(comms: list[ChosenComm], levels, depths: list[int]
                           ) -> list[ChosenComm]:
    """Each reduction priced without latency, the first of each combiner group
    (:func:`combiner_key`) carrying the group's one latency. Depth 0 holds the gradients, the
    loss and metrics; a batch norm's mean and mean of squares share a depth."""
    out, seen = [], set()
    for c in comms:
        if c.reason == "reduce" and c.step.kind is not None:
            key = combiner_key(c.step, c.trips, depths[c.node])
            time_s = without_latency_s(c.step, levels)
            if key not in seen:
                seen.add(key)
                time_s += combined_latency_s(c.step, levels)
            c = replace(c, time_s=time_s)
        out.append(c)
    return out


def value_specs(graph: Graph, strats, choice) -> dict:
    specs = {}
    for node in graph.nodes:
        s = strats[node.id][choice[node.id]]
        for vid, spec in zip(node.outs, s.out_specs):
            specs[vid] = spec
    return specs


def estimate(graph: Graph, strats, choice, mesh, comms: list[ChosenComm],
             memory: bool = True) -> Estimate:
    """The plan's predictions; ``comms``: its collectives (:func:`plan_collectives`);
    ``memory=False``: without the peak (0), which takes most of the time on a large graph."""
    compute_s = flops = 0.0
    for node in graph.nodes:
        s = strats[node.id][choice[node.id]]
        compute_s += s.compute_s * node.trip_count
        flops += s.flops * node.trip_count
    comm_s = sum(c.time_s * c.trips for c in comms)
    comm_bytes = sum(c.step.wire_bytes * c.trips for c in comms)
    peak = (plan_peak_memory_bytes(graph, strats, choice, mesh.axis_sizes, mesh.results_held)
            if memory else 0)
    makespan_s, exposed_s = plan_makespan(graph, strats, choice, mesh)
    return Estimate(step_time_s=makespan_s, compute_time_s=compute_s, comm_time_s=comm_s,
                    flops=flops, comm_bytes=comm_bytes, peak_memory_bytes=peak,
                    exposed_comm_s=exposed_s)


def _stream(step: CommStep, levels) -> object:
    """The communication stream a collective runs on: the slowest level its axes cross."""
    return min((levels[a] for a in step.axes), key=lambda lv: lv.bandwidth_bytes_per_s).kind


def plan_makespan(graph: Graph, strats, choice, mesh) -> tuple[float, float]:
    """(makespan, exposed communication) of one device's step, simulated over the plan's
    dataflow as the compiled program's timeline is (``cost_model.timeline``): nodes run one
    at a time on the compute stream in program order once their operands are ready; a
    reshard runs on its level's stream once the value is ready and the consumer waits for it;
    a reduction runs once its node is done and its result waits for it. A node in a loop runs
    its trips back to back, as one op of their total time. The collectives are the plan's own
    (:func:`plan_collectives`); the timeline is kept as they are (:func:`_kept`), since the plan
    taken is simulated by the solve, by the comparison with the candidates and for its
    estimate."""
    end, busy, _ = _kept_simulation(graph, strats, choice, mesh)
    return end, end - busy


def _kept_simulation(graph: Graph, strats, choice, mesh
                     ) -> tuple[float, float, tuple[float, ...]]:
    """:func:`_simulate` of the plan's own collectives, kept for the last :data:`KEPT` plans."""
    def make():
        end, busy, exposed = _simulate(graph, strats, choice, mesh,
                                       plan_collectives(graph, strats, choice, mesh))
        return end, busy, tuple(exposed)
    return _kept(graph, "estimate.plan_makespan", (id(strats), id(mesh), tuple(choice)),
                 (strats, mesh), make)


def _simulate(graph: Graph, strats, choice, mesh, comms: list[ChosenComm]
              ) -> tuple[float, float, list[float]]:
    """(makespan, compute time, the exposed seconds of each of ``comms``): each wait of the
    compute stream, and the tail after its last node, is blamed on the collectives of its
    critical chain (the one it waited for, the one that delayed that one on its stream or
    made its operand, and so on), so the exposed parts sum to the makespan less compute."""
    before: dict[int, list[int]] = {}
    after: dict[int, list[int]] = {}
    for i, c in enumerate(comms):
        (before if c.reason == "reshard" else after).setdefault(c.node, []).append(i)
    ready: dict[int, tuple[float, int | None]] = {}  # value -> (time, the comm that set it)
    streams: dict[object, tuple[float, int | None]] = {}
    begin, finish, cause = [0.0] * len(comms), [0.0] * len(comms), [None] * len(comms)
    exposed = [0.0] * len(comms)
    clock = busy = 0.0

    def run_comm(i: int, start: tuple[float, int | None]) -> tuple[float, int]:
        c = comms[i]
        key = _stream(c.step, mesh.levels) if c.step.axes else None
        begin[i], cause[i] = max(start, streams.get(key, (0.0, None)), key=lambda t: t[0])
        finish[i] = begin[i] + c.time_s * c.trips
        streams[key] = (finish[i], i)
        return finish[i], i

    def blame(at: tuple[float, int | None], floor: float) -> None:
        end, i = at
        while i is not None and end > floor:
            exposed[i] += end - max(begin[i], floor)
            end, i = begin[i], cause[i]

    for node in graph.nodes:
        s = strats[node.id][choice[node.id]]
        moved: dict[int, tuple[float, int | None]] = {}
        for i in before.get(node.id, ()):
            v = comms[i].value
            moved[v] = run_comm(i, max(moved.get(v, (0.0, None)), ready.get(v, (0.0, None)),
                                       key=lambda t: t[0]))
        waits = [moved.get(v, ready.get(v, (0.0, None))) for v in node.ins if v is not None]
        start = max([(clock, None)] + waits, key=lambda t: t[0])
        blame(start, clock)
        work = s.compute_s * node.trip_count
        clock, busy = start[0] + work, busy + work
        done: tuple[float, int | None] = (clock, None)
        for i in after.get(node.id, ()):
            done = run_comm(i, done)
        for vid in node.outs:
            ready[vid] = done
    last = max([(clock, None)] + list(streams.values()) + list(ready.values()),
               key=lambda t: t[0])
    blame(last, clock)
    return last[0], busy, exposed


@dataclass(frozen=True)
class Hidden:
    """The communication a plan's timeline hides behind compute (:func:`hidden_comm`), in
    seconds over all trips: ``reductions`` per node (bytes; a rewrite's steps too),
    ``latencies`` per combiner key (``combiner_key``) and ``reshards`` per (reader node,
    value). The ILP charges a strategy only what exceeds them (``passes.ilp``)."""
    reductions: dict[int, float]
    latencies: dict[tuple, float]
    reshards: dict[tuple[int, int], float]
    reshard_totals: dict[tuple[int, int], float]  # the same moves' whole time
    choice: tuple[int, ...] = ()  # the plan whose timeline this is


def hidden_comm(graph: Graph, strats, choice, mesh) -> Hidden:
    """What the plan's simulated timeline (:func:`plan_makespan`) hides of each of its
    collectives: a collective's time less the waits blamed on it. A reduction that carries its
    combiner group's latency hides its bytes first, then the latency."""
    comms = plan_collectives(graph, strats, choice, mesh)
    _, _, exposed = _kept_simulation(graph, strats, choice, mesh)
    depths = reduction_depths(graph)
    reductions: dict[int, float] = {}
    latencies: dict[tuple, float] = {}
    reshards: dict[tuple[int, int], float] = {}
    totals: dict[tuple[int, int], float] = {}
    seen = set()
    for c, out in zip(comms, exposed):
        hidden = c.time_s * c.trips - out
        if c.reason == "reshard":
            key = (c.node, c.value)
            reshards[key] = reshards.get(key, 0.0) + hidden
            totals[key] = totals.get(key, 0.0) + c.time_s * c.trips
            continue
        bytes_s = hidden
        if c.reason == "reduce" and c.step.kind is not None:
            key = combiner_key(c.step, c.trips, depths[c.node])
            if key not in seen:
                seen.add(key)
                bytes_s = min(hidden, without_latency_s(c.step, mesh.levels) * c.trips)
                latencies[key] = hidden - bytes_s
        reductions[c.node] = reductions.get(c.node, 0.0) + bytes_s
    return Hidden(reductions, latencies, reshards, totals, tuple(choice))


def plan_peak_memory_bytes(graph: Graph, strats, choice, axis_sizes, results_held: bool,
                           donated=frozenset()) -> int:
    """Per-device peak memory of the planned graph (``cost_model.memory``); ``donated``: input
    node ids whose buffers the program may reuse for its results (``donate_argnums``)."""
    held, live = plan_timeline(graph, strats, choice, axis_sizes, results_held, donated)
    return held + max(live, default=0)


#: Plans whose timelines and collectives are kept per graph (the newest).
KEPT = 8


def _kept(graph: Graph, name: str, key: tuple, owners: tuple, make):
    """``make()``, kept in ``graph.analyses[name]`` under ``key`` (ids of ``owners`` and the
    plan) for the last :data:`KEPT` keys; a hit counts only for the same ``owners``, not
    objects that reuse their ids. Kept values are tuples, so no caller can change one."""
    cache = graph.analyses.setdefault(name, {})
    hit = cache.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], owners)):
        return hit[1]
    value = make()
    cache[key] = (owners, value)
    while len(cache) > KEPT:
        del cache[next(iter(cache))]
    return value


def plan_timeline(graph: Graph, strats, choice, axis_sizes, results_held: bool,
                  donated=frozenset()) -> tuple[int, tuple[int, ...]]:
    """``cost_model.memory.memory_timeline`` of a plan: (bytes held for the whole call, bytes
    of the other live buffers at each node), per device; kept for the last :data:`KEPT`
    plans (:func:`_kept`): the plan a memory refit takes is priced again when it is compared
    with the propagated ones and when its estimate is made, and on a deep model each pricing
    takes a second."""
    def make():
        held, live = memory_timeline(
            graph, value_specs(graph, strats, choice), axis_sizes, donated,
            results_held=results_held,
            operand_specs={n.id: strats[n.id][choice[n.id]].in_specs for n in graph.nodes},
            reductions=reductions(graph, strats, choice, axis_sizes))
        return held, tuple(live)

    key = (id(strats), tuple(choice), tuple(sorted(axis_sizes.items())), results_held,
           frozenset(donated))
    return _kept(graph, "estimate.plan_timeline", key, (strats,), make)


def reductions(graph: Graph, strats, choice, axis_sizes) -> dict[int, int]:
    """Node id -> bytes its partial results' reductions hold while it runs, for the nodes
    that reduce (``cost_model.memory.reduction_bytes``)."""
    return {n.id: reduction_bytes(graph, n, strats[n.id][choice[n.id]], axis_sizes)
            for n in graph.nodes if strats[n.id][choice[n.id]].collectives
            or strats[n.id][choice[n.id]].scratch_bytes}
