"""The pass pipeline. :func:`run_pipeline` lists the passes in order:

trace -> annotate -> strategies -> propagate -> cluster -> solve -> emit

With ``search=False`` propagation gives the whole plan and cluster/solve do not run (plain
GSPMD). Pipeline stages and collective overlap are not in this version; see README.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cost_model.estimate import value_specs
from passes.annotate import annotate
from passes.cluster import cluster
from passes.dedup import node_keys, structural_colors, tie_groups
from passes.emit import build_flat_fn
from passes.ir import Graph
from passes.propagate import best_of, propagate
from passes.memory_budget import input_labels
from passes.solve import Solution, solve
from passes.strategies import MeshContext, Strategy, build_strategies
from passes.trace import Traced, trace


@dataclass
class PipelineResult:
    traced: Traced
    strats: list[list[Strategy]]
    solution: Solution
    fallbacks: dict[str, int]
    flat_fn: object
    timings_s: dict[str, float] = field(default_factory=dict)
    ilp_groups: int = 0
    ilp_stats: dict = field(default_factory=dict)  # ILP size before and after coarsening

    @property
    def graph(self) -> Graph:
        return self.traced.graph


def run_pipeline(fn, args, mesh_ctx: MeshContext, jax_mesh, *, in_specs_of=None,
                 out_specs_of=None, ties_of=None, time_limit_s: float = 60.0,
                 progress=lambda msg: None, choice=None, search: bool = True,
                 hint_labels_of=None, seeds_of=None, dedup_layers: bool = True,
                 memory_budget_bytes: float | None = None, strict_budget: bool = True
                 ) -> PipelineResult:
    """in_specs_of(traced) / out_specs_of(traced) give the pinned Spec (or None) per flat leaf;
    hint_labels_of(traced) gives (in labels, out labels) naming those leaves in messages;
    seeds_of(traced) gives name -> a Spec (or None) per flat input leaf: starting points whose
    propagated plans compete with the ILP's (``passes.propagate.best_of``);
    ties_of(traced) gives (output leaf, input leaf) pairs that must share a sharding.
    ``search=False``: annotations plus propagation only (no ILP); free values are replicated.
    ``choice``: a strategy index per node from an earlier solve of the same program (a plan
    cache); the solve is skipped. ValueError if it does not fit this graph's strategies.
    ``dedup_layers``: structurally identical nodes (copies of a layer) share one decision
    (``passes.dedup``). ``memory_budget_bytes``: the per-device peak the plan must fit in
    (``passes.memory_budget``); ``strict_budget=False`` warns instead of raising when no
    plan fits it."""
    timings = {}
    t0 = time.perf_counter()
    progress("tracing")
    traced = trace(fn, args)
    graph = traced.graph
    timings["trace"] = time.perf_counter() - t0

    t = time.perf_counter()
    in_specs = in_specs_of(traced) if in_specs_of else []
    out_specs = out_specs_of(traced) if out_specs_of else []
    in_labels, out_labels = hint_labels_of(traced) if hint_labels_of else (None, None)
    labels = annotate(graph, in_specs, out_specs, mesh_ctx.axis_sizes, in_labels, out_labels)
    progress(f"building strategies for {len(graph.nodes)} nodes")
    keys = node_keys(graph)
    strats, fallbacks = build_strategies(graph, mesh_ctx, keys)
    timings["strategies"] = time.perf_counter() - t

    ties = []
    if ties_of is not None:
        ties = [(graph.output_nodes[o], graph.input_nodes[i]) for o, i in ties_of(traced)]
    t = time.perf_counter()
    progress("propagating annotations")
    prop = propagate(graph, strats, mesh_ctx, labels, ties, complete=not search)
    timings["propagate"] = time.perf_counter() - t

    t = time.perf_counter()
    groups, ilp_stats = None, {}
    if search:
        groups = cluster(graph, strats, mesh_ctx, ties)
        ilp_stats = {"ilp_nodes_before": len(graph.nodes),
                     "ilp_groups_followed": len(groups.members)}
        if dedup_layers:
            groups = tie_groups(groups, structural_colors(graph, keys))
        ilp_stats["ilp_groups"] = len(groups.members)
    timings["cluster"] = time.perf_counter() - t

    t = time.perf_counter()
    if not search:
        solution = Solution(prop.choice, 0.0, "propagated", 0, 0, 0.0)
    elif choice is not None:
        if len(choice) != len(strats) or any(not 0 <= c < len(s) for c, s in zip(choice, strats)):
            raise ValueError("the cached choice does not fit this program's strategies")
        solution = Solution(list(choice), 0.0, "cached", 0, 0, 0.0)
    else:
        progress(f"solving the ILP over {len(groups.members)} groups "
                 f"({len(graph.nodes)} nodes before coarsening)")
        solution = solve(graph, strats, groups, mesh_ctx, time_limit_s=time_limit_s,
                         memory_budget_bytes=memory_budget_bytes, strict_budget=strict_budget,
                         input_labels=input_labels(traced.in_tree), progress=progress)
        ilp_stats.update(ilp_edges_before=solution.edges_before,
                         ilp_edges=solution.edges_after, memory_rows=solution.memory_rows,
                         memory_budget_bytes=memory_budget_bytes)
        progress(f"ILP: {solution.num_variables} variables, {solution.num_constraints} "
                 f"constraints, {solution.edges_after} edge classes "
                 f"({solution.edges_before} edges); {solution.status} in "
                 f"{solution.solve_time_s:.2f}s")
        seeds = {}
        for name, leaf_specs in (seeds_of(traced) if seeds_of else {}).items():
            seeds[name] = {graph.input_nodes[i]: spec for i, spec in enumerate(leaf_specs)
                           if spec is not None}
        if labels or seeds:
            progress(f"comparing the ILP's plan with {len(seeds) + bool(labels)} propagated "
                     "ones")
            solution, ilp_stats["candidates_step_s"] = best_of(
                solution, graph, strats, mesh_ctx, labels, ties, seeds, memory_budget_bytes)
    timings["solve"] = time.perf_counter() - t

    specs = value_specs(graph, strats, solution.choice)
    node_in_specs = {n.id: strats[n.id][solution.choice[n.id]].in_specs for n in graph.nodes}
    flat_fn = build_flat_fn(traced, specs, node_in_specs, jax_mesh)
    timings["total"] = time.perf_counter() - t0
    return PipelineResult(traced, strats, solution, fallbacks, flat_fn, timings,
                          len(groups.members) if groups else 0, ilp_stats)
