"""Hand-written sharding baselines that auto-sharding plans are compared with.

:func:`baseline_shardings` returns a :class:`~jax.sharding.PartitionSpec` per leaf of a
function's example arguments ``args`` (a tuple; by convention ``(params, opt_state, batch)`` or
``(params, batch)``: the first element holds the parameters, the last one the batch, anything
in between is optimizer state). :func:`jit_baseline` jits a function with those shardings.

Rules, applied per leaf; a dim that does not divide by the mesh axes it would be sharded over
is left unsharded. Given the function (``fn=``, as :func:`jit_baseline` and autopar's own
callers always do), which weights are column- or row-parallel, embeddings or experts is read
from the traced program (``autopar._tp_structure``: which dots consume which weights), so any
library's names work; without it, from the key paths' names as listed below:

``dp``
    Batch leaves sharded on dim 0 over all ``batch_axes`` jointly; everything else replicated.
``fsdp``
    As ``dp``, plus every parameter and optimizer-state leaf of rank >= 1 sharded on its
    largest divisible dim over the batch axes (ZeRO-3 style).
``megatron``
    Tensor + data parallel. Batch on ``batch_axes`` (minus ``model_axis``); column-parallel
    kernels (module or param named ``qkv``, ``q``, ``k``, ``v``, ``mlp_in``, ``gate``, ``up``,
    ``experts_in``, ``wi``, optionally with a ``_<n>`` suffix) sharded on their output (last)
    dim over ``model_axis`` together with their biases; row-parallel kernels (``attn_out``,
    ``o``, ``mlp_out``, ``down``, ``experts_out``, ``wo``) on their input (second-to-last)
    dim. Embeddings, norms, the router and everything else replicated. On a 1-D mesh whose
    only axis is ``model_axis`` there is no data parallelism.
``megatron_vocab``
    ``megatron`` plus the token embedding table (param ``embedding`` of a module named
    ``embed``/``tok_embed``/``token_embed``/``wte``/``embedder``) sharded on its vocab dim (0)
    and the untied output projection ``lm_head`` on its output (vocab) dim over ``model_axis``.
``expert``
    Batch on ``batch_axes``; expert weights (``experts_in``/``experts_out``, leading expert
    dim) sharded on dim 0 over ``expert_axis`` (default ``model_axis``); the rest replicated.

Optimizer-state leaves mirror the parameter they belong to: an optax state holds copies of
the parameter tree (``mu``, ``nu``, ...), so a leaf whose key path ends with a parameter's key
path (the longest such common suffix wins; shapes must agree) gets that parameter's spec.
Other leaves (step counts, ...) are replicated (under ``fsdp`` they follow the fsdp rule).
"""

from __future__ import annotations

import enum
import math
import re
from typing import Any, Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autopar._tp_structure import Structure, structure_of, structure_of_jaxpr
from autopar.errors import ArgumentError
from autopar._context_baselines import ContextBaseline, compile_context_baseline  # noqa: F401

__all__ = [
    "Baseline",
    "baseline_kinds",
    "baseline_kwargs",
    "baseline_named_shardings",
    "baseline_shardings",
    "jit_baseline",
    "leaf_names",
    "structure_of",
    "structure_of_jaxpr",
]


class Baseline(enum.Enum):
    DATA_PARALLEL = "dp"
    FSDP = "fsdp"
    MEGATRON = "megatron"
    MEGATRON_VOCAB = "megatron_vocab"
    EXPERT = "expert"


COLUMN_PARALLEL = ("qkv", "q", "k", "v", "mlp_in", "gate", "up", "experts_in", "wi")
ROW_PARALLEL = ("attn_out", "o", "mlp_out", "down", "experts_out", "wo")
EXPERT_PARAMS = ("experts_in", "experts_out")
EMBEDDING_MODULES = ("embed", "tok_embed", "token_embed", "wte", "embedder")
VOCAB_OUTPUT_MODULES = ("lm_head",)

# Trailing key-path entries that wrap a value without naming it (flax NNX ``Variable.value``).
_WRAPPER_KEYS = ("value", "raw_value")
_SUFFIX = re.compile(r"_\d+$")


def parse_kind(kind: Baseline | str) -> Baseline:
    """The :class:`Baseline` named by ``kind`` (its value or name, any case), or an
    ArgumentError listing them."""
    if isinstance(kind, Baseline):
        return kind
    if isinstance(kind, str):
        for member in Baseline:
            if kind.lower() in (member.value, member.name.lower()):
                return member
    choices = ", ".join(repr(m.value) for m in Baseline)
    raise ArgumentError(f"unknown baseline kind {kind!r}; valid choices are {choices}")


