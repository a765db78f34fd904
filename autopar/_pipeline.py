"""``autopar.Pipeline`` (what the user asks of a pipeline) and the pipelining context that
autopar enters around tracing a train step, inside which ``autopar.value_and_grad`` pipelines.

Example::

    settings = autopar.Pipeline(axis="stage", schedule="1f1b", microbatches=8)
    with pipelining(settings, mesh) as ctx:
        jax.jit(train_step).lower(*args)   # the step calls autopar.value_and_grad
    assert ctx.calls >= 1
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import jax

from autopar._compat import trace_context_state
from autopar.errors import ArgumentError, PipelineError
from autopar.passes.estimate import Estimate
from autopar.passes.stages.prepare import StageChoice, StageRequest
from autopar.passes.stages.schedules import Schedule

_NAMES = ", ".join(f'"{s.value}"' for s in Schedule)


@dataclass(frozen=True)
class Pipeline:
    """Pipeline settings; a field left ``None`` is chosen by autopar.

    Arguments:
        axis: the mesh axis whose devices hold successive stages (default ``"stage"``).
        stages: number of stages (today: the size of ``axis``).
        microbatches: how many microbatches the batch is split into (must divide it).
        schedule: one of ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``.
        virtual_stages: model chunks per device (``"interleaved"`` only).
        batch_argnums: which positional arguments of the loss (the function given to
            ``autopar.value_and_grad``) hold the batch, split into microbatches on their
            leading axis (an int or a tuple). None (the default): every argument not
            differentiated whose arrays lead with the batch's size; name them where another
            argument (a shared table, say) happens to have as many rows.
    """

    axis: str = "stage"
    stages: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    batch_argnums: int | tuple[int, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.axis, str) or not self.axis:
            raise ArgumentError(f"`Pipeline(axis={self.axis!r})` must be a mesh axis name (a "
                                "non-empty string), for example `axis=\"stage\"`.")
        for name in ("stages", "microbatches", "virtual_stages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ArgumentError(f"`Pipeline({name}={value!r})` must be a positive integer "
                                    "or None (autopar chooses).")
        if self.batch_argnums is not None:
            object.__setattr__(self, "batch_argnums", _argnums(self.batch_argnums))
        if self.schedule is not None and self.schedule not in {s.value for s in Schedule}:
            raise ArgumentError(f"`Pipeline(schedule={self.schedule!r})` is not a schedule; "
                                f"use one of {_NAMES}, or None (autopar chooses).")
        if (self.virtual_stages or 1) > 1 and self.schedule not in (None, "interleaved"):
            raise ArgumentError(
                f"`Pipeline(virtual_stages={self.virtual_stages})` needs "
                f"`schedule=\"interleaved\"` (it was {self.schedule!r}).")

    @property
    def schedule_kind(self) -> Schedule | None:
        """``schedule`` as a :class:`Schedule` (None: autopar chooses)."""
        return None if self.schedule is None else Schedule(self.schedule)

    def request(self) -> StageRequest:
        """The request the stage pass reads."""
        return StageRequest(axis=self.axis, stages=self.stages, microbatches=self.microbatches,
                            schedule=self.schedule_kind, virtual_stages=self.virtual_stages,
                            batch_argnums=self.batch_argnums)


def _argnums(value) -> tuple[int, ...]:
    """``batch_argnums`` as a sorted tuple of distinct argument positions."""
    items = (value,) if isinstance(value, int) else value
    try:
        items = tuple(items)
    except TypeError:
        items = (None,)
    if not items or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                            for i in items):
        raise ArgumentError(
            f"`Pipeline(batch_argnums={value!r})` must be the position of a positional argument "
            "of the loss, or a tuple of them (non-negative integers), for example "
            "`batch_argnums=(1, 2)`.")
    return tuple(sorted(set(items)))


@dataclass(eq=False)  # hashed by identity: it keys jax's trace caches (see _TRACE_KEY)
class PipelineContext:
    """An active pipelining context: the settings, the mesh, how often
    ``autopar.value_and_grad`` / ``autopar.grad`` ran inside it (``calls``), and what each
    pipelined call chose (``chosen``)."""

    settings: Pipeline | None                 # None: only count the marked calls
    mesh: jax.sharding.Mesh
    plan_layer: Callable | None = None         # the stage search's layer planner
    plan_post: Callable | None = None          # and its planner of the head and loss
    activation_budget_bytes: float | None = None
    calls: int = 0
    chosen: list[StageChoice] = field(default_factory=list)

    def request(self) -> StageRequest:
        """What the stage pass is asked."""
        return dataclasses.replace(self.settings.request(),
                                   activation_budget_bytes=self.activation_budget_bytes)


_ACTIVE: contextvars.ContextVar[PipelineContext | None] = contextvars.ContextVar(
    "autopar_pipelining", default=None)

#: The active context also enters jax's trace context, so that a function jitted (or
#: make_jaxpr'ed) outside a pipelining context is traced again inside one instead of reusing
#: the cached, unpipelined trace. jax offers no public hook for this.
_TRACE_KEY = trace_context_state(
    "autopar_pipelining_context",
    "The active autopar pipelining context (set by autopar; part of jax's trace cache key).")


@contextlib.contextmanager
def pipelining(settings: Pipeline, mesh: jax.sharding.Mesh, plan_layer: Callable | None = None,
               activation_budget_bytes: float | None = None,
               plan_post: Callable | None = None) -> Iterator[PipelineContext]:
    """Within this block, ``autopar.value_and_grad`` and ``autopar.grad`` pipeline their loss
    over ``mesh`` as ``settings`` ask. Yields the :class:`PipelineContext` (read ``calls``).
    ``plan_layer`` (``autopar._stage_plan.layer_planner``): plan and price each stage over the
    other mesh axes and let the stage search choose what ``settings`` leave open; without
    it, stages run replicated over the other axes. ``plan_post``
    (``autopar._stage_plan.post_planner``): plan and price the head and loss that 1F1B and
    ZB-H1 run inside the region; without it, propagation splits them."""
    if not isinstance(settings, Pipeline) and settings is not MARK:
        raise ArgumentError(f"`pipelining(settings=...)` takes an `autopar.Pipeline`, not "
                            f"{type(settings).__name__}.")
    context = PipelineContext(settings=None if settings is MARK else settings, mesh=mesh,
                              plan_layer=plan_layer, plan_post=plan_post,
                              activation_budget_bytes=activation_budget_bytes)
    token = _ACTIVE.set(context)
    try:
        with _TRACE_KEY(context):
            yield context
    finally:
        _ACTIVE.reset(token)


def active() -> PipelineContext | None:
    """The innermost active pipelining context, or None."""
    return _ACTIVE.get()


#: ``plan(pipeline=MARK)`` (internal): trace without pipelining, counting the calls of
#: ``autopar.value_and_grad`` (does the step mark its loss?).
MARK = "mark"


def requested(pipeline, mesh: jax.sharding.Mesh):
    """The pipeline ``plan(pipeline=...)`` asks for: None for ``None`` and ``"auto"`` (which
    ``plan`` resolves by planning each candidate), :data:`MARK`, or the settings of an
    :class:`Pipeline` whose axis is on ``mesh``."""
    if pipeline is None or pipeline == "auto":
        return None
    if pipeline == MARK:
        return MARK
    if not isinstance(pipeline, Pipeline):
        raise ArgumentError(f"`pipeline` must be None, \"auto\" or an `autopar.Pipeline(...)`, "
                            f"not {pipeline!r}")
    if pipeline.axis not in mesh.axis_names:
        default = (" (the default axis; give `axis=`, with the CLI `--pipeline axis=NAME,...`)"
                   if pipeline.axis == Pipeline.axis else "")
        raise PipelineError(f"`Pipeline(axis={pipeline.axis!r})`{default}: the mesh has no such "
                            f"axis (it has {', '.join(mesh.axis_names)}); name one of them, or "
                            f"add a `{pipeline.axis}` axis to the mesh.")
    return pipeline


def planning(settings: Pipeline | None, mesh: jax.sharding.Mesh, plan_layer=None,
             activation_budget_bytes=None, plan_post=None):
    """The context ``plan()`` traces the step in: :func:`pipelining`, or nothing."""
    if settings is None:
        return contextlib.nullcontext()
    return pipelining(settings, mesh, plan_layer, activation_budget_bytes, plan_post)


def marked(context: PipelineContext | None) -> bool:
    """Whether the step traced in ``context`` called ``autopar.value_and_grad``/``grad``."""
    return context is not None and context.calls > 0


def candidate_axes(mesh: jax.sharding.Mesh, levels: dict, fits: bool) -> list[str]:
    """The mesh axes ``pipeline="auto"`` tries to pipeline over: those on a slower link than
    the mesh's fastest (across nodes or slices); every axis of two or more devices when the
    plan that does not pipeline does not ``fit``."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    axes = [a for a in mesh.axis_names if sizes[a] > 1]
    if not fits:
        return axes
    fastest = max(levels[a].bandwidth_bytes_per_s for a in axes) if axes else 0.0
    return [a for a in axes if levels[a].bandwidth_bytes_per_s < fastest]


