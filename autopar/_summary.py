"""The plan in words: per layer group, what its parameters and its batch are split over.

Read from the chosen shardings and how the program uses each parameter:

* a matrix whose output dim is split (a free dim of its dot) is column-parallel, one whose
  summed dim is split is row-parallel; both over one axis are Megatron tensor parallelism;
  a dot's batch dim split (an expert dim) is expert parallelism;
* an embedding table (a gather's operand) split by rows is vocab-parallel;
* parameters split over the axis that also splits the batch are FSDP (gathered to compute);
* the batch: the leading dim of the activations the layer's forward matmuls read;
* optimizer state split over axes its parameter is not: ZeRO over those axes.
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from dataclasses import dataclass

import jax
from jax import lax

from autopar._layers import (
    Phase,
    input_layers,
    input_source,
    leaf_keys,
    node_layers,
    node_phases,
    param_leaves,
    pipelined_layer,
    same_layer_groups,
    state_of,
)
from autopar._mesh import axis_sizes


class DimRole(enum.Enum):
    """How the program uses one dim of a parameter."""
    COLUMN = "column"      # a free dim of a matmul: its output
    ROW = "row"            # a summed dim of a matmul
    EXPERT = "expert"      # a batch dim of a matmul (one matrix per expert)
    VOCAB = "vocab"        # the rows of a gathered table
    FEATURE = "feature"    # the columns of a gathered table
    OTHER = "other"        # a bias, a norm's scale, ...


@dataclass(frozen=True)
class LayerFacts:
    """What one layer splits: per mesh axis, the roles of the parameter dims it splits, and
    the axes splitting its activations' batch and sequence dims."""
    roles: dict            # axis -> frozenset[DimRole]
    batch: tuple[str, ...]
    sequence: tuple[str, ...]


def _axes(entry, sizes: dict[str, int] | None = None) -> tuple[str, ...]:
    """The mesh axes of one spec entry (those in ``sizes`` only, when given)."""
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return axes if sizes is None else tuple(a for a in axes if a in sizes)


def _split_sizes(plan) -> dict[str, int]:
    """The plan's mesh axes that split anything (of size 2 or more), by size: the words
    leave a size-1 axis out, as it splits nothing."""
    return {a: n for a, n in axis_sizes(plan.mesh).items() if n > 1}


def _dim_roles(node, pos, rank) -> list[DimRole] | None:
    """Roles of the dims of operand ``pos`` of ``node``, when it tells them."""
    if node.primitive is lax.gather_p and pos == 0 and rank == 2:
        return [DimRole.VOCAB, DimRole.FEATURE]
    if node.primitive is not lax.dot_general_p:
        return None
    (contract, batch) = node.params["dimension_numbers"]
    summed, batched = set(contract[pos]), set(batch[pos])
    return [DimRole.ROW if d in summed else DimRole.EXPERT if d in batched else DimRole.COLUMN
            for d in range(rank)]


def layer_facts(plan) -> dict[str, LayerFacts]:
    """Layer name -> :class:`LayerFacts` (kept on the graph per chosen plan)."""
    graph, strats, choice, _ = plan._details
    key = ("autopar.layer_facts", id(strats), tuple(choice))
    if key not in graph.analyses:
        graph.analyses[key] = _layer_facts(plan)
    return graph.analyses[key]


