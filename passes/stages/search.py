"""The stage search: price each schedule and microbatch count from one layer's plan, and keep
the fastest whose activations fit.

Stages hold balanced runs of a scanned stack of identical layers, ``ceil(L/S)`` stacked
positions each (a stage with fewer layers pads: :func:`.split.padded`). Every stage runs
every tick in lockstep, so a tick lasts as long as the fullest stage; with identical layers
the balanced boundaries minimize it, and the search runs over schedules and microbatch
counts. Each microbatch count is priced from one layer planned over the other mesh axes
(:class:`LayerPlan`, made by the caller): its forward and backward time, the bytes it keeps
for its backward, and one hop of a microbatch's activation to the next stage. Times follow
the emitted loops (:mod:`.emit`):

==============  ==============================  ============================================
schedule        time                            activations held, per device
==============  ==============================  ============================================
gpipe           (M + S - 1) (l t (1 + f) + 2 h) (M + S - 1) c + l a
interleaved     (v M + S - 1)                   (v M + S - 1) c + l a / v
                  (l t (1 + f) / v + 2 h)
1f1b            (S - 1) (l t f + h)             (2S - 1) c + l a
                + M (l t (1 + f) + 2 h)
                + (S - 1) (l t + h)
zb-h1           sum_slots l t w + 2 T h         R l a + P l c + (Q_f + Q_b) c
==============  ==============================  ============================================

with l stacked positions per stage, t one layer's forward and backward on a microbatch, h one
hop, a its kept activations, c one microbatch's activation entering a layer, and t f one
layer's forward alone (:class:`Forward`, planned by the caller; else f = 1/3, a matmul's
backward being two matmuls of the forward's size). A forward's collectives and flops are
the forward's, a backward's the whole layer's, as the loops run them. 1F1B's
warmup ticks run forwards only, its cooldown ticks backwards only, and a backward re-runs the
stage's forward from the stashed input. ZB-H1 runs the T slots of its table (:func:`.schedules.table`), each one F, B or W on every stage, a slot as long as
the longest op in it: w is f for F, 1/3 for B, and 2/3 for W, which runs the layer's whole
pullback and keeps the weight cotangents (:data:`SHARES`). It holds R microbatches'
residuals, P microbatches' per-layer cotangents between B and W, and Q_f, Q_b received
activations and cotangents (the table's buffer sizes). GPipe's and the interleaved
schedule's backward is jax's autodiff through the region's tick loop, each stage's layers
checkpointed: a tick keeps only its input, and the backward runs the stage's forward again
(their residuals otherwise left the region replicated over the other mesh axes;
``docs/pipeline.md`` has the measurements).

1F1B and ZB-H1 also run the head and the loss (the code after the stack) inside the region,
on the last stage, once per microbatch: p, its forward and backward on one microbatch as
planned over the other mesh axes. It lengthens each of 1F1B's M steady ticks (every stage
waits for the last one's sends) and each ZB-H1 slot in which the last stage runs an F.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.passes.stages.schedules import (TABLED, Op, Schedule, phases, stash_slots, table,
                                              ticks)

#: The share of a layer's forward-and-backward time its forward takes (a matmul's backward is
#: two matmuls of the forward's size).
FORWARD_SHARE = 1 / 3
#: The share of it each op of a ZB-H1 slot but F (the forward) takes: B computes the input
#: cotangent alone; W runs the whole pullback and keeps the weight cotangents (the emitted
#: loop hands W no cotangent from B: docs/pipeline.md, "What is left").
SHARES = {Op.IDLE: 0.0, Op.B: FORWARD_SHARE, Op.W: 1 - FORWARD_SHARE}
#: The schedules that compute the loss per microbatch, inside their region.
PER_MICROBATCH = frozenset({Schedule.ONE_F_ONE_B, *TABLED})


@dataclass(frozen=True)
class Forward:
    """One layer's forward alone on one microbatch, planned in its layer's input specs."""

    time_s: float
    flops: float = 0.0       # per device
    comm_bytes: float = 0.0  # its collectives' wire bytes per device
    # the same by kind: ((kind, executions, wire bytes per device), ...)
    comm_by_kind: tuple[tuple[str, float, float], ...] = ()


@dataclass(frozen=True)
class LayerPlan:
    """One layer on one microbatch, planned over the mesh axes other than the stage axis."""

    inner: object            # prepare.Inner: the specs it chose (None: replicated)
    time_s: float            # forward and backward
    kept_bytes: int          # activations kept for the backward, per device
    carry_bytes: int         # the microbatch's activation entering a stage, per device
    hop_s: float             # one ppermute of that activation over the stage axis
    devices: int = 1         # the devices of one stage (the other mesh axes)
    flops: float = 0.0       # forward and backward, per device
    comm_bytes: float = 0.0  # forward and backward, the layer's own collectives per device
    # the same by kind: ((kind, executions, wire bytes per device), ...)
    comm_by_kind: tuple[tuple[str, int, float], ...] = ()
    # carry_bytes as the stage-to-stage permute moves it (XLA:CPU carries 16-bit floats as
    # float32); None: carry_bytes
    send_bytes: int | None = None
    # the forward alone; None: FORWARD_SHARE of the layer's time, flops and collectives
    forward: Forward | None = None

    @property
    def sent_bytes(self) -> int:
        """The carried activation's bytes on the wire, per device."""
        return self.carry_bytes if self.send_bytes is None else self.send_bytes

    def forward_pass(self) -> Forward:
        """The forward alone: as planned, else :data:`FORWARD_SHARE` of the layer's work. A
        layer's forward collectives are not a third of its whole (a Megatron layer sums its
        activations twice forward and twice backward), so the planner plans it."""
        if self.forward is not None:
            return self.forward
        return Forward(FORWARD_SHARE * self.time_s, FORWARD_SHARE * self.flops,
                       FORWARD_SHARE * self.comm_bytes,
                       tuple((k, c * FORWARD_SHARE, b * FORWARD_SHARE)
                             for k, c, b in self.comm_by_kind))