def _key_name(key) -> str | int:
    if isinstance(key, jax.tree_util.DictKey):
        return key.key if isinstance(key.key, int) else str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return key.idx
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return key.key
    return str(key)


def leaf_names(path: Sequence[Any]) -> tuple:
    """A key path as plain names/indices, without trailing ``.value`` wrapper entries."""
    names = [_key_name(k) for k in path]
    while names and names[-1] in _WRAPPER_KEYS:
        names.pop()
    return tuple(names)


def _matches(name, candidates: Sequence[str]) -> bool:
    return isinstance(name, str) and (name in candidates or _SUFFIX.sub("", name) in candidates)


def _role(names: tuple) -> tuple[str, str] | None:
    """``(kind, param)`` with kind in column/row/expert_in/expert_out/embedding/vocab_out."""
    if not names:
        return None
    leaf = names[-1]
    module = names[-2] if len(names) >= 2 else None
    if leaf in EXPERT_PARAMS:
        return ("column" if leaf == "experts_in" else "row"), "kernel"
    if leaf == "embedding" and _matches(module, EMBEDDING_MODULES):
        return "embedding", "embedding"
    if leaf in ("kernel", "bias"):
        if _matches(module, VOCAB_OUTPUT_MODULES):
            return "vocab_out", leaf
        if _matches(module, COLUMN_PARALLEL):
            return "column", leaf
        if _matches(module, ROW_PARALLEL):
            return "row", leaf
    return None


class _Axes:
    def __init__(self, mesh, names: tuple[str, ...]):
        self.names = names
        self.size = math.prod(mesh.shape[n] for n in names) if names else 1

    @property
    def entry(self):
        if not self.names:
            return None
        return self.names[0] if len(self.names) == 1 else self.names


def _spec_on(shape, dim: int, axes: _Axes) -> PartitionSpec:
    rank = len(shape)
    if not axes.names or rank == 0:
        return PartitionSpec()
    dim = dim % rank
    if shape[dim] % axes.size != 0:
        return PartitionSpec()
    entries = [None] * rank
    entries[dim] = axes.entry
    return PartitionSpec(*entries)


def _fsdp_spec(shape, axes: _Axes) -> PartitionSpec:
    if not axes.names or len(shape) == 0:
        return PartitionSpec()
    divisible = [d for d in range(len(shape)) if shape[d] % axes.size == 0 and shape[d] > 1]
    if not divisible:
        return PartitionSpec()
    best = max(divisible, key=lambda d: (shape[d], -d))
    return _spec_on(shape, best, axes)


def _check_axes(mesh, axes: Sequence[str], what: str) -> None:
    for axis in axes:
        if axis not in mesh.axis_names:
            raise ArgumentError(
                f"{what} {axis!r} is not an axis of the mesh; valid choices are "
                f"{', '.join(repr(n) for n in mesh.axis_names)}"
            )


def _normalize_axes(batch_axes) -> tuple[str, ...]:
    if batch_axes is None:
        return ()
    if isinstance(batch_axes, str):
        return (batch_axes,)
    return tuple(batch_axes)


def _param_spec(
    kind: Baseline, names: tuple, shape, batch: _Axes, model: _Axes | None, expert: _Axes | None
) -> PartitionSpec:
    if kind is Baseline.DATA_PARALLEL:
        return PartitionSpec()
    if kind is Baseline.FSDP:
        return _fsdp_spec(shape, batch)
    role = _role(names)
    if role is None:
        return PartitionSpec()
    what, param = role
    if kind is Baseline.EXPERT:
        if names[-1] in EXPERT_PARAMS and len(shape) >= 3:
            return _spec_on(shape, 0, expert)
        return PartitionSpec()
    # MEGATRON / MEGATRON_VOCAB
    if what == "column":
        if (param == "kernel" and len(shape) >= 2) or (param == "bias" and len(shape) >= 1):
            return _spec_on(shape, -1, model)
    elif what == "row":
        if param == "kernel" and len(shape) >= 2:
            return _spec_on(shape, -2, model)
    elif kind is Baseline.MEGATRON_VOCAB:
        if what == "embedding" and len(shape) >= 2:
            return _spec_on(shape, -2, model)
        if what == "vocab_out" and ((param == "kernel" and len(shape) >= 2) or param == "bias"):
            return _spec_on(shape, -1, model)
    return PartitionSpec()