def _layer_facts(plan) -> dict[str, LayerFacts]:
    graph, strats, choice, _ = plan._details
    arg_of = {nid: i for i, nid in enumerate(graph.input_nodes)}
    specs = [s.spec for s in jax.tree_util.tree_leaves(plan.in_shardings)]
    params = set(param_leaves(plan))
    labels, phases = node_layers(plan), node_phases(graph)
    roles: dict[int, list[DimRole]] = {}     # param leaf -> its dims' roles
    batch: dict[str, Counter] = {}
    seq: dict[str, Counter] = {}
    for node in graph.nodes:
        sources = [input_source(graph, v) if v is not None else None for v in node.ins]
        leaves = [arg_of.get(s) for s in sources]
        for pos, leaf in enumerate(leaves):
            if leaf in params and phases[node.id] == Phase.FORWARD:
                got = _dim_roles(node, pos, len(plan._arg_avals[leaf].shape))
                if got is not None and (leaf not in roles or DimRole.VOCAB in got):
                    roles[leaf] = got
        if node.primitive is lax.dot_general_p and phases[node.id] == Phase.FORWARD and any(
                leaf in params for leaf in leaves):
            _count_activation(node, leaves, params, strats[node.id][choice[node.id]],
                              batch.setdefault(labels[node.id], Counter()),
                              seq.setdefault(labels[node.id], Counter()))
    names, _ = input_layers(plan._in_tree, [a.shape for a in plan._arg_avals])
    out: dict[str, dict] = {}
    for leaf in sorted(params):
        by_axis = out.setdefault(names[leaf], {})
        dims = roles.get(leaf, [DimRole.OTHER] * len(plan._arg_avals[leaf].shape))
        for d, entry in enumerate(specs[leaf]):
            for axis in _axes(entry):
                by_axis.setdefault(axis, set()).add(dims[d] if d < len(dims) else DimRole.OTHER)
    return {name: LayerFacts({a: frozenset(r) for a, r in by_axis.items()},
                             _most(batch.get(name)), _most(seq.get(name)))
            for name, by_axis in out.items() if name is not None}


def _count_activation(node, leaves, params, strategy, batch: Counter, seq: Counter) -> None:
    """Count the axes splitting the batch (dim 0) and sequence (dim 1) of the activation a
    forward matmul multiplies with a parameter."""
    (contract, _) = node.params["dimension_numbers"]
    for pos in (0, 1):
        spec = strategy.in_specs[pos]
        if leaves[pos] in params or spec is None:
            continue
        free = [d for d in range(spec.rank) if d not in contract[pos]]
        weight = node.in_avals[pos][0]
        n = 1
        for s in weight:
            n *= s
        if free:
            batch[spec.dims[free[0]]] += n
        if len(free) >= 3:
            seq[spec.dims[free[1]]] += n


def _most(counter: Counter | None) -> tuple[str, ...]:
    return counter.most_common(1)[0][0] if counter else ()


def describe(facts: LayerFacts, sizes: dict[str, int], stage_axis: str | None = None) -> str:
    """One layer's plan in words, e.g. ``Megatron TP over model(4), batch over data(2)``;
    ``stage_axis``: the axis a pipeline cuts the stacked layers over."""
    def ax(a):
        return f"{a}({sizes[a]})"
    parts, fsdp = [], set()
    for axis in sizes:
        roles = facts.roles.get(axis, frozenset())
        if axis == stage_axis and roles:
            parts.append(f"pipeline stages over {ax(axis)}")
            continue
        mats = roles & {DimRole.COLUMN, DimRole.ROW, DimRole.EXPERT}
        if DimRole.VOCAB in roles:
            parts.append(f"vocab-parallel over {ax(axis)}")
        if DimRole.FEATURE in roles:
            parts.append(f"embedding dim over {ax(axis)}")
        if axis in facts.batch and roles:
            parts.append(f"FSDP over {ax(axis)}")
            fsdp.add(axis)
        elif DimRole.EXPERT in mats:
            parts.append(f"expert-parallel over {ax(axis)}")
        elif {DimRole.COLUMN, DimRole.ROW} <= mats:
            parts.append(f"Megatron TP over {ax(axis)}")
        elif DimRole.COLUMN in mats:
            parts.append(f"column-parallel over {ax(axis)}")
        elif DimRole.ROW in mats:
            parts.append(f"row-parallel over {ax(axis)}")
        elif roles == {DimRole.OTHER}:
            parts.append(f"parameters split over {ax(axis)}")
    batch = [a for a in facts.batch if a in sizes]
    sequence = [a for a in facts.sequence if a in sizes]
    if batch and not fsdp >= set(batch):
        parts.append("batch over " + " x ".join(ax(a) for a in batch))
    if sequence:
        parts.append("sequence over " + " x ".join(ax(a) for a in sequence))
    return ", ".join(parts) or "replicated"


