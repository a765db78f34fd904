"""Check that a loss can be pipelined exactly, and settle what the request left open.

:func:`prepare` traces the loss twice, on the whole batch and on one microbatch, finds the
layer stack in both (:mod:`.split`), and proves with :mod:`.batch_axes` that microbatching
changes nothing: the layer body never mixes examples nor depends on the batch size, and (for
schedules that compute the loss per microbatch) the loss is a fixed sum over examples.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
import numpy as np

from autopar.errors import PipelineError
from autopar.passes.stages import batch_axes, search, split
from autopar.passes.stages.batch_axes import BatchSum, Mode
from autopar.passes.stages.schedules import TABLED, Schedule, table_bubble, ticks

#: How many microbatch counts the stage search prices (each plans one layer).
MAX_MICROBATCH_OPTIONS = 4


@dataclass(frozen=True)
class StageRequest:
    """What the user asked: the mesh axis carrying stages; ``None`` fields are chosen here."""

    axis: str
    stages: int | None = None
    microbatches: int | None = None
    schedule: Schedule | None = None
    activation_budget_bytes: float | None = None  # per device, for the search's activations
    virtual_stages: int | None = None             # interleaved only
    batch_argnums: tuple[int, ...] | None = None  # the loss's batch arguments; None: inferred


class Aux(enum.Enum):
    """How an auxiliary output of the loss (``has_aux``) combines across microbatches."""

    SUM = "sum"              # a weighted sum over examples: the microbatches' sum, weighted
    EXAMPLES = "examples"    # per example, batch axis first: the microbatches' rows in order
    SAME = "same"            # independent of the batch: any microbatch's


@dataclass(frozen=True)
class Inner:
    """How a stage's work is split over the mesh axes other than the stage axis: a
    ``PartitionSpec`` (over those axes only) for each of the stack's constant operands, for one
    microbatch's carried activation, and for one layer's slice of each stacked operand."""

    consts: tuple
    carry: object
    xs: tuple


@dataclass(frozen=True)
class Post:
    """How the code after the layer stack (the head and the loss) runs on one microbatch
    inside a schedule that computes the loss per microbatch (1F1B, ZB-H1), planned over the
    mesh axes other than the stage axis: a ``PartitionSpec`` (over those axes only; None: not
    read, or left to propagation) for each flat input, a per-example one at one microbatch's
    rows, and one for the stack's output; with its forward and backward's time, flops and
    wire bytes per device."""

    ins: tuple
    y: object
    time_s: float = 0.0
    flops: float = 0.0
    comm_bytes: float = 0.0


@dataclass(frozen=True)
class StageChoice:
    """What a pipelined loss runs: for the plan's record and reports."""

    axis: str
    stages: int
    layer_ranges: tuple[tuple[int, int], ...]   # [first, last) layer of each stage
    microbatches: int
    schedule: Schedule
    ticks: int                 # trip count of the emitted loop (ticks, or tabled slots)
    bubble_fraction: float     # predicted idle share of the emitted loop
    virtual_stages: int = 1
    predicted_time_s: float | None = None      # the pipelined stack (None: not priced)
    activation_bytes: int | None = None        # kept per device at the fullest stage
    flops: float = 0.0                         # of the pipelined stack, per device
    comm_bytes: float = 0.0                    # of the pipelined stack, per device
    sends: int = 0                             # its stage-to-stage collective-permutes
    send_bytes: float = 0.0                    # and their bytes, per device
    # its layers' collectives: ((kind, executions, wire bytes per device), ...)
    layer_collectives: tuple[tuple[str, int, float], ...] = ()
    inner: Inner | None = None
    post: Post | None = None