def _structural_spec(kind: Baseline, leaf: int, shape, structure: Structure, batch: _Axes,
                     model: _Axes | None, expert: _Axes | None) -> PartitionSpec:
    """A parameter's spec under a baseline, from the program's structure."""
    if kind is Baseline.DATA_PARALLEL:
        return PartitionSpec()
    if kind is Baseline.FSDP:
        return _fsdp_spec(shape, batch)
    if kind is Baseline.EXPERT:
        dim = structure.expert_dims.get(leaf)
        return PartitionSpec() if dim is None or len(shape) < 3 else _spec_on(shape, dim, expert)
    dim = structure.megatron_dim(leaf, vocab_parallel=kind is Baseline.MEGATRON_VOCAB)
    return PartitionSpec() if dim is None else _spec_on(shape, dim, model)


def _mirrored_spec(names: tuple, shape: tuple, by_suffix: dict) -> PartitionSpec | None:
    """The spec of the parameter whose key path shares the longest suffix with ``names`` and
    has ``shape`` (the first such parameter on a tie), when that suffix has at least two keys
    (or all of ``names``); else None. ``by_suffix``: key-path suffix -> [(shape, spec)] of
    the parameters ending with it, in order."""
    for n in range(len(names), 0, -1):
        for pshape, pspec in by_suffix.get(names[-n:], ()):
            if pshape == shape:
                return pspec if n >= min(2, len(names)) else None
    return None


def baseline_shardings(
    kind: Baseline | str,
    args,
    mesh,
    *,
    batch_axes: Sequence[str] | str = ("data",),
    model_axis: str = "model",
    expert_axis: str | None = None,
    fn: Callable | None = None,
    structure: Structure | None = None,
):
    """PartitionSpecs for ``args`` (a tuple ``(params, [opt_state, ...,] batch)``) under a baseline.

    ``fn`` (or its ``structure``, :func:`structure_of`): the function the arguments are for;
    its traced program says which weights are column- or row-parallel (see the module
    docstring). Returns a pytree of :class:`PartitionSpec` with the structure of ``args``.
    """
    kind = parse_kind(kind)
    if not isinstance(args, (tuple, list)) or len(args) < 1:
        raise ArgumentError(
            "args must be a tuple (params, [opt_state, ...,] batch) of example arguments; "
            f"got {type(args).__name__}"
        )
    batch_names = _normalize_axes(batch_axes)
    _check_axes(mesh, batch_names, "batch axis")
    model = expert = None
    if kind in (Baseline.MEGATRON, Baseline.MEGATRON_VOCAB):
        _check_axes(mesh, (model_axis,), "model_axis")
        batch_names = tuple(a for a in batch_names if a != model_axis)
        model = _Axes(mesh, (model_axis,))
    elif kind is Baseline.EXPERT:
        axis = model_axis if expert_axis is None else expert_axis
        _check_axes(mesh, (axis,), "expert_axis" if expert_axis is not None else "model_axis")
        expert = _Axes(mesh, (axis,))
    batch = _Axes(mesh, batch_names)

    args = tuple(args)
    if structure is None and fn is not None and len(args) >= 2:
        structure = structure_of(fn, args)

    # Parameters: args[0] (when there is more than the batch).
    by_suffix: dict[tuple, list[tuple[tuple, PartitionSpec]]] = {}
    specs: list[Any] = []
    if len(args) >= 2:
        flat, treedef = jax.tree_util.tree_flatten_with_path(args[0])
        leaves = []
        for k, (path, leaf) in enumerate(flat):
            names = leaf_names(path)
            shape = tuple(getattr(leaf, "shape", ()))
            spec = (_param_spec(kind, names, shape, batch, model, expert) if structure is None
                    else _structural_spec(kind, k, shape, structure, batch, model, expert))
            for n in range(1, len(names) + 1):
                by_suffix.setdefault(names[-n:], []).append((shape, spec))
            leaves.append(spec)
        specs.append(jax.tree_util.tree_unflatten(treedef, leaves))

    # Optimizer state (and anything else between params and batch): mirror the params.
    for middle in args[1:-1]:
        flat, treedef = jax.tree_util.tree_flatten_with_path(middle)
        leaves = []
        for path, leaf in flat:
            names = leaf_names(path)
            shape = tuple(getattr(leaf, "shape", ()))
            if kind is Baseline.FSDP:
                spec = _fsdp_spec(shape, batch)
            else:
                spec = _mirrored_spec(names, shape, by_suffix) or PartitionSpec()
            leaves.append(spec)
        specs.append(jax.tree_util.tree_unflatten(treedef, leaves))

    # Batch: dim 0 over the batch axes jointly.
    batch_tree = args[-1]
    specs.append(
        jax.tree.map(lambda x: _spec_on(tuple(getattr(x, "shape", ())), 0, batch), batch_tree)
    )
    return tuple(specs)