def _layer_words(plan, sizes) -> list[tuple[str, str]]:
    """(layers, their plan in words) per group of like layers said alike."""
    facts = layer_facts(plan)
    stage_axis, stack = (plan.pipeline["axis"] if plan.pipeline else None), pipelined_layer(plan)
    words = {name: describe(f, sizes, stage_axis if name == stack else None)
             for name, f in facts.items()}
    out = []
    for group in same_layer_groups(list(facts)):
        for said in dict.fromkeys(words[n] for n in group):
            members = [n for n in group if words[n] == said]
            head = members[0] if len(members) == 1 else f"{members[0]}..{members[-1]}"
            out.append((head, said))
    return out


def axis_words(plan) -> dict[str, str]:
    """Mesh axis -> what it carries, e.g. ``Megatron TP (block_0..block_11); batch`` (a
    loaded plan's: what it was saved with)."""
    if plan._details is None:
        return dict(plan._explained.axis_words)
    sizes = _split_sizes(plan)
    said: dict[str, dict[str, list[str]]] = {a: {} for a in sizes}
    for head, words in _layer_words(plan, sizes):
        for part in words.split(", "):
            what, _, over = part.partition(" over ")
            for axis in sizes:
                if f"{axis}({sizes[axis]})" in over.split(" x "):
                    said[axis].setdefault(what, []).append(head)
    return {a: "; ".join(f"{what} ({', '.join(heads)})" for what, heads in found.items())
            for a, found in said.items()}


def summary_lines(plan) -> list[str]:
    """The plan in words: one line per group of like layers, then the other inputs, the
    optimizer state, and where the plan splits the batch against the axis names."""
    if plan._details is None and plan._explained is not None:   # loaded: as it was saved
        return list(plan._explained.in_words)
    sizes = _split_sizes(plan)
    if plan._details is None:   # loaded from a file that kept only the shardings
        specs = [s.spec for s in jax.tree_util.tree_leaves(plan.in_shardings)]
        split = [sp for sp in specs if any(_axes(e, sizes) for e in sp)]
        axes = [a for a in sizes if any(a in _axes(e) for sp in split for e in sp)]
        return [f"{len(split)} of {len(specs)} inputs split"
                + (f" over {', '.join(f'{a}({sizes[a]})' for a in axes)}" if axes else "")
                + " (this file, saved before autopar kept a plan's explanation, holds its "
                "shardings alone: plan again for the plan in words)"]
    lines = [f"{head}: {said}" for head, said in _layer_words(plan, sizes)]
    p = plan.pipeline
    if p:
        size = axis_sizes(plan.mesh)[p["axis"]]
        lines.append(f"pipeline: {p['stages']} stages over {p['axis']}({size}), "
                     f"{p['schedule']}, {p['microbatches']} microbatches")
    lines += _input_lines(plan, sizes)
    lines += _optimizer_lines(plan, sizes)
    roles = (plan.stats or {}).get("axis_roles", {})
    note = roles.get("note") or _activation_note(plan, sizes, roles)
    if note:
        lines.append(f"axis names: {note}")
    return lines


def _activation_note(plan, sizes, roles: dict) -> str | None:
    """Where the layers' matmuls take the batch split over axes other than the batch axes,
    though the inputs hold it on them (``_axis_roles.check`` speaks for the inputs)."""
    batch = roles.get("batch_axes") or []
    facts = layer_facts(plan) if batch else {}
    others = sorted({a for f in facts.values() for a in f.batch if a not in batch and a in sizes})
    if not others:
        return None
    layers = [name for name, f in facts.items() if any(a in others for a in f.batch)]
    on = " x ".join(f"{a}({sizes[a]})" for a in others)
    said = "batch_axes" if roles.get("explicit") else "axis names"
    heads = [g[0] if len(g) == 1 else f"{g[0]}..{g[-1]}" for g in same_layer_groups(layers)]
    return (f"{', '.join(heads)} take the batch split over {on}, not over "
            f"{', '.join(f'`{a}`' for a in batch)} as the {said} say: predicted faster. The "
            "inputs hold it on the batch axes, and the plan moves it.")


