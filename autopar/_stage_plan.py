"""Plan one pipeline stage's layer, and the head and loss after the stack, over the mesh axes
other than the stage axis.

The stage search (``passes.stages.search``) prices each microbatch count from one layer:
its forward and backward on one microbatch, planned by :func:`autopar.plan` on the sub-mesh
the stage's devices form. The plan's input specs become the stage's specs over those axes
(the emitted region holds its operands in them), and its estimate gives the layer's time and
the activations it keeps. 1F1B and ZB-H1 also run the code after the stack (the head and
the loss) inside the region, once per microbatch: it is planned the same way, so the head's
weights and work split over those axes as the plan says, and its time is priced.

Example::

    plan_layer = layer_planner(mesh, "stage", get_profile("h100"), None, autopar.plan)
    layer = plan_layer(micro_stack)     # a search.LayerPlan
    plan_post = post_planner(mesh, "stage", get_profile("h100"), None, autopar.plan)
    post = plan_post(micro_stack, per_example)   # a prepare.Post
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from autopar.cost_model.hardware import axis_levels
from autopar.passes.estimate import by_kind
from autopar.passes.ir import itemsize
from autopar.passes.stages import split
from autopar.passes.stages.prepare import Inner, Post
from autopar.passes.stages.search import Forward, LayerPlan
from autopar.passes.strategies import wire_itemsize

#: The ILP time limit of one layer's plan (the layer is small; it rarely needs it).
LAYER_TIME_LIMIT_S = 20.0


def sub_mesh(mesh: Mesh, axis: str) -> Mesh:
    """The devices of the first stage, with the other axes' names."""
    i = mesh.axis_names.index(axis)
    names = tuple(n for n in mesh.axis_names if n != axis)
    return Mesh(np.take(mesh.devices, 0, axis=i), names,
                axis_types=tuple(t for n, t in zip(mesh.axis_names, mesh.axis_types,
                                                   strict=True) if n != axis))


def _abstract(avals) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in avals]


def _layer(micro: split.Stack) -> tuple[Callable, list, int]:
    """``layer(consts, x, xs) -> y``: one layer on one microbatch (``xs``: one layer's slice),
    its abstract arguments, and the count of consts."""
    stage = split.stage_fn(micro)
    n = micro.num_consts
    avals = [v.aval for v in micro.eqn.invars]
    consts, carry, xs = avals[:n], avals[n], avals[n + 1:]
    layer_xs = [jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype) for a in xs]

    def layer(c, x, xs):
        return stage(c, [x], [a[None] for a in xs])[0]

    return layer, [_abstract(consts), _abstract([carry])[0], layer_xs], n


def _step(layer: Callable) -> Callable:
    """``step(consts, x, xs, ct) -> (d_consts, dx, d_xs)``: the layer's forward and backward."""
    def step(consts, x, xs, ct):
        _, pull = jax.vjp(layer, consts, x, xs)
        return pull(ct)
    return step


def _kept_bytes(layer: Callable, args: list) -> int:
    """Bytes of what the layer's forward keeps for its backward (its vjp's residuals), less its
    own arguments (held anyway), over all devices."""
    residuals = jax.eval_shape(lambda *a: jax.vjp(layer, *a)[1], *args)
    total = sum(math.prod(r.shape) * itemsize(r.dtype)
                for r in jax.tree.leaves(residuals))
    own = sum(math.prod(a.shape) * itemsize(a.dtype) for a in jax.tree.leaves(args))
    return max(total - own, 0)


def _per_device_bytes(struct, spec, sizes: dict[str, int]) -> int:
    shards = 1
    for entry in (spec or ()):
        for name in (entry if isinstance(entry, tuple) else (entry,)):
            shards *= sizes.get(name, 1) if name is not None else 1
    return math.prod(struct.shape) * itemsize(struct.dtype) // shards


def _planner(mesh: Mesh, axis: str, profile, axis_level_overrides, plan: Callable
             ) -> tuple[Mesh, Callable]:
    """The sub-mesh of a stage, and ``plan_on_it(fn, *args, in_shardings=None,
    out_shardings=None)``: ``plan``
    (:func:`autopar.plan`) on it, as a stage's region emits its code (no rewrites, no remat)."""
    inner_mesh = sub_mesh(mesh, axis)
    overrides = {k: v for k, v in (axis_level_overrides or {}).items() if k != axis}

    def plan_on_it(fn: Callable, *args, in_shardings=None, out_shardings=None):
        return plan(fn, *args, mesh=inner_mesh, hardware=profile, in_shardings=in_shardings,
                    out_shardings=out_shardings,
                    axis_level_overrides=overrides or None, pipeline=None, remat=False,
                    check_memory=False, verbose=False, time_limit_s=LAYER_TIME_LIMIT_S,
                    overlap=False)

    return inner_mesh, plan_on_it


