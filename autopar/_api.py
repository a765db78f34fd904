"""autopar.plan and autopar.parallelize."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding

from autopar._mesh import as_auto_mesh, axis_sizes
from autopar._plan import Plan
from autopar.errors import ArgumentError
from cost_model.estimate import estimate, plan_collectives
from cost_model.hardware import axis_levels, get_profile
from passes.pipeline import run_pipeline
from passes.annotate import flatten_hints, to_spec
from passes.strategies import MeshContext


def _paths(tree) -> list[str]:
    dummy = jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves)
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def _state_ties(traced) -> list[tuple[int, int]]:
    """Outputs that replace an input (same path in the result as in the arguments, same shape
    and dtype), such as new parameters and optimizer state: they keep the input's sharding."""
    ins = {p: (i, a) for i, (p, a) in enumerate(zip(_paths(traced.in_tree), traced.in_avals))}
    ties = []
    for o, (p, a) in enumerate(zip(_paths(traced.out_tree), traced.out_avals)):
        if p in ins and (ins[p][1].shape, ins[p][1].dtype) == (a.shape, a.dtype):
            ties.append((o, ins[p][0]))
    return ties


def _progress(enabled: bool):
    if not enabled:
        return lambda msg: None
    return lambda msg: print(f"[autopar] {msg}", file=sys.stderr, flush=True)


def plan(fn: Callable, *example_args, mesh, hardware=None, memory_budget=None,
         in_shardings=None, out_shardings=None, search: bool = True,
         time_limit_s: float = 60.0, tie_state: bool = True, axis_level_overrides=None,
         verbose: bool = False) -> Plan:
    """Plan how to run ``fn`` on ``mesh``.

    Args:
      fn: a single-device JAX function, e.g. a train step ``(params, opt_state, batch) ->
        (params, opt_state, loss)``.
      *example_args: arrays or ``jax.ShapeDtypeStruct`` pytrees with the shapes and dtypes of a
        real call. Nothing is executed while planning.
      mesh: a ``jax.sharding.Mesh`` (any axis types) or a dict ``{"data": 2, "model": 4}``.
      hardware: a profile name (``"h100"``, ``"tpu-v5e"``, ...), a HardwareProfile, or a path to
        a profile JSON from ``autopar profile``. Default: the current backend's profile.
      memory_budget: per-device bytes the plan must fit in (not enforced in this version).
      in_shardings / out_shardings: hints, a pytree (or prefix) of PartitionSpec, NamedSharding
        or None ("autopar decides") shaped like the arguments / results. A hint is always kept.
      search: False is not available in this version (raises ArgumentError).
      time_limit_s: the ILP's time limit; on it the best plan found so far is kept.
      tie_state: results that replace an argument (same pytree path, shape and dtype, such as
        new parameters) keep that argument's sharding.
      axis_level_overrides: e.g. ``{"data": "dcn"}``: which interconnect a mesh axis crosses.
      verbose: print progress to stderr.

    Returns:
      A :class:`Plan`.

    Example::

      plan = autopar.plan(train_step, params, opt_state, batch, mesh={"data": 2, "model": 4})
      params, opt_state, loss = plan.jit()(params, opt_state, batch)
    """
    if not search:
        raise ArgumentError("`search=False` (propagation only) is not available in this "
                            "version; leave `search` at True")
    if memory_budget is not None:
        raise ArgumentError("`memory_budget` is not enforced in this version; leave it None")
    jax_mesh = as_auto_mesh(mesh)
    sizes = axis_sizes(jax_mesh)
    profile = get_profile(hardware)
    levels = axis_levels(jax_mesh, profile, axis_level_overrides)
    on_cpu = jax_mesh.devices.flat[0].platform == "cpu"
    mesh_ctx = MeshContext(tuple(jax_mesh.axis_names), sizes, levels, profile,
                           emulated_reduce_scatter=on_cpu, upcast_16bit_collectives=on_cpu,
                           results_held=on_cpu)

    def pins(hints, what):
        def of(traced):
            tree = traced.in_tree if what == "in_shardings" else traced.out_tree
            avals = traced.in_avals if what == "in_shardings" else traced.out_avals
            hs = flatten_hints(hints, tree, what)
            return [to_spec(h, a.shape, sizes, f"{what}{p}")
                    for h, a, p in zip(hs, avals, _paths(tree))]
        return of

    result = run_pipeline(fn, example_args, mesh_ctx, jax_mesh,
                          in_specs_of=pins(in_shardings, "in_shardings"),
                          out_specs_of=pins(out_shardings, "out_shardings"),
                          ties_of=_state_ties if tie_state else None,
                          time_limit_s=time_limit_s, progress=_progress(verbose))
    graph, strats, choice = result.graph, result.strats, result.solution.choice
    comms = plan_collectives(graph, strats, choice, mesh_ctx)
    est = estimate(graph, strats, choice, mesh_ctx, comms)
    traced = result.traced

    def shardings(node_ids, tree, side):
        specs = []
        for n in node_ids:
            s = strats[n][choice[n]]
            specs.append((s.out_specs if side == "in" else s.in_specs)[0])
        return jax.tree_util.tree_unflatten(
            tree, [NamedSharding(jax_mesh, sp.to_partition_spec()) for sp in specs])

    sol = result.solution
    stats = {"nodes": len(graph.nodes), "ilp_groups": result.ilp_groups,
             "ilp_variables": sol.num_variables, "ilp_constraints": sol.num_constraints,
             "solver_status": sol.status, "timings_s": result.timings_s}
    return Plan(jax_mesh, shardings(graph.input_nodes, traced.in_tree, "in"),
                shardings(graph.output_nodes, traced.out_tree, "out"), est, profile.name,
                _paths(traced.in_tree), _paths(traced.out_tree), result.fallbacks, stats,
                result.flat_fn, traced.in_tree, traced.out_tree, traced.in_avals,
                (graph, strats, choice, comms))


class Parallelized:
    """``fn`` planned on its first call for each input signature, then reused."""

    def __init__(self, fn: Callable, plan_kwargs: dict):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._kwargs = plan_kwargs
        self._cache: dict[Any, tuple[Plan, Callable]] = {}
        self.plan: Plan | None = None
        self.plans_made = 0

    @staticmethod
    def _signature(args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        return tree, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)

    def __call__(self, *args):
        key = self._signature(args)
        if key not in self._cache:
            p = plan(self._fn, *args, **self._kwargs)
            self.plans_made += 1
            self._cache[key] = (p, p.jit())
        self.plan, run = self._cache[key]
        args = jax.device_put(args, self.plan.in_shardings)
        return run(*args)


def parallelize(fn: Callable | None = None, *, mesh, **plan_kwargs):
    """Wrap ``fn`` so that it is planned on its first call for each input signature.

    Usable as ``parallelize(fn, mesh=...)`` or as ``@parallelize(mesh=...)``. Arguments are
    moved to the planned shardings on every call, so plain host arrays work on the first step.
    The wrapper's ``.plan`` is the Plan of the last call. ``plan_kwargs`` are those of
    :func:`plan`.
    """
    if fn is None:
        return lambda f: Parallelized(f, dict(plan_kwargs, mesh=mesh))
    return Parallelized(fn, dict(plan_kwargs, mesh=mesh))