def _input_lines(plan, sizes) -> list[str]:
    """The inputs outside every layer (the batch, counters, a model's other state), grouped by
    how they are split; the leading dim is called the batch in the arguments after the first
    (the state), as ``batch_axes`` has it, where it has the batch's size: the leading size
    most of those arguments' arrays outside the layers have, the larger on a tie (a raw key's
    2 is no batch; optimizer state is in its layers)."""
    names, _ = input_layers(plan._in_tree, [a.shape for a in plan._arg_avals])
    shardings = jax.tree_util.tree_leaves(plan.in_shardings)
    leads = Counter(aval.shape[0] for path, name, aval in zip(plan.in_paths, names,
                                                              plan._arg_avals)
                    if name is None and aval.shape and not path.startswith("[0]"))
    batch = max(leads, key=lambda n: (leads[n], n), default=None)  # on a tie, the larger
    said: dict[str, list[str]] = {}
    for path, name, s, aval in zip(plan.in_paths, names, shardings, plan._arg_avals):
        if name is not None or not aval.shape:
            continue
        lead = "dim 0" if path.startswith("[0]") or aval.shape[0] != batch else "batch"
        dims = [(d, _axes(e, sizes)) for d, e in enumerate(s.spec) if _axes(e, sizes)]
        words = ", ".join((lead if d == 0 else f"dim {d}") + " over "
                          + " x ".join(f"{a}({sizes[a]})" for a in axes)
                          for d, axes in dims) or "replicated"
        said.setdefault(words, []).append(path)
    if not said:
        return []
    return ["inputs: " + "; ".join(f"{_paths_text(paths)} {words}"
                                   for words, paths in said.items())]


def _paths_text(paths: list[str], most: int = 4) -> str:
    """``paths`` joined, or past ``most`` of them, the key path they share and their count
    (``[0]['batch_stats'] (24 arrays)``), else the first few and how many more."""
    if len(paths) <= most:
        return ", ".join(paths)
    keys = [re.findall(r"\[[^\]]*\]", p) for p in paths]
    shared = []
    for parts in zip(*keys):
        if len(set(parts)) > 1:
            break
        shared.append(parts[0])
    if shared:
        return f"{''.join(shared)} ({len(paths)} arrays)"
    return f"{', '.join(paths[:most - 1])} and {len(paths) - most + 1} more"


def _optimizer_lines(plan, sizes) -> list[str]:
    keys = leaf_keys(plan._in_tree)
    pairs = state_of(keys, param_leaves(plan))
    if not pairs:
        return []
    specs = [s.spec for s in jax.tree_util.tree_leaves(plan.in_shardings)]
    extra: Counter = Counter()
    beyond = 0
    for state, param in pairs.items():
        more = ({a for e in specs[state] for a in _axes(e, sizes)}
                - {a for e in specs[param] for a in _axes(e, sizes)})
        extra.update(more)
        beyond += bool(more)
    if not beyond:
        split = any(_axes(e, sizes) for state in pairs for e in specs[state])
        return ["optimizer state: " + ("split as its parameters" if split else
                                       "replicated, as its parameters")]
    axes = " x ".join(f"{a}({sizes[a]})" for a in sizes if a in extra)
    return [f"optimizer state: ZeRO over {axes} ({beyond} of {len(pairs)} state leaves split "
            "beyond their parameter)"]


def summary(plan) -> str:
    return "\n".join(summary_lines(plan))