@dataclass(frozen=True)
class Prepared:
    """A loss checked for pipelining, with every choice made."""

    full: split.Stack            # traced on the whole batch
    micro: split.Stack           # traced on one microbatch
    per_example: tuple[bool, ...]  # flat inputs whose leading axis is the batch
    axis: str
    stages: int
    microbatches: int
    schedule: Schedule
    loss_weight: float           # loss = weight * sum of the microbatch traces' losses
    virtual_stages: int = 1      # layer chunks per stage (interleaved)
    priced: search.Priced | None = None  # None: chosen without pricing (no layer planner)
    post: Post | None = None     # the head and loss's plan (per-microbatch schedules only)
    # per constant operand of the stack: whether it holds the batch on its leading axis (a
    # mask or positions made from the batch), split into microbatches as the carry is
    batch_consts: tuple[bool, ...] = ()
    # per auxiliary output of the loss (``has_aux``, per-microbatch schedules): how the
    # microbatches' values combine, and a sum's weight
    aux: tuple[tuple[Aux, float], ...] = ()

    @property
    def inner(self) -> Inner | None:
        """The stage's specs over the other mesh axes (None: replicated over them)."""
        return None if self.priced is None else self.priced.layer.inner

    def choice(self) -> StageChoice:
        """What runs: the layer ranges are stage s's, or with v virtual stages, chunk c's
        (chunk c = r*S + s runs on stage s)."""
        priced = self.priced
        v = self.virtual_stages
        return StageChoice(
            axis=self.axis, stages=self.stages,
            layer_ranges=split.chunk_ranges(self.full.layers, self.stages * v),
            microbatches=self.microbatches, schedule=self.schedule,
            ticks=ticks(self.schedule, self.stages, self.microbatches, v),
            bubble_fraction=table_bubble(self.schedule, self.stages, self.microbatches, v),
            virtual_stages=v,
            predicted_time_s=None if priced is None else priced.time_s,
            activation_bytes=None if priced is None else priced.activation_bytes,
            flops=0.0 if priced is None else priced.flops,
            comm_bytes=0.0 if priced is None else priced.comm_bytes,
            sends=0 if priced is None else priced.sends,
            send_bytes=0.0 if priced is None else priced.send_bytes,
            layer_collectives=() if priced is None else priced.layer_collectives,
            inner=self.inner, post=self.post)


def prepare(fun: Callable, flat_args, is_param: list[bool], arg_index: list[int],
            request: StageRequest, mesh, has_aux: bool,
            plan_layer: Callable[[split.Stack], search.LayerPlan] | None = None,
            plan_post: Callable[[split.Stack, tuple[bool, ...]], Post] | None = None
            ) -> Prepared:
    """Check ``fun`` (a function of ``flat_args``) and the request against ``mesh``, and
    settle what the request left open (``arg_index``: the loss's positional argument each
    of ``flat_args`` is a leaf of, for ``request.batch_argnums``): with ``plan_layer`` (one
    layer traced on one microbatch -> its plan over the other mesh axes), by the stage
    search (:mod:`.search`);
    without, the default microbatch count and 1f1b where it is exact. ``plan_post`` (the
    code after the stack traced on one microbatch -> its plan over the other mesh axes) plans
    the head and loss that 1F1B and ZB-H1 run inside their region, and prices them."""
    if request.axis not in mesh.shape:
        raise PipelineError(
            f"`Pipeline(axis={request.axis!r})` names an axis the mesh lacks (its axes: "
            f"{', '.join(mesh.axis_names)}). Name one of them, or add a {request.axis!r} axis.")
    stages = mesh.shape[request.axis]
    if request.stages is not None and request.stages != stages:
        raise PipelineError(
            f"`Pipeline(stages={request.stages})` differs from the size of mesh axis "
            f"{request.axis!r} ({stages}); one stage per device along it: set `stages={stages}` "
            "or leave it None.")
    full = split.find_stack(split.trace(fun, flat_args), is_param)
    batch = _batch_size(full)
    per_example = _per_example(flat_args, is_param, arg_index, request.batch_argnums, batch)
    with _naming_batch(per_example, arg_index, request.batch_argnums, batch):
        return _settled(fun, flat_args, is_param, request, stages, has_aux, plan_layer,
                        plan_post, full, batch, per_example)


