"""Plan one pipeline stage's layer over the mesh axes other than the stage axis.

The stage search (``passes.stages.search``) prices each microbatch count from one layer:
its forward and backward on one microbatch, planned by :func:`autopar.plan` on the sub-mesh
the stage's devices form. The plan's input specs become the stage's specs over those axes
(the emitted region holds its operands in them), and its estimate gives the layer's time and
the activations it keeps.

Example::

    plan_layer = layer_planner(mesh, "stage", get_profile("h100"), None, autopar.plan)
    layer = plan_layer(micro_stack)     # a search.LayerPlan
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from autopar.cost_model.hardware import axis_levels
from autopar.passes.stages import split
from autopar.passes.stages.prepare import Inner
from autopar.passes.stages.search import LayerPlan

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


def _layer_step(micro: split.Stack) -> tuple[Callable, list, int]:
    """``step(consts, x, xs, ct) -> (d_consts, dx, d_xs)``: one layer's forward and backward
    on one microbatch (``xs``: one layer's slice), its abstract arguments, and the count of
    consts."""
    stage = split.stage_fn(micro)
    n = micro.num_consts
    avals = [v.aval for v in micro.eqn.invars]
    consts, carry, xs = avals[:n], avals[n], avals[n + 1:]
    layer_xs = [jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype) for a in xs]

    def step(consts, x, xs, ct):
        def layer(c, x, xs):
            return stage(c, [x], [a[None] for a in xs])[0]
        _, pull = jax.vjp(layer, consts, x, xs)
        return pull(ct)

    carry_struct = _abstract([carry])[0]
    return step, [_abstract(consts), carry_struct, layer_xs, carry_struct], n


def _per_device_bytes(struct, spec, sizes: dict[str, int]) -> int:
    shards = 1
    for entry in (spec or ()):
        for name in (entry if isinstance(entry, tuple) else (entry,)):
            shards *= sizes.get(name, 1) if name is not None else 1
    return math.prod(struct.shape) * np.dtype(struct.dtype).itemsize // shards


def layer_planner(mesh: Mesh, axis: str, profile, axis_level_overrides, plan: Callable
                  ) -> Callable[[split.Stack], LayerPlan]:
    """``plan_layer(micro_stack) -> LayerPlan`` for stages over ``axis`` of ``mesh``;
    ``plan`` is :func:`autopar.plan`."""
    level = axis_levels(mesh, profile, axis_level_overrides)[axis]
    inner_mesh = sub_mesh(mesh, axis)
    overrides = {k: v for k, v in (axis_level_overrides or {}).items() if k != axis}
    sizes = dict(zip(inner_mesh.axis_names, inner_mesh.devices.shape, strict=True))

    def plan_layer(micro: split.Stack) -> LayerPlan:
        step, args, n = _layer_step(micro)
        planned = plan(step, *args, mesh=inner_mesh, hardware=profile,
                            axis_level_overrides=overrides or None, pipeline=None,
                            remat=False, check_memory=False, verbose=False,
                            time_limit_s=LAYER_TIME_LIMIT_S)
        specs = [s.spec for s in jax.tree.leaves(planned.in_shardings)]
        flat_args = jax.tree.leaves(args)
        inner = Inner(consts=tuple(specs[:n]), carry=specs[n],
                      xs=tuple(specs[n + 1:n + 1 + len(args[2])]))
        carry = _per_device_bytes(args[1], inner.carry, sizes)
        held = sum(_per_device_bytes(a, s, sizes) for a, s in zip(flat_args, specs, strict=True))
        # what the layer keeps for its backward: its peak less its arguments and their
        # gradients (about as large)
        kept = max(planned.estimate.peak_memory_bytes - 2 * held, carry)
        return LayerPlan(inner=inner if inner_mesh.devices.size > 1 else None,
                         time_s=planned.estimate.step_time_s, kept_bytes=int(kept),
                         carry_bytes=carry,
                         hop_s=level.latency_s + carry / level.bandwidth_bytes_per_s)

    return plan_layer
