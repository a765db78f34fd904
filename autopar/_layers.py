"""The plan seen layer by layer, for the report: parameters, time and memory per layer.

A layer is a module of the parameters (the first argument), found at any depth: wrappers
with one child (``params``, lm1b's ``decoder``) are looked through, and a module whose
numbered children (``block_0``, ``block_1``, ...; list items) hold most of its parameters
is opened into them (``encoder/block_0``; nnx and Equinox ``layers[3]``). Haiku's flat
``'lm/~/block_0/~/mlp'`` keys are split at ``/``. Optimizer state follows its parameter.

Every operation is given a layer: by its source path (``transpose(jvp(GPT))/block_0/mlp_in``
and ``jvp(GPT)/embed.attend`` name ``block_0`` and ``embed``), else by what it reads (an
embedding's gather, an optimizer's update of a layer's state; a pipeline region, the layer it
reads most values of: its stack), else by what reads it (an embedding's gradient scatter).
Operations left between the last layer's forward and the first layer's backward are the
``loss``; the rest (the step counter) are ``other``.
"""

from __future__ import annotations

import enum
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import jax
from jax import lax

from autopar.passes.estimate import plan_timeline, value_specs
from autopar.passes.ir import NodeKind
from autopar.passes.liveness import consumers, temporaries, value_bytes
from autopar.passes.rules import op_info
from autopar.passes.sequence_parallel import attention_label

OTHER = "other"
LOSS = "loss"

#: A numbered child of a module: ``block_0``, ``layers_12``, ``Dense3`` (stem, number).
_NUMBERED = re.compile(r"^(.*?\D)_?(\d+)$")
#: Ops that hand on their operand as the same value (a cast, a copy, a sharding constraint
#: such as flax's logically partitioned parameters apply when unboxed): what reads their
#: result reads the value they were given.
_PASS_THROUGH = frozenset({lax.convert_element_type_p, lax.copy_p, lax.sharding_constraint_p})


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class ParamLeaf:
    """One parameter: its path among the arguments, global and per-device shape, spec."""
    path: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    spec: object   # PartitionSpec


@dataclass
class LayerRow:
    """One layer's share of the plan, per device."""
    name: str
    state_bytes: int = 0          # its parameters and optimizer state
    compute_s: float = 0.0
    comm_s: float = 0.0
    comm_bytes: float = 0.0
    collectives: int = 0
    params: list[ParamLeaf] = field(default_factory=list)
    rewrites: dict[str, int] = field(default_factory=dict)  # "kind(axes)" -> ops rewritten
    attention: list[str] = field(default_factory=list)  # its attention nodes' strategies


# ----- layers of the parameter tree
def _key_parts(key) -> tuple:
    """A key path entry as plain keys; haiku's ``'lm/~/block_0'`` is three levels."""
    if isinstance(key, jax.tree_util.DictKey):
        k = key.key
        if isinstance(k, str) and "/" in k:
            return tuple(p for p in k.split("/") if p not in ("", "~"))
        return (k,)
    if isinstance(key, jax.tree_util.SequenceKey):
        return (key.idx,)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return (key.name,)
    return (getattr(key, "key", str(key)),)


def leaf_keys(in_tree) -> list[tuple]:
    """Per flat argument leaf, its keys (the argument's index first)."""
    dummy = jax.tree_util.tree_unflatten(in_tree, [0] * in_tree.num_leaves)
    return [tuple(p for k in path for p in _key_parts(k))
            for path, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def _join(prefix: str, key) -> str:
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}/{key}" if prefix else str(key)


def _holds_repeats(keys, shapes, members, depth) -> bool:
    """Whether the children at ``depth`` of these leaves include repeated blocks: two or more
    numbered children (``block_N``, list items) alike in structure and shapes, holding at
    least half of the elements (so an MLP's ``Dense_0`` and ``Dense_1`` stay one layer)."""
    children: dict = defaultdict(list)
    total = 0
    for i in members:
        total += _prod(shapes[i])
        if len(keys[i]) > depth + 1:
            children[keys[i][depth]].append(i)
    alike: dict = defaultdict(lambda: [0, 0])   # (stem, structure) -> [children, elements]
    for k, leaves in children.items():
        m = _NUMBERED.match(k) if isinstance(k, str) else None
        stem = "[]" if isinstance(k, int) else (m.group(1) if m else None)
        if stem is not None:
            structure = tuple(sorted((keys[i][depth + 1:], tuple(shapes[i])) for i in leaves))
            alike[stem, structure][0] += 1
            alike[stem, structure][1] += sum(_prod(shapes[i]) for i in leaves)
    return any(n >= 2 and 2 * size >= total for n, size in alike.values())