def _settled(fun, flat_args, is_param, request, stages, has_aux, plan_layer, plan_post, full,
             batch, per_example) -> Prepared:
    """:func:`prepare` once the stack and the batch arguments are found."""
    batch_consts = _check_operands(full, per_example)
    if full.layers < stages:
        raise PipelineError(
            f"the layer stack has {full.layers} layers, fewer than the {stages} stages of mesh "
            f"axis {request.axis!r}, so some stage would hold none; pipeline over an axis of at "
            f"most {full.layers} devices, or stack more layers.")
    virtual = _virtual_stages(request, full.layers, stages)
    # stacked positions per stage: stages the layers do not divide are padded (split.padded)
    per_stage = virtual * -(-full.layers // (stages * virtual))
    counts = ([_microbatches(request.microbatches, batch, stages)]
              if request.microbatches is not None or plan_layer is None
              else _microbatch_options(batch, stages))
    options = []
    for micro_n in counts:
        try:
            micro = _trace_micro(fun, flat_args, per_example, batch // micro_n, is_param, full,
                                 batch_consts)
            feasible = _feasible(request.schedule, full, micro, per_example, has_aux,
                                 batch_consts)
        except PipelineError as e:
            if batch // micro_n > 1:
                raise
            raise PipelineError(
                f"`Pipeline(microbatches={micro_n})` leaves one example a microbatch, and a "
                f"program traced on one example can lose its batch axis (a dimension of size 1 "
                f"squeezed or broadcast), so autopar could not prove the microbatches exact. "
                f"Use at most {batch // 2} microbatches (for example "
                f"{_default_microbatches(batch, stages)}). On one example: {e}") from e
        if virtual > 1 and micro_n < stages:
            raise PipelineError(
                f"the interleaved schedule needs at least as many microbatches as stages "
                f"({micro_n} < {stages}); set `Pipeline(microbatches=...)` to at least {stages}.")
        if plan_layer is None:   # no pricing: 1f1b where it is exact (it holds the least)
            schedule, weight, aux = feasible[min(1, len(feasible) - 1)]
            return Prepared(full=split.padded(full, stages * virtual),
                            micro=split.padded(micro, stages * virtual), per_example=per_example,
                            axis=request.axis, stages=stages, microbatches=micro_n,
                            schedule=schedule, loss_weight=weight, virtual_stages=virtual,
                            batch_consts=batch_consts, aux=aux)
        layer = plan_layer(micro)
        post = (plan_post(micro, per_example) if plan_post is not None
                and any(f[0] in search.PER_MICROBATCH for f in feasible) else None)
        for schedule, weight, aux in feasible:
            own = post if schedule in search.PER_MICROBATCH else None
            priced = search.price(schedule, stages, micro_n, per_stage, layer, virtual, own)
            options.append((priced, micro, weight, own, aux))
    chosen = search.best([o[0] for o in options], request.activation_budget_bytes)
    _, micro, weight, post, aux = next(o for o in options if o[0] is chosen)
    return Prepared(full=split.padded(full, stages * virtual),
                    micro=split.padded(micro, stages * virtual), per_example=per_example,
                    axis=request.axis, stages=stages, microbatches=chosen.microbatches,
                    schedule=chosen.schedule, loss_weight=weight, virtual_stages=virtual,
                    priced=chosen, post=post, batch_consts=batch_consts, aux=aux)


def _per_example(flat_args, is_param, arg_index, batch_argnums, batch: int
                 ) -> tuple[bool, ...]:
    """Per flat input, whether it is a batch argument's leaf (split into microbatches on its
    leading axis): a leaf of ``batch_argnums``, which must lead with the batch, or without
    them every leaf not differentiated whose leading axis has the batch's size."""
    if batch_argnums is None:
        return tuple(not p and np.ndim(a) >= 1 and np.shape(a)[0] == batch
                     for a, p in zip(flat_args, is_param, strict=True))
    for a, i in zip(flat_args, arg_index, strict=True):
        if i in batch_argnums and (np.ndim(a) < 1 or np.shape(a)[0] != batch):
            raise PipelineError(
                f"`Pipeline(batch_argnums={batch_argnums})` names argument {i} of the loss, "
                f"which holds an array of shape {tuple(np.shape(a))}: a batch argument's arrays "
                f"lead with the batch ({batch} examples, the layer stack's carried "
                "activation's leading size). Name only the arguments that hold the batch.")
    return tuple(i in batch_argnums for i in arg_index)


@contextlib.contextmanager
def _naming_batch(per_example, arg_index, batch_argnums, batch: int) -> Iterator[None]:
    """Without ``batch_argnums``, a refusal because the code mixes examples also names the
    arguments taken for the batch by their size (one may be a table with as many rows), and
    ``batch_argnums``."""
    try:
        yield
    except batch_axes.MixesError as e:
        if batch_argnums is not None:
            raise
        taken = ", ".join(str(i) for i in sorted({i for i, p in zip(arg_index, per_example,
                                                                   strict=True) if p}))
        raise PipelineError(
            f"{e} autopar split arguments {taken} of the loss into microbatches: each argument "
            f"not differentiated whose arrays lead with {batch} rows (the batch's size) is "
            "taken for a batch argument. If one of them is not (a table shared by every "
            "example, say), name the batch arguments: `autopar.Pipeline(batch_argnums=...)`."
        ) from None


def _batch_size(stack: split.Stack) -> int:
    if stack.num_carry != 1 or not stack.carry_shape:
        raise PipelineError(
            "the layer stack's scan must carry one activation array with the batch axis first "
            f"(it carries {stack.num_carry} values); move other carried values (auxiliary "
            "losses, counters) out of the scanned layers.")
    return stack.carry_shape[0]


def _check_operands(stack: split.Stack, per_example) -> tuple[bool, ...]:
    """Per constant operand of the stack, whether it holds the batch on its leading axis
    (split into microbatches with the carry); raises where the batch runs elsewhere."""
    pre = split.trace(split.pre_fn(stack), stack.jaxpr.in_avals)
    states = batch_axes.analyze(pre, [0 if p else None for p in per_example], Mode.PRE,
                                "the code before the layer stack").outputs
    consts, carry = states[: stack.num_consts], states[stack.num_consts]
    xs = states[stack.num_consts + 1:]
    if carry is None:
        raise PipelineError(
            "the layer stack's carried activation is computed from no batch argument of the "
            "loss (one it is not differentiated by, whose leading axis is the batch): only the "
            "loss's own arguments are split into microbatches, so a batch the loss reads from "
            "an enclosing function is not, nor one in its `argnums` (those count as "
            "parameters). Pass the batch to the loss as an argument "
            "(`autopar.value_and_grad(loss_fn)(params, batch)`) and differentiate by the "
            "parameters only, or plan with `pipeline=None`.")
    if carry != 0:
        raise PipelineError(
            "the layer stack's carried activation does not have the batch (the leading axis of "
            "the batch arguments) as its first axis; keep the batch axis first.")
    if any(s not in (None, 0) for s in consts):
        raise PipelineError(
            "a value computed from the batch enters the layer stack with the batch on an axis "
            "other than its first (a mask or position array passed to the scanned layers); "
            "pipelining splits such values into microbatches on their leading axis. Keep the "
            "batch axis first, or plan with `pipeline=None`.")
    if any(s is not None for s in xs):
        raise PipelineError(
            "a value computed from the batch is stacked per layer and scanned over (a per-layer "
            "mask); pipelining splits only the layers' shared operands into microbatches. Pass "
            "it to every layer unstacked, or plan with `pipeline=None`.")
    if split.ys_used(stack):
        raise PipelineError(
            "the code after the layer stack reads the stack's per-layer outputs; pipelining "
            "passes on only the final activation. Return `None` as the scan's per-layer output.")
    return tuple(s == 0 for s in consts)


def _microbatches(asked: int | None, batch: int, stages: int) -> int:
    if asked is not None:
        if batch % asked:
            raise PipelineError(
                f"`Pipeline(microbatches={asked})` does not divide the batch of {batch} examples; "
                f"use a divisor of {batch} (for example {_default_microbatches(batch, stages)}).")
        return asked
    return _default_microbatches(batch, stages)


def _default_microbatches(batch: int, stages: int) -> int:
    """The smallest divisor of ``batch`` from 2S up that leaves microbatches of at least two
    examples (one-example traces can lose the batch axis); else the largest that does."""
    fits = [d for d in range(1, batch + 1) if batch % d == 0 and batch // d >= 2] or [1]
    return next((d for d in fits if d >= 2 * stages), fits[-1])


def _virtual_stages(request: StageRequest, layers: int, stages: int) -> int:
    """Layer chunks per stage: 1 unless the schedule is interleaved (default 2)."""
    if request.schedule is not Schedule.INTERLEAVED:
        return 1
    v = request.virtual_stages or 2
    if layers < stages * v:
        given = ("" if request.virtual_stages else
                 " (`virtual_stages` defaults to 2: interleaving needs two chunks a stage)")
        fix = (f"choose `virtual_stages` of at most {layers // stages}"
               if layers // stages >= 2 else
               f"interleaving needs at least {2 * stages} layers on {stages} stages: use "
               "`schedule=\"1f1b\"` or `\"gpipe\"`, or fewer stages")
        raise PipelineError(
            f"the interleaved schedule cuts the {layers} layers into {stages} stages x {v} "
            f"virtual stages = {stages * v} chunks, more than there are layers{given}; "
            f"{fix}.")
    return v


def _microbatch_options(batch: int, stages: int) -> list[int]:
    """Microbatch counts the search prices: divisors of ``batch`` from ``stages`` up (fewer
    leave stages idle) that leave at least two examples each, at most
    :data:`MAX_MICROBATCH_OPTIONS` of them spread from the smallest to the largest."""
    counts = [d for d in range(stages, batch + 1) if batch % d == 0 and batch // d >= 2]
    if not counts:
        return [_default_microbatches(batch, stages)]
    if len(counts) <= MAX_MICROBATCH_OPTIONS:
        return counts
    picks = {counts[round(i * (len(counts) - 1) / (MAX_MICROBATCH_OPTIONS - 1))]
             for i in range(MAX_MICROBATCH_OPTIONS)}
    return sorted(picks)


def _trace_micro(fun, flat_args, per_example, rows: int, is_param, full,
                 batch_consts) -> split.Stack:
    specs = [jax.ShapeDtypeStruct((rows, *np.shape(a)[1:]) if p else np.shape(a), a.dtype)
             for a, p in zip(flat_args, per_example, strict=True)]
    micro = split.find_stack(jax.make_jaxpr(fun)(*specs), is_param)
    if micro.index != full.index or micro.layers != full.layers:
        raise PipelineError(
            "the loss traces to a different program on one microbatch than on the whole batch "
            "(its layer stack moved); make the code before the stack independent of the batch "
            "size.")
    where = "the scanned layers"
    body = [micro.eqn.params["jaxpr"], full.eqn.params["jaxpr"]]
    found = [batch_axes.analyze(b, _body_states(micro, batch_consts), Mode.BODY, where)
             for b in body]
    if found[0].outputs[: micro.num_carry] != [0]:
        raise PipelineError("the scanned layers move the batch axis of their carried activation; "
                            "keep it first.")
    if found[0].literals != found[1].literals:
        raise PipelineError(
            "the scanned layers use a constant that depends on the batch size (a literal changes "
            "when the batch is split into microbatches); compute per example instead.")
    batch_axes.check_draws(found, "the scanned layers", batch_axes.FIX_IN_LAYERS)
    return micro


def _body_states(stack: split.Stack, batch_consts) -> list:
    n_xs = len(stack.eqn.invars) - stack.num_consts - 1
    return [0 if b else None for b in batch_consts] + [0] + [None] * n_xs


def _feasible(asked, full, micro, per_example, has_aux, batch_consts
              ) -> list[tuple[Schedule, float, tuple]]:
    """The schedules that can run this loss exactly (the one asked, else 1F1B where it is
    exact and GPipe where it is not), each with the loss weight it runs under and how its
    auxiliary outputs combine (:attr:`Prepared.aux`)."""
    if asked in (Schedule.GPIPE, Schedule.INTERLEAVED):   # the loss runs on the whole batch
        return [(asked, 1.0, ())]
    try:
        if asked in TABLED:
            _tabled_refusals(asked, full, batch_consts, has_aux)
        weight, aux = _loss_weight(full, micro, per_example, has_aux)
    except PipelineError:
        if asked is None:
            return [(Schedule.GPIPE, 1.0, ())]
        raise
    if asked is not None:
        return [(asked, weight, aux)]
    # ZB-H1 only when asked: it is slower than 1F1B as compiled (docs/pipeline.md). GPipe
    # recomputes as 1F1B does, so its ticks cost the same, and it holds more
    return [(Schedule.ONE_F_ONE_B, weight, aux)]


def _tabled_refusals(asked: Schedule, full: split.Stack, batch_consts, has_aux: bool) -> None:
    """Raise where the loss is beyond what ``asked`` (a tabled schedule, which stores and
    replays each layer's pullback) handles."""
    if has_aux:
        raise PipelineError(
            f"`has_aux=True` with {asked.value}: it does not combine auxiliary outputs across "
            "microbatches yet. Use `Pipeline(schedule=\"1f1b\")` or drop `has_aux`.")
    ops = full.eqn.invars[: full.num_consts] + full.eqn.invars[full.num_consts + 1:]
    if not all(jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact) for v in ops):
        raise PipelineError(
            f"the scanned layers read integer operands besides their activation; {asked.value} "
            "stores each layer's pullback and does not handle them yet. Use "
            "`Pipeline(schedule=\"1f1b\")`.")
    if any(batch_consts):
        raise PipelineError(
            f"a value computed from the batch enters the scanned layers (a mask or position "
            f"array); {asked.value} does not split it into microbatches yet. Use "
            "`Pipeline(schedule=\"1f1b\")`.")


def _loss_weight(full, micro, per_example, has_aux: bool) -> tuple[float, tuple]:
    """``w`` with loss(batch) = w * sum of loss(microbatch), proved from both traces; with
    ``has_aux``, how each auxiliary output combines across microbatches (:class:`Aux`, and a
    sum's weight)."""
    found = []
    for stack in (full, micro):
        n_outs = len(stack.eqn.outvars)
        states = [0 if p else None for p in per_example] + [0] + [None] * (n_outs - 1)
        post = split.post_fn(stack)
        n_ins = len(per_example)
        traced = split.trace(lambda *flat: post(flat[:n_ins], flat[n_ins:]),
                             list(stack.jaxpr.in_avals) + [v.aval for v in stack.eqn.outvars])
        found.append(batch_axes.analyze(traced, states, Mode.LOSS, "the loss after the layers"))
    batch_axes.check_draws(found, "the loss after the layers", batch_axes.FIX_IN_LOSS)
    if found[0].literals != found[1].literals:
        raise PipelineError(
            "the loss uses a constant that depends on the batch size outside its final mean; "
            "use `Pipeline(schedule=\"gpipe\")`, which computes the loss on the whole batch.")
    if not isinstance(found[0].outputs[0], BatchSum):
        raise PipelineError(
            "the loss is not a sum or mean over examples (it does not reduce over the batch); "
            "1f1b computes it per microbatch. Use `Pipeline(schedule=\"gpipe\")`.")
    weight = _weight(found[0].outputs[0], found[1].outputs[0], "the loss")
    if not has_aux:
        return weight, ()
    return weight, tuple(_combined(f, m, k) for k, (f, m) in enumerate(
        zip(found[0].outputs[1:], found[1].outputs[1:], strict=True)))


def _weight(full: BatchSum, micro: BatchSum, what: str) -> float:
    """``w`` with the full batch's value = w * the sum of the microbatches'."""
    if len(full.scales) != len(micro.scales):
        raise PipelineError(
            f"{what} uses a constant that depends on the batch size outside its final mean; "
            "use `Pipeline(schedule=\"gpipe\")`, which computes the loss on the whole batch.")
    ratios = [a / b for (_, a), (_, b) in zip(full.scales, micro.scales, strict=True)]
    if not all(math.isclose(r, ratios[0], rel_tol=1e-6) for r in ratios):
        raise PipelineError(
            f"{what} adds sums over examples normalized differently (a mean plus a sum); "
            "1f1b cannot weight its microbatches exactly. Use `Pipeline(schedule=\"gpipe\")`.")
    return ratios[0]


def _combined(full, micro, k: int) -> tuple[Aux, float]:
    """How auxiliary output ``k`` (its states in the two traces) combines across
    microbatches."""
    if isinstance(full, BatchSum) and isinstance(micro, BatchSum):
        return Aux.SUM, _weight(full, micro, f"auxiliary output {k}")
    if full == micro == 0:
        return Aux.EXAMPLES, 1.0
    if full is None and micro is None:
        return Aux.SAME, 1.0
    raise PipelineError(
        f"auxiliary output {k} of the loss is neither a sum or mean over examples, nor per "
        "example with the batch axis first, nor independent of the batch, so 1f1b cannot "
        "combine it across microbatches. Use `Pipeline(schedule=\"gpipe\")`.")