def with_stages(est: Estimate, context: PipelineContext | None) -> Estimate:
    """``est`` (which prices each pipeline region as free) with the pipelined stacks' priced
    time in its compute time, their activations in its peak, and their flops and wire bytes
    (their layers' work, collectives and stage-to-stage sends) in its own."""
    if context is None:
        return est
    priced = [c for c in context.chosen if c.predicted_time_s is not None]
    time_s = sum(c.predicted_time_s for c in priced)
    held = sum(c.activation_bytes for c in priced)
    return dataclasses.replace(est, step_time_s=est.step_time_s + time_s,
                               compute_time_s=est.compute_time_s + time_s,
                               peak_memory_bytes=est.peak_memory_bytes + held,
                               flops=est.flops + sum(c.flops for c in priced),
                               comm_bytes=est.comm_bytes + sum(c.comm_bytes for c in priced))


def record(context: PipelineContext | None, est: Estimate) -> dict | None:
    """``plan.pipeline``: what the step's pipelined loss runs (None when it does not), with
    the per-stage peak ``est`` predicts. PipelineError when a pipeline was asked and the step
    never marked its loss."""
    if context is None or context.settings is None:
        return None
    if context.calls == 0:
        raise PipelineError(
            "`pipeline=` needs the loss marked: the step never called "
            "`autopar.value_and_grad` or `autopar.grad`. Change `jax.value_and_grad(loss_fn)` "
            "to `autopar.value_and_grad(loss_fn)` in the step (nothing else changes), or plan "
            "with `pipeline=None`.")
    chosen = context.chosen[0]
    return {"axis": chosen.axis, "stages": chosen.stages,
            "layer_ranges": [tuple(r) for r in chosen.layer_ranges],
            "microbatches": chosen.microbatches, "schedule": chosen.schedule.value,
            "virtual_stages": chosen.virtual_stages, "ticks": chosen.ticks,
            "bubble_fraction": chosen.bubble_fraction,
            "predicted_time_s": chosen.predicted_time_s,
            "activation_bytes": chosen.activation_bytes,
            "flops": chosen.flops, "comm_bytes": chosen.comm_bytes,
            "sends": chosen.sends, "send_bytes": chosen.send_bytes,
            "layer_collectives": {kind: (count, nbytes)
                                  for kind, count, nbytes in chosen.layer_collectives},
            "stage_peak_bytes": [est.peak_memory_bytes] * chosen.stages,
            "inner": None if chosen.inner is None else _inner_record(chosen.inner),
            "post": None if chosen.post is None else _post_record(chosen.post)}


def _text(spec) -> str | None:
    return None if spec is None else str(tuple(spec))


def _inner_record(inner) -> dict:
    return {"consts": [_text(s) for s in inner.consts], "carry": _text(inner.carry),
            "layer": [_text(s) for s in inner.xs]}


def _post_record(post) -> dict:
    """The head and loss's plan: the spec of each flat input of the step's loss (None: not
    read, or left to propagation) and of the stack's output, and its time per microbatch."""
    return {"inputs": [_text(s) for s in post.ins], "output": _text(post.y),
            "time_s": post.time_s}