def _assign(keys, shapes, members, depth, prefix, out) -> None:
    groups: dict = {}
    for i in members:
        if len(keys[i]) > depth:
            groups.setdefault(keys[i][depth], []).append(i)
        else:
            out[i] = prefix or None
    if len(groups) == 1 and len(members) > 1:   # a wrapper: look through it
        (key, inner), = groups.items()
        _assign(keys, shapes, inner, depth + 1, _join(prefix, key) if prefix else "", out)
        return
    for key, inner in groups.items():
        name = _join(prefix, key)
        if len(inner) > 1 and _holds_repeats(keys, shapes, inner, depth + 1):
            _assign(keys, shapes, inner, depth + 1, name, out)
        else:
            for i in inner:
                out[i] = name


def _param_count(in_tree) -> int:
    children = in_tree.children()
    return children[0].num_leaves if len(children) > 1 else 0


def input_layers(in_tree, shapes) -> tuple[list[str | None], int]:
    """(a layer name per flat argument leaf, the number of parameter leaves). Parameters are
    the first argument's leaves (a TrainState's ``params`` when it has one); other leaves
    ending in a parameter's keys (its optimizer state) take its layer."""
    keys = leaf_keys(in_tree)
    params = _params(keys, _param_count(in_tree))
    names: list[str | None] = [None] * len(keys)
    rel = {i: keys[i][1:] for i in params}
    _assign([rel.get(i, ()) for i in range(len(keys))], [tuple(s) for s in shapes], params,
            0, "", names)
    for state, param in state_of(keys, params).items():
        names[state] = names[param]
    return names, len(params)


def weight_leaves(in_tree) -> list[int]:
    """The flat argument indices of the parameters, from the arguments' tree alone."""
    return _params(leaf_keys(in_tree), _param_count(in_tree))


def input_source(graph, vid, scans: bool = False) -> int | None:
    """The input node value ``vid`` is, looked at through :data:`_PASS_THROUGH` ops (a
    weight's bf16 cast; and with ``scans``, through a scan's per-iteration slices: a scanned
    layer's weight), or None."""
    producer = graph.producer
    node = graph.nodes[producer[vid][0]] if vid in producer else None
    while (node is not None and node.ins and node.ins[0] in producer
           and (node.primitive in _PASS_THROUGH or scans and node.kind is NodeKind.SCAN_IN)):
        node = graph.nodes[producer[node.ins[0]][0]]
    return node.id if node is not None and node.kind == NodeKind.INPUT else None


def _params(keys, n) -> list[int]:
    rel = [k[1:] for k in keys[:n]]
    if any(k[:1] == ("params",) for k in rel) and len({k[:1] for k in rel}) > 1:
        return [i for i in range(n) if rel[i][:1] == ("params",)]   # a TrainState
    return list(range(n))


def state_of(keys, params) -> dict[int, int]:
    """Flat leaf -> the parameter leaf whose state it is: a leaf outside the parameters whose
    keys end in the parameter's (``[1][0].mu['block_0']['qkv']['kernel']``)."""
    common = _common_prefix([keys[i][1:] for i in params]) if len(params) > 1 else 0
    by_keys = {keys[i][1 + common:]: i for i in params}
    chosen = set(params)
    out = {}
    for i, k in enumerate(keys):
        if i not in chosen:
            j = next((by_keys[k[s:]] for s in range(1, len(k)) if k[s:] in by_keys), None)
            if j is not None:
                out[i] = j
    return out


def _common_prefix(key_lists) -> int:
    """The length of the keys every list starts with (wrappers such as ``params``)."""
    n = 0
    while all(len(k) > n + 1 and k[n] == key_lists[0][n] for k in key_lists):
        n += 1
    return n


def param_leaves(plan) -> list[int]:
    """The flat argument indices of the parameters (see :func:`input_layers`)."""
    return weight_leaves(plan._in_tree)


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


