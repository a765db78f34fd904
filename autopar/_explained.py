"""What a saved plan keeps of its report that only the traced program can say: the plan in
words, what each mesh axis carries, the per-layer table, the collectives by place and the
memory over the program (its chart at most :data:`MEMORY_POINTS` wide).

:meth:`Plan.to_json <autopar.Plan.to_json>` writes it under ``"explained"`` and
:meth:`Plan.from_json <autopar.Plan.from_json>` reads it back, so a plan loaded from JSON
(``Plan.load``, ``autopar show``) explains itself as the plan that was saved. A file without
it (written before it was kept) still loads, and its report lists the shardings alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar._layers import LayerRow, ParamLeaf, Phase, input_layers, layer_rows, local_shape
from autopar._report import CollectiveGroup, MemoryView, collective_groups, memory_view
from autopar._summary import axis_words, summary_lines


@dataclass(frozen=True)
class Explained:
    """The parts of a plan's report that need its traced program, as data."""
    in_words: tuple[str, ...]          # the plan in words (``summary_lines``)
    axis_words: dict[str, str]         # mesh axis -> what it carries (``axis_words``)
    rows: tuple[LayerRow, ...]         # the per-layer table (``layer_rows``)
    layer_inputs: tuple[str, ...]      # the input paths in a layer: parameters, their state
    collectives: dict[tuple[str, str], list[CollectiveGroup]]   # ``collective_groups``
    memory: MemoryView                 # the memory over the program (``memory_view``)


#: The most points of the memory chart a saved plan keeps: each is the largest of a run of the
#: program's operations (so its peak stays), in the phase of the run's first.
MEMORY_POINTS = 512


def explanation(plan) -> Explained | None:
    """``plan``'s explanation: from its traced program, or the one it was loaded with (None
    for a plan loaded from a file that kept none)."""
    if plan._details is None:
        return plan._explained
    names, _ = input_layers(plan._in_tree, [a.shape for a in plan._arg_avals])
    return Explained(tuple(summary_lines(plan)), axis_words(plan), tuple(layer_rows(plan)),
                     tuple(p for p, n in zip(plan.in_paths, names) if n is not None),
                     collective_groups(plan), memory_view(plan))


def explanation_to_json(e: Explained) -> dict:
    """``e`` as the JSON :func:`explanation_from_json` reads (a parameter's spec is its
    input's, so it is not written again)."""
    return {
        "in_words": list(e.in_words),
        "axis_words": dict(e.axis_words),
        "layers": [{"name": r.name, "state_bytes": int(r.state_bytes),
                    "compute_s": float(r.compute_s), "comm_s": float(r.comm_s),
                    "comm_bytes": float(r.comm_bytes), "collectives": int(r.collectives),
                    "params": [{"path": p.path, "shape": [int(d) for d in p.shape],
                                "local_shape": [int(d) for d in p.local_shape]} for p in r.params],
                    "rewrites": dict(r.rewrites), "attention": list(r.attention)}
                   for r in e.rows],
        "layer_inputs": list(e.layer_inputs),
        "collectives": [{"axes": g.axes, "kind": g.kind, "what": g.what, "count": int(g.count),
                         "wire_bytes": float(g.wire_bytes), "time_s": float(g.time_s)}
                        for groups in e.collectives.values() for g in groups],
        "memory": _memory_to_json(e.memory),
    }