def _to_named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def baseline_named_shardings(kind: Baseline | str, args, mesh, **kw):
    """:func:`baseline_shardings` as :class:`NamedSharding` on ``mesh`` (for ``device_put``;
    pass ``fn=`` as to :func:`jit_baseline`, so that both agree)."""
    return _to_named(mesh, baseline_shardings(kind, args, mesh, **kw))


def jit_baseline(fn: Callable, args, mesh, kind: Baseline | str, **kw) -> Any:
    """``jax.jit(fn)`` with a baseline's input shardings.

    Outputs that mirror an input (same position in the argument/result tuple, same key path
    and shape, such as new params and optimizer state) get that input's sharding; the rest
    (the loss, metrics) are replicated. ``kw`` goes to :func:`baseline_shardings`.
    """
    in_shardings, out_shardings = baseline_io_shardings(fn, args, mesh, kind, **kw)
    return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)


def baseline_io_shardings(fn: Callable, args, mesh, kind: Baseline | str, **kw):
    """(in_shardings, out_shardings) of :func:`jit_baseline`, as NamedSharding pytrees."""
    specs = baseline_shardings(kind, args, mesh, fn=fn, **kw)
    in_shardings = tuple(_to_named(mesh, s) for s in specs)

    by_path: dict[tuple, tuple[tuple, PartitionSpec]] = {}
    for path, (leaf, spec) in _flatten_pairs(tuple(args), tuple(specs)):
        by_path[leaf_names(path)] = (tuple(getattr(leaf, "shape", ())), spec)

    out_shape = jax.eval_shape(fn, *args)
    out_flat, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    # Only a tuple of results mirrors the argument tuple position by position.
    mirrors = isinstance(out_shape, tuple)
    out_specs = []
    for path, leaf in out_flat:
        entry = by_path.get(leaf_names(path)) if mirrors else None
        if entry is not None and entry[0] == tuple(leaf.shape):
            out_specs.append(entry[1])
        else:
            out_specs.append(PartitionSpec())
    out_shardings = jax.tree_util.tree_unflatten(out_tree, _to_named(mesh, out_specs))
    return in_shardings, out_shardings


def _flatten_pairs(args, specs):
    """(path, (leaf, spec)) for every leaf of ``args`` with its spec from ``specs``."""
    flat_args = jax.tree_util.tree_flatten_with_path(args)[0]
    flat_specs = jax.tree_util.tree_leaves(specs)
    assert len(flat_args) == len(flat_specs), (len(flat_args), len(flat_specs))
    return [(path, (leaf, spec)) for (path, leaf), spec in zip(flat_args, flat_specs)]


def baseline_kinds(mesh, args, structure: Structure | None = None) -> list[str]:
    """The baselines that apply: DP and FSDP always; Megatron where the mesh has a `model`
    axis (with vocab-parallel embedding too); expert parallel where params hold experts (a
    weight dim that is a batch dim of its dot, given the ``structure``; else by name)."""
    kinds = ["dp", "fsdp"]
    if "model" in mesh.axis_names:
        kinds += ["megatron", "megatron_vocab"]
    if structure is not None:
        experts = bool(structure.expert_dims)
    else:
        experts = "experts_in" in {n for p, _ in jax.tree_util.tree_flatten_with_path(args[0])[0]
                                   for n in leaf_names(p)}
    if experts:
        kinds.append("expert")
    return kinds


def baseline_kwargs(mesh, kind: str) -> dict:
    """The axes a baseline uses on ``mesh``: the batch over every axis (Megatron: every axis
    but `model`); experts over `expert`, or the last axis."""
    if kind.startswith("megatron"):
        batch_axes = tuple(a for a in mesh.axis_names if a != "model")
    else:
        batch_axes = tuple(mesh.axis_names)
    kw = {"batch_axes": batch_axes or tuple(mesh.axis_names)}
    if kind == "expert":
        kw["expert_axis"] = "expert" if "expert" in mesh.axis_names else mesh.axis_names[-1]
        kw["batch_axes"] = tuple(mesh.axis_names)
    return kw