# ----- operations to layers
def _name_matcher(layers):
    """``where`` -> the first layer its scopes name (a layer ``encoder/block_0`` needs both
    scopes in a row), else None."""
    by_last: dict[str, list[tuple[str, tuple]]] = defaultdict(list)
    for name in layers:
        scopes = tuple(p for p in re.split(r"[/\[\]]", name) if p and not p.isdigit())
        if scopes and not re.search(r"\[\d+\]$", name):
            by_last[scopes[-1]].append((name, scopes))

    def match(where: str) -> str | None:
        parts = [p for p in re.split(r"[/().]", where or "") if p]
        for j, part in enumerate(parts):
            for name, scopes in by_last.get(part, ()):
                if tuple(parts[j + 1 - len(scopes):j + 1]) == scopes:
                    return name
        return None
    return match


def node_layers(plan) -> list[str]:
    """A layer name (or ``other``) per graph node; see the module docstring."""
    graph = plan._details[0]
    if "autopar.node_layers" not in graph.analyses:
        names, _ = input_layers(plan._in_tree, [a.shape for a in plan._arg_avals])
        graph.analyses["autopar.node_layers"] = _labels(graph, names)
    return graph.analyses["autopar.node_layers"]


def _labels(graph, input_names) -> list[str]:
    match = _name_matcher({n for n in input_names if n})
    label: list[str | None] = [None] * len(graph.nodes)
    for nid, name in zip(graph.input_nodes, input_names):
        label[nid] = name
    for node in graph.nodes:
        if node.kind == NodeKind.OP:
            label[node.id] = match(node.where)
    by_path = [node.id for node in graph.nodes
               if node.kind == NodeKind.OP and label[node.id] is not None]
    producer = {vid: nid for vid, (nid, _) in graph.producer.items()}
    optimizer = [p == Phase.OPTIMIZER for p in node_phases(graph)]

    def state(vid) -> str | None:
        """The layer of the argument ``vid`` is (through dtype casts), if it is one."""
        node = graph.nodes[producer[vid]] if vid in producer else None
        while (node is not None and node.primitive in _PASS_THROUGH
               and node.ins[0] in producer):
            node = graph.nodes[producer[node.ins[0]]]
        return label[node.id] if node is not None and node.kind == NodeKind.INPUT else None

    for node in graph.nodes:   # what it reads: an embedding's gather, an optimizer's update
        if label[node.id] is None and node.kind == NodeKind.OP:
            reads = Counter(state(v) for v in node.ins if v is not None)
            reads.pop(None, None)
            got = {label[producer[v]] for v in node.ins if v in producer} - {None}
            if len(reads) == 1 or reads and is_region(node):   # a pipeline region: its stack
                label[node.id] = reads.most_common(1)[0][0]
            elif len(got) == 1 and optimizer[node.id]:
                label[node.id] = got.pop()
    users = consumers(graph)
    for node in reversed(graph.nodes):   # what reads it: an embedding's gradient
        if label[node.id] is None and node.kind == NodeKind.OP:
            got = {label[u.id] for v in node.outs for u in users.get(v, ())}
            if len(got) == 1 and None not in got:
                label[node.id] = got.pop()
    _label_loss(graph, label, by_path)
    return [x or OTHER for x in label]


def is_region(node) -> bool:
    """A ``jax.shard_map`` region of the traced step (a pipeline's stages)."""
    return node.kind == NodeKind.OP and op_info(node).manual_region


def pipelined_layer(plan) -> str | None:
    """The layer whose stack the plan pipelines (its first region's), or None."""
    if not plan.pipeline or plan._details is None:
        return None
    region = next((n for n in plan._details[0].nodes if is_region(n)), None)
    return None if region is None else node_layers(plan)[region.id]


def _label_loss(graph, label: list, by_path: list[int]) -> None:
    """Label ``LOSS`` the operations without a layer that run after the last forward operation
    a layer's source path names and before the first such backward one (all after it
    without a backward)."""
    phases = node_phases(graph)
    forward = [i for i in by_path if phases[i] == Phase.FORWARD]
    backward = [i for i in by_path if phases[i] == Phase.BACKWARD]
    if not forward:
        return
    end = backward[0] if backward else len(graph.nodes)
    for i in range(forward[-1] + 1, end):
        if label[i] is None and graph.nodes[i].kind == NodeKind.OP:
            label[i] = LOSS