def _memory_to_json(m: MemoryView) -> dict:
    """``m`` with its chart pooled to at most :data:`MEMORY_POINTS` points, its phases as runs
    of (phase, points)."""
    run = -(-len(m.live) // MEMORY_POINTS) or 1
    live = [max(m.live[i:i + run]) for i in range(0, len(m.live), run)]
    runs: list[list] = []
    for phase in m.phases[::run]:
        if runs and runs[-1][0] == phase.value:
            runs[-1][1] += 1
        else:
            runs.append([phase.value, 1])
    return {"held": int(m.held), "live": [int(b) for b in live], "phases": runs,
            "peak_at": m.peak_at // run, "peak_op": int(m.peak_op),
            "buffers": [[int(n), shape, what] for n, shape, what in m.buffers]}


def explanation_from_json(record: dict, in_paths: list[str], in_specs: list,
                          axis_sizes: dict[str, int]) -> Explained:
    """The :class:`Explained` :func:`explanation_to_json` wrote; ``in_paths`` and
    ``in_specs`` (the plan's input leaves and their PartitionSpecs) give each parameter its
    spec, which must split its shape into its per-device shape on a mesh of ``axis_sizes``.
    ValueError, naming what is wrong, for a record it did not write."""
    try:
        return _explained(_object(record, "`explained`"), dict(zip(in_paths, in_specs)),
                          axis_sizes)
    except KeyError as e:
        raise ValueError(f"`explained` (or an entry of it) lacks its {e.args[0]!r}") from None


def _explained(record: dict, spec_of: dict, sizes: dict[str, int]) -> Explained:
    words, carries = record["in_words"], record["axis_words"]
    if not (_strings(words) and isinstance(carries, dict) and _strings(list(carries.values()))
            and _strings(record["layer_inputs"])):
        raise ValueError("`explained`'s `in_words`, `axis_words` or `layer_inputs` is not "
                         "text as Plan.save writes it")
    rows = tuple(_row(_object(r, f"`explained.layers[{i}]`"), spec_of, sizes)
                 for i, r in enumerate(_list(record["layers"], "`explained.layers`")))
    collectives: dict[tuple[str, str], list[CollectiveGroup]] = {}
    for i, g in enumerate(_list(record["collectives"], "`explained.collectives`")):
        g = _object(g, f"`explained.collectives[{i}]`")
        group = CollectiveGroup(_text(g["kind"]), _text(g["axes"]), _text(g["what"]),
                                _count(g["count"]), _number(g["wire_bytes"]),
                                _number(g["time_s"]))
        collectives.setdefault((group.axes, group.kind), []).append(group)
    return Explained(tuple(words), dict(carries), rows, tuple(record["layer_inputs"]),
                     collectives, _memory(_object(record["memory"], "`explained.memory`")))


def _memory(m: dict) -> MemoryView:
    # live bytes are counted beside those held for the whole call, and the memory model's
    # accounting takes some below zero (a pipelined plan's, by 32 KiB)
    live = tuple(_integer(b) for b in _list(m["live"], "`explained.memory.live`"))
    phases: list[Phase] = []
    for run in _list(m["phases"], "`explained.memory.phases`"):
        if not (isinstance(run, list) and len(run) == 2):
            raise ValueError(f"`explained.memory.phases` holds {run!r:.40}, not [phase, count]")
        phases += [Phase(run[0])] * _count(run[1])
    if len(phases) != len(live) or not 0 <= _count(m["peak_at"]) < max(len(live), 1):
        raise ValueError("`explained.memory` has phases or a peak its chart does not")
    buffers = tuple((_count(n), _text(shape), _text(what))
                    for n, shape, what in _list(m["buffers"], "`explained.memory.buffers`"))
    return MemoryView(_count(m["held"]), live, tuple(phases), m["peak_at"],
                      _count(m["peak_op"]), buffers)


def _row(r: dict, spec_of: dict, sizes: dict[str, int]) -> LayerRow:
    params = []
    for p in _list(r["params"], "a layer's `params`"):
        p = _object(p, "a layer's parameter")
        path = p["path"]
        if path not in spec_of:
            raise ValueError(f"layer parameter {str(path)[:80]!r} is not an input")
        leaf = ParamLeaf(path, _shape(p["shape"]), _shape(p["local_shape"]), spec_of[path])
        if (len(leaf.spec) > len(leaf.shape)
                or local_shape(leaf.shape, leaf.spec, sizes) != leaf.local_shape):
            raise ValueError(f"parameter {path[:80]!r} of shape {list(leaf.shape)} is not split "
                             f"by its spec {leaf.spec} into its per-device shape "
                             f"{list(leaf.local_shape)}")
        params.append(leaf)
    rewrites, attention = r["rewrites"], r["attention"]
    if not (isinstance(rewrites, dict) and all(map(_is_count, rewrites.values()))
            and _strings(attention)):
        raise ValueError(f"`explained`'s layer {str(r['name'])[:40]!r} has `rewrites` or "
                         "`attention` not as Plan.save writes them")
    return LayerRow(_text(r["name"]), _count(r["state_bytes"]), _number(r["compute_s"]),
                    _number(r["comm_s"]), _number(r["comm_bytes"]), _count(r["collectives"]),
                    params, dict(rewrites), list(attention))


def _object(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is a {type(value).__name__}, not an object")
    return value


def _list(value, what: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{what} is a {type(value).__name__}, not a list")
    return value


def _strings(values) -> bool:
    return isinstance(values, list) and all(isinstance(v, str) for v in values)


def _text(value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"`explained` holds {value!r:.40} where a name goes")
    return value


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value) -> bool:
    return _is_integer(value) and value >= 0


def _integer(value) -> int:
    if not _is_integer(value):
        raise ValueError(f"`explained` holds {value!r:.40} where a number of bytes goes")
    return value


def _count(value) -> int:
    if not _is_count(value):
        raise ValueError(f"`explained` holds {value!r:.40} where a count goes")
    return value


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"`explained` holds {value!r:.40} where a size or time goes")
    return value


def _shape(value) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"`explained` holds {value!r:.40} where a shape goes")
    return tuple(_count(d) for d in value)