@dataclass(frozen=True)
class Priced:
    """One schedule at one microbatch count, priced."""

    schedule: Schedule
    microbatches: int
    layer: LayerPlan
    time_s: float
    activation_bytes: int    # per device, at the stage holding the most
    flops: float = 0.0       # per device: its stage's layers as the emitted loops run them
    # per device: the layers' collectives, and an activation sent on and a cotangent sent
    # back over the stage axis at every tick of the emitted loops (bubbles included)
    comm_bytes: float = 0.0
    sends: int = 0           # those stage-to-stage sends (collective-permutes) a device runs
    send_bytes: float = 0.0  # and their bytes, per device (part of comm_bytes)
    # the layers' collectives by kind, as the emitted loops run them (bubbles included):
    # ((kind, executions, wire bytes per device), ...)
    layer_collectives: tuple[tuple[str, int, float], ...] = ()


def price(schedule: Schedule, stages: int, microbatches: int, layers_per_stage: int,
          layer: LayerPlan, virtual: int = 1, post=None) -> Priced:
    """``schedule`` with ``stages`` stages of ``layers_per_stage`` layers (in ``virtual``
    chunks each, interleaved), priced; ``post`` (a ``prepare.Post``, for the schedules of
    :data:`PER_MICROBATCH`): the head and loss on one microbatch, which the region runs once
    per microbatch on the last stage."""
    post_s = 0.0 if post is None else post.time_s
    n = ticks(schedule, stages, microbatches, virtual)
    sends = 2 * n  # an activation on and a cotangent back per tick; 1F1B's ramps send one
    forward = layer.forward_pass()
    stage_s = layers_per_stage * layer.time_s / virtual
    stage_forward_s = layers_per_stage * forward.time_s / virtual
    # forwards, wholes: the layer forwards and the layer forward-and-backward passes (a
    # backward runs its forward again) a device runs, bubbles included, as the emitted loops
    # compute them masked
    if schedule in (Schedule.GPIPE, Schedule.INTERLEAVED):
        time_s = n * (stage_s + stage_forward_s + 2 * layer.hop_s)
        held = n * layer.carry_bytes + layers_per_stage // virtual * layer.kept_bytes
        forwards = wholes = n * layers_per_stage / virtual
    elif schedule is Schedule.ONE_F_ONE_B:
        forward_s, backward_s = stage_forward_s + layer.hop_s, stage_s + layer.hop_s
        time_s = sum((stop - first) * (forward_s * f + backward_s * b + post_s * f * b)
                     for first, stop, f, b in phases(stages, microbatches))
        held = stash_slots(stages) * layer.carry_bytes + layers_per_stage * layer.kept_bytes
        forwards = layers_per_stage * sum((stop - first) * f
                                          for first, stop, f, _ in phases(stages, microbatches))
        wholes = layers_per_stage * sum((stop - first) * b
                                        for first, stop, _, b in phases(stages, microbatches))
        sends = sum((stop - first) * (f + b) for first, stop, f, b in phases(stages, microbatches))
    else:
        assert schedule in TABLED, schedule
        tab = table(schedule, stages, microbatches)
        last = len(tab.ops) - 1

        def op_s(s: int, op: Op) -> float:   # the last stage's F also runs the head
            if op == Op.F:
                return stage_forward_s + (post_s if s == last else 0.0)
            return SHARES[op] * stage_s

        time_s = (sum(max(op_s(s, ops[t]) for s, ops in enumerate(tab.ops))
                      for t in range(tab.slots)) + n * 2 * layer.hop_s)
        held = (layers_per_stage * (tab.held * layer.kept_bytes
                                    + tab.pending_w * layer.carry_bytes)
                + (tab.waiting_f + tab.waiting_b) * layer.carry_bytes)
        forwards = microbatches * layers_per_stage
        wholes = forwards * (SHARES[Op.B] + SHARES[Op.W])
    head_flops = head_bytes = 0.0
    if post is not None:   # the head and loss run once per microbatch
        head_flops, head_bytes = microbatches * post.flops, microbatches * post.comm_bytes
    collectives: dict[str, list[float]] = {}
    for passes, by_kind in ((forwards, forward.comm_by_kind), (wholes, layer.comm_by_kind)):
        for kind, count, nbytes in by_kind:
            have = collectives.setdefault(kind, [0.0, 0.0])
            have[0] += passes * count
            have[1] += passes * nbytes
    return Priced(schedule=schedule, microbatches=microbatches, layer=layer, time_s=time_s,
                  activation_bytes=int(held),
                  flops=forwards * forward.flops + wholes * layer.flops + head_flops,
                  comm_bytes=(forwards * forward.comm_bytes + wholes * layer.comm_bytes
                              + sends * layer.sent_bytes + head_bytes),
                  sends=sends, send_bytes=sends * layer.sent_bytes,
                  layer_collectives=tuple((kind, round(count), nbytes)
                                          for kind, (count, nbytes) in collectives.items()))


def best(options: list[Priced], budget_bytes: float | None) -> Priced:
    """The fastest option whose activations fit ``budget_bytes`` (None: no limit); the one
    holding least when none fits."""
    assert options, "no pipeline option to choose from"
    fits = [o for o in options if budget_bytes is None or o.activation_bytes <= budget_bytes]
    if not fits:
        return min(options, key=lambda o: (o.activation_bytes, o.time_s))
    return min(fits, key=lambda o: (o.time_s, o.activation_bytes))