#: A gather's gradient, which jax may run after the last operation of the backward's source
#: path: it is still the backward's (its layer is the gathered table's, whose update reads
#: it), not the optimizer's.
_GRADIENT_SCATTERS = frozenset({lax.scatter_add_p})


def node_phases(graph) -> list[Phase]:
    """Forward, backward (``transpose(...)`` in its source path) or optimizer (after the last
    backward operation, outside the differentiated function, and not a gather's gradient)
    per node."""
    back = [i for i, n in enumerate(graph.nodes) if "transpose(" in n.where]
    first, last = (back[0], back[-1]) if back else (len(graph.nodes), len(graph.nodes))
    out = []
    for i, node in enumerate(graph.nodes):
        if ("transpose(" in node.where or first <= i <= last and "jvp(" not in node.where
                or i > last and node.primitive in _GRADIENT_SCATTERS):
            out.append(Phase.BACKWARD)
        elif i > last and "jvp(" not in node.where:
            out.append(Phase.OPTIMIZER)
        else:
            out.append(Phase.FORWARD)
    return out


# ----- rows
def has_layers(plan) -> bool:
    """Whether ``plan`` can say what each layer holds and sends: it has its traced program,
    or was loaded from a file that kept its explanation (``autopar._explained``)."""
    return plan._details is not None or plan._explained is not None


def layer_rows(plan) -> list[LayerRow]:
    """Rows in the parameters' order (``block_2`` before ``block_10``), then ``loss`` and
    ``other``; a loaded plan's are those it was saved with."""
    if plan._details is None:
        return list(plan._explained.rows)
    graph, strats, choice, comms = plan._details
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape))
    specs = value_specs(graph, strats, choice)
    shapes = [tuple(a.shape) for a in plan._arg_avals]
    names, n_params = input_layers(plan._in_tree, shapes)
    shardings = jax.tree_util.tree_leaves(plan.in_shardings)
    rows: dict[str, LayerRow] = {}
    params = set(param_leaves(plan))
    for i, (path, name) in enumerate(zip(plan.in_paths, names)):
        if name is None:
            continue
        row = rows.setdefault(name, LayerRow(name))
        if i in params:
            spec = shardings[i].spec
            row.params.append(ParamLeaf(path, shapes[i], local_shape(shapes[i], spec, sizes),
                                        spec))
        vid = graph.nodes[graph.input_nodes[i]].outs[0]
        row.state_bytes += value_bytes(graph, vid, specs[vid], sizes)
    extra = {LOSS: LayerRow(LOSS), OTHER: LayerRow(OTHER)}

    def row_of(label: str) -> LayerRow:
        return rows.get(label) or extra.get(label, extra[OTHER])

    labels = list(node_layers(plan))
    for node in graph.nodes:
        taken = strats[node.id][choice[node.id]]
        row = row_of(labels[node.id])
        row.compute_s += taken.compute_s * node.trip_count
        if taken.rewrite is not None:
            key = f"{taken.rewrite.kind.value}({','.join(taken.rewrite.axes)})"
            row.rewrites[key] = row.rewrites.get(key, 0) + 1
        label = attention_label(node, taken)
        if label is not None:
            row.attention.append(label)
    regions = [node for node in graph.nodes if is_region(node)]
    if plan.pipeline and regions:   # the pipelined stack, priced apart from the ILP's ops
        row_of(labels[regions[0].id]).compute_s += plan.pipeline["predicted_time_s"] or 0.0
        for node in regions[1:]:    # a backward region's sums are the stack's too
            labels[node.id] = labels[regions[0].id]
    for c in comms:
        if c.step.wire_bytes:
            row = row_of(labels[c.node])
            row.comm_s += c.time_s * c.trips
            row.comm_bytes += c.step.wire_bytes * c.trips
            row.collectives += c.trips
    loss = [extra[LOSS]] if extra[LOSS].compute_s or extra[LOSS].comm_s else []
    return sorted(rows.values(), key=lambda r: natural_key(r.name)) + loss + [extra[OTHER]]