def layer_planner(mesh: Mesh, axis: str, profile, axis_level_overrides, plan: Callable
                  ) -> Callable[[split.Stack], LayerPlan]:
    """``plan_layer(micro_stack) -> LayerPlan`` for stages over ``axis`` of ``mesh``;
    ``plan`` is :func:`autopar.plan`."""
    level = axis_levels(mesh, profile, axis_level_overrides)[axis]
    inner_mesh, plan_on_it = _planner(mesh, axis, profile, axis_level_overrides, plan)
    sizes = dict(zip(inner_mesh.axis_names, inner_mesh.devices.shape, strict=True))

    def plan_layer(micro: split.Stack) -> LayerPlan:
        layer, args, n = _layer(micro)
        planned = plan_on_it(_step(layer), *args, args[1])
        specs = [s.spec for s in jax.tree.leaves(planned.in_shardings)]
        inner = Inner(consts=tuple(specs[:n]), carry=specs[n],
                      xs=tuple(specs[n + 1:n + 1 + len(args[2])]))
        carry = _per_device_bytes(args[1], inner.carry, sizes)
        # as the permute moves it: XLA:CPU carries 16-bit floats as float32
        on_cpu = mesh.devices.flat[0].platform == "cpu"
        sent = carry * wire_itemsize(args[1].dtype, on_cpu) // itemsize(args[1].dtype)
        # the kept activations split as the layer's work does: over every other device
        kept = max(_kept_bytes(layer, args) // inner_mesh.devices.size, carry)
        # the forward alone, from the same input specs to the carry's: what a forward tick runs
        alone = plan_on_it(layer, *args, in_shardings=tuple(planned.in_shardings[:3]),
                           out_shardings=planned.in_shardings[1])
        return LayerPlan(inner=inner if inner_mesh.devices.size > 1 else None,
                         time_s=planned.estimate.step_time_s, kept_bytes=int(kept),
                         carry_bytes=carry,
                         hop_s=level.latency_s + sent / level.bandwidth_bytes_per_s,
                         send_bytes=sent,
                         devices=inner_mesh.devices.size, flops=planned.estimate.flops,
                         comm_bytes=planned.estimate.comm_bytes,
                         comm_by_kind=_by_kind(planned), forward=Forward(
                             time_s=alone.estimate.step_time_s, flops=alone.estimate.flops,
                             comm_bytes=alone.estimate.comm_bytes, comm_by_kind=_by_kind(alone)))

    return plan_layer


def _by_kind(planned) -> tuple[tuple[str, int, float], ...]:
    """``planned``'s collectives: ((kind, executions, wire bytes per device), ...)."""
    return tuple((kind, count, nbytes)
                 for kind, (count, nbytes) in by_kind(planned._details[3]).items())


def _post(micro: split.Stack) -> tuple[Callable, list, list[int]]:
    """``step(floats, others, y) -> (loss, (dy, d_floats))``: the code after the stack on one
    microbatch and its gradient, as a per-microbatch schedule's region runs it; its abstract
    arguments; and the flat input index of each of ``floats + others``."""
    reads = split.post_reads(micro)[0]
    avals = micro.jaxpr.in_avals
    read = [i for i, r in enumerate(reads) if r]
    floats = [i for i in read if jax.numpy.issubdtype(avals[i].dtype, jax.numpy.inexact)]
    others = [i for i in read if i not in floats]
    post = split.post_fn(micro)
    n_ys = len(micro.eqn.outvars) - 1

    def step(float_ins, other_ins, y):
        def loss(y, float_ins):
            ins = [None] * len(reads)
            for i, a in zip(floats + others, list(float_ins) + list(other_ins), strict=True):
                ins[i] = a
            return post(ins, [y] + [None] * n_ys)[0].astype(jax.numpy.float32)
        return jax.value_and_grad(loss, argnums=(0, 1))(y, float_ins)

    args = [_abstract([avals[i] for i in floats]), _abstract([avals[i] for i in others]),
            _abstract([micro.eqn.outvars[0].aval])[0]]
    return step, args, floats + others


def _split(spec) -> bool:
    return spec is not None and any(e is not None for e in spec)


def post_planner(mesh: Mesh, axis: str, profile, axis_level_overrides, plan: Callable
                 ) -> Callable[[split.Stack, tuple[bool, ...]], Post]:
    """``plan_post(micro_stack, per_example) -> Post``: the code after the stack (the head and
    the loss) on one microbatch, planned over the mesh axes other than ``axis``;
    ``per_example``: which flat inputs have the batch as their leading axis; ``plan`` is
    :func:`autopar.plan`.

    A plan that splits both a weight and the rows (the stack's output or a per-example input)
    is planned again with the rows whole: inside a partly manual region, XLA's SPMD
    partitioner aborts the process on a gather whose operand and indices are both split (the
    cross entropy's label lookup in logits split over the vocabulary; jax 0.10.2 and 0.12,
    ``ExpandDeviceGroupsWithIota``)."""
    inner_mesh, plan_on_it = _planner(mesh, axis, profile, axis_level_overrides, plan)

    def plan_post(micro: split.Stack, per_example: tuple[bool, ...]) -> Post:
        step, args, where = _post(micro)
        rows = [per_example[i] for i in where] + [True]     # ... and the stack's output y
        planned = plan_on_it(step, *args)
        specs = [s.spec for s in jax.tree.leaves(planned.in_shardings)]
        if (any(_split(s) for s, r in zip(specs, rows, strict=True) if not r)
                and any(_split(s) for s, r in zip(specs, rows, strict=True) if r)):
            whole = iter([P() if r else None for r in rows])
            pins = jax.tree.map(lambda _: next(whole), tuple(args))
            planned = plan_on_it(step, *args, in_shardings=pins)
            specs = [s.spec for s in jax.tree.leaves(planned.in_shardings)]
        if inner_mesh.devices.size == 1:    # nothing to split: price it only
            specs = [None] * len(specs)
        ins = [None] * len(micro.jaxpr.in_avals)
        for i, spec in zip(where, specs[:-1], strict=True):
            ins[i] = spec
        est = planned.estimate
        return Post(ins=tuple(ins), y=specs[-1], time_s=est.step_time_s, flops=est.flops,
                    comm_bytes=est.comm_bytes)

    return plan_post
