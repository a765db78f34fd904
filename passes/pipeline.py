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
from passes.emit import build_flat_fn
from passes.ir import Graph
from passes.propagate import better_of, propagate
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

    @property
    def graph(self) -> Graph:
        return self.traced.graph


def run_pipeline(fn, args, mesh_ctx: MeshContext, jax_mesh, *, in_specs_of=None,
                 out_specs_of=None, ties_of=None, time_limit_s: float = 60.0,
                 progress=lambda msg: None, choice=None, search: bool = True,
                 hint_labels_of=None) -> PipelineResult:
    """in_specs_of(traced) / out_specs_of(traced) give the pinned Spec (or None) per flat leaf;
    hint_labels_of(traced) gives (in labels, out labels) naming those leaves in messages;
    ties_of(traced) gives (output leaf, input leaf) pairs that must share a sharding.
    ``search=False``: annotations plus propagation only (no ILP); free values are replicated.
    ``choice``: a strategy index per node from an earlier solve of the same program (a plan
    cache); the solve is skipped. ValueError if it does not fit this graph's strategies."""
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
    strats, fallbacks = build_strategies(graph, mesh_ctx)
    timings["strategies"] = time.perf_counter() - t

    ties = []
    if ties_of is not None:
        ties = [(graph.output_nodes[o], graph.input_nodes[i]) for o, i in ties_of(traced)]
    t = time.perf_counter()
    progress("propagating annotations")
    prop = propagate(graph, strats, mesh_ctx, labels, ties, complete=not search)
    timings["propagate"] = time.perf_counter() - t

    t = time.perf_counter()
    groups = cluster(graph, strats, mesh_ctx, ties) if search else None
    timings["cluster"] = time.perf_counter() - t

    t = time.perf_counter()
    if not search:
        solution = Solution(prop.choice, 0.0, "propagated", 0, 0, 0.0)
    elif choice is not None:
        if len(choice) != len(strats) or any(not 0 <= c < len(s) for c, s in zip(choice, strats)):
            raise ValueError("the cached choice does not fit this program's strategies")
        solution = Solution(list(choice), 0.0, "cached", 0, 0, 0.0)
    else:
        progress(f"solving the ILP over {len(groups.members)} groups")
        solution = solve(graph, strats, groups, mesh_ctx, time_limit_s=time_limit_s)
        if labels:
            solution = better_of(solution, graph, strats, mesh_ctx, labels, ties)
    timings["solve"] = time.perf_counter() - t

    specs = value_specs(graph, strats, solution.choice)
    node_in_specs = {n.id: strats[n.id][solution.choice[n.id]].in_specs for n in graph.nodes}
    flat_fn = build_flat_fn(traced, specs, node_in_specs, jax_mesh)
    timings["total"] = time.perf_counter() - t0
    return PipelineResult(traced, strats, solution, fallbacks, flat_fn, timings,
                          len(groups.members) if groups else 0)