def local_shape(shape, pspec, axis_sizes) -> tuple[int, ...]:
    """The per-device block of a ``shape`` split as ``pspec`` says."""
    entries = list(pspec) + [None] * (len(shape) - len(pspec))
    out = []
    for d, e in zip(shape, entries):
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        n = _prod(axis_sizes[a] for a in axes)
        out.append(-(-d // n))
    return tuple(out)


def natural_key(name: str) -> tuple:
    """Sorts ``block_2`` before ``block_10``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def same_layer_groups(names: list[str]) -> list[list[str]]:
    """Layer names grouped by stem (``block_0``, ``block_1`` -> one group; ``layers[3]``
    with the other ``layers[i]``), each in number order, in order of first appearance."""
    groups: dict[str, list[str]] = {}
    for name in names:
        m = re.match(r"^(.*?)(?:_?\d+|\[\d+\])$", name)
        stem = m.group(1) if m else name
        groups.setdefault(stem, []).append(name)
    return [sorted(g, key=natural_key) for g in groups.values()]


def memory_over_program(plan) -> tuple[int, tuple[int, ...]]:
    """(bytes held for the whole call, other live bytes at each node), per device."""
    graph, strats, choice, _ = plan._details
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape))
    on_cpu = plan.mesh.devices.flat[0].platform == "cpu"
    donated = frozenset(graph.input_nodes[i]
                        for i in flat_donation(plan._in_tree, plan.donate_argnums))
    held, live = plan_timeline(graph, strats, choice, sizes, on_cpu, donated)
    kept = _pipeline_kept(plan)
    if kept:   # a pipeline region holds its stages' activations while it runs
        live = tuple(b + kept if is_region(graph.nodes[i]) else b for i, b in enumerate(live))
    return held, live


def _pipeline_kept(plan) -> int:
    """Bytes per device a pipelined plan's region keeps for its backward (0 without one)."""
    return (plan.pipeline or {}).get("activation_bytes") or 0


def flat_donation(in_tree, donate_argnums) -> tuple[int, ...]:
    """The flat argument leaves that ``donate_argnums`` (as in ``jax.jit``) donates."""
    if not donate_argnums:
        return ()
    if isinstance(donate_argnums, int):
        donate_argnums = (donate_argnums,)
    counts = [c.num_leaves for c in in_tree.children()]
    out, start = [], 0
    for i, c in enumerate(counts):
        if i in donate_argnums:
            out += range(start, start + c)
        start += c
    return tuple(out)


@dataclass(frozen=True)
class LiveBuffer:
    """A buffer live at the predicted peak: an argument (``path``) or a value the program
    makes (``node``: its producer), with its per-device bytes."""
    nbytes: int
    path: str = ""
    node: int | None = None
    shape: tuple[int, ...] = ()
    what: str = ""     # said instead of the producer, for a sum of buffers (no shape)


def peak_buffers(plan, top: int = 8) -> tuple[int, list[LiveBuffer]]:
    """(the node index of the predicted peak, the largest buffers live there: up to ``top``,
    half of them values the program makes when it has that many, half arguments)."""
    graph, strats, choice, _ = plan._details
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape))
    specs = value_specs(graph, strats, choice)
    _, live = memory_over_program(plan)
    at = max(range(len(live)), key=live.__getitem__) if live else 0
    found = [LiveBuffer(value_bytes(graph, graph.nodes[n].outs[0],
                                    specs[graph.nodes[n].outs[0]], sizes), path=p,
                        shape=graph.values[graph.nodes[n].outs[0]].shape)
             for n, p in zip(graph.input_nodes, plan.in_paths)]
    on_cpu = plan.mesh.devices.flat[0].platform == "cpu"
    if is_region(graph.nodes[at]) and _pipeline_kept(plan):
        found.append(LiveBuffer(_pipeline_kept(plan), node=at,
                                what="activations the pipeline's stages keep for the backward"))
    for b in temporaries(graph, on_cpu):
        if b.born <= at <= b.dies:
            found.append(LiveBuffer(int(b.scale * value_bytes(graph, b.vid, specs[b.vid], sizes)),
                                    node=b.born, shape=graph.values[b.vid].shape))
    made = sorted((b for b in found if b.node is not None), key=lambda b: -b.nbytes)
    args = sorted((b for b in found if b.node is None), key=lambda b: -b.nbytes)
    half = max(top - len(made[:top // 2]), top // 2)   # both kinds, when both are there
    return at, sorted(made[:top - min(half, len(args))] + args[:half], key=lambda b: -b.nbytes)
