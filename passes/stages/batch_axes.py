"""Where the batch axis runs through a jaxpr, and whether examples are ever mixed.

Microbatching is exact only where each example's result depends on that example alone. This
analysis follows the batch axis of every value (``int`` position, or ``None`` for a value that
does not depend on the batch) equation by equation, recursing into ``jit``, ``custom_jvp``,
``custom_vjp`` and ``checkpoint`` bodies, and, by :class:`Mode`:

- ``PRE``: any op may mix examples (the code before the layer stack runs on the whole batch);
  a value that mixed them loses its axis.
- ``BODY``: no op may mix examples; one that does (a reduction over the batch axis, a batch
  statistic, an op the analysis does not know) raises :class:`PipelineError` naming it.
- ``LOSS``: as ``BODY``, except that a ``reduce_sum`` over the batch axis starts a *batch sum*
  (:class:`BatchSum`), which may only be scaled by literals, negated, added to another batch
  sum, cast or reshaped on its way to the output. The loss is then a fixed combination of sums
  over examples, which a microbatched trace reproduces up to each term's literal scale.

A reshape may merge the batch axis with the axes after it (tokens flattened to rows before a
dense layer, logits flattened before the cross entropy): the batch is then the outer factor
of the merged axis (:class:`Merged`), and each example still owns a contiguous block of it.
Ops that keep that axis whole keep it merged; a reshape that splits the batch back out gives
the plain axis again; one that cuts into the batch factor mixes.

Literals outside batch-sum scaling are collected in traversal order: two traces of the same
code at two batch sizes must agree on them, or the code depends on the batch size itself. So
must the shapes of random numbers drawn from a key no example owns (dropout from the step's
key): drawn at a microbatch's shape they are other numbers than the whole batch's draw. Keys
that hold the batch (one per example, drawn from under ``jax.vmap``) are followed like any
value: each example's numbers come from its own key, whatever the microbatch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
from jax.extend import core as jcore

from autopar.errors import PipelineError


class Mode(enum.Enum):
    PRE = "pre"
    BODY = "body"
    LOSS = "loss"


@dataclass(frozen=True)
class BatchSum:
    """A value summed over examples: ``sum_k scale[k] * term_k`` (terms numbered in order)."""

    scales: tuple[tuple[int, float], ...]

    def scaled(self, factor: float) -> BatchSum:
        return BatchSum(tuple((k, s * factor) for k, s in self.scales))


@dataclass(frozen=True)
class Merged:
    """The batch as the outer factor of axis ``axis``, ``inner`` elements of it per example
    (a reshape merged the batch with the axes after it)."""

    axis: int
    inner: int


def _state(axis: int, inner: int):
    """The state of a value whose batch runs on ``axis`` with ``inner`` elements per example."""
    return axis if inner == 1 else Merged(axis, inner)


@dataclass
class Analysis:
    """The result: each output's state, and the literals met outside batch-sum scaling."""

    mode: Mode
    literals: list = field(default_factory=list)
    draws: list = field(default_factory=list)    # (primitive, shape) of each draw from a key
    n_terms: int = 0
    outputs: list = field(default_factory=list)


_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                         "reduce_or", "reduce_xor", "argmax", "argmin"})
#: Same-shape ops that mix along one axis (param name of the axis or axes).
_ALONG = {"cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis",
          "cumlogsumexp": "axis", "sort": "dimension", "rev": "dimensions"}
#: Ops that may keep an operand's shape without being elementwise: never treated as one.
_NOT_ELEMENTWISE = frozenset({
    "scan", "while", "cond", "shard_map", "all_gather", "psum", "ppermute", "all_to_all",
    "fft", "top_k", "iota", "custom_linear_solve", "triangular_solve", "cholesky", "scatter",
    "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
    "scatter-max", "scatter_max", "scatter_apply", "reduce_window", "reduce_window_sum",
    "reduce_window_max", "reduce_window_min", "select_and_scatter_add",
    "select_and_gather_add", "conv_general_dilated", "split", "argsort", "reduce",
    "pallas_call", "ffi_call", "custom_call", "pure_callback", "io_callback"})
#: Primitives of a key array whose result adds trailing axes per key (the key's axes lead).
_KEYS_TO_MORE = frozenset({"random_bits", "random_split", "random_unwrap"})
#: Primitives that draw random numbers at their result's shape.
_DRAWS = frozenset({"random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform"})
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}
_SCALE_OPS = frozenset({"mul", "div", "neg", "convert_element_type", "reduce_sum",
                        "broadcast_in_dim", "reshape", "squeeze", "add", "sub", "copy",
                        "copy_p", "transpose"})

MSG_MIXES = (
    "`{op}` mixes examples across the batch inside {where}, so splitting the batch into "
    "microbatches would change the result (batch statistics, a loss normalized by a count "
    "computed from the batch, an op that indexes across examples). Compute it per example, "
    "or {fix}."
)
MSG_ON_SUM = (
    "`{op}` acts on a sum over the batch's examples in {where} other than by scaling it by a "
    "constant or adding another such sum (a division by a count or a total weight computed "
    "from the batch, batch statistics, a constant term), so the loss is not a fixed weighted "
    "sum over examples and splitting the batch into microbatches would change it. Scale sums "
    "over examples by constants only (a static batch size), or {fix}."
)
#: MSG_MIXES's other fix: in the layers no schedule microbatches exactly; in the loss GPipe
#: does (it computes the loss on the whole batch).
FIX_IN_LAYERS = "plan without a pipeline (`pipeline=None`)"
FIX_IN_LOSS = ("pipeline with `autopar.Pipeline(schedule=\"gpipe\")` (which computes the "
               "loss on the whole batch)")
MSG_DRAWS = (
    "random numbers are drawn in {where} (`{op}`: dropout, say) at a shape that includes the "
    "batch, from a key no example owns: a microbatch would draw other numbers than the batch "
    "does, and the step would not compute what it computes on one device. Draw from "
    "per-example keys instead (`keys = jax.random.split(key, batch)` passed as a batch "
    "argument, and `jax.vmap` over them and the examples), drop the random draw from there, "
    "or {fix}."
)


def check_draws(found: list[Analysis], where: str, fix: str) -> None:
    """Raise where two traces of ``where`` at two batch sizes (``found``) draw random numbers
    at different shapes (:data:`MSG_DRAWS`)."""
    for a, b in zip(found[0].draws, found[1].draws):
        if a != b:
            raise PipelineError(MSG_DRAWS.format(where=where, op=a[0], fix=fix))
    if len(found[0].draws) != len(found[1].draws):
        raise PipelineError(MSG_DRAWS.format(where=where, op="random_bits", fix=fix))


def analyze(jaxpr, in_states: list, mode: Mode, where: str) -> Analysis:
    """Follow the batch axis through ``jaxpr`` (a Jaxpr or ClosedJaxpr) from ``in_states``."""
    result = Analysis(mode=mode)
    result.outputs = _run(getattr(jaxpr, "jaxpr", jaxpr), in_states, result, where)
    return result


def _run(jaxpr, in_states, result: Analysis, where: str) -> list:
    env: dict = {}
    for var, state in zip(jaxpr.invars, in_states, strict=True):
        env[var] = state
    for eqn in jaxpr.eqns:
        states = []
        for var in eqn.invars:
            if isinstance(var, jcore.Literal):
                states.append(None)
            else:
                states.append(env.get(var))
        outs = _eqn(eqn, states, result, where)
        for var, state in zip(eqn.outvars, outs, strict=True):
            env[var] = state
    return [None if isinstance(v, jcore.Literal) else env.get(v) for v in jaxpr.outvars]


def _literal_value(var):
    return np.asarray(var.val).tolist() if isinstance(var, jcore.Literal) else None


def _eqn(eqn, states, result: Analysis, where: str) -> list:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if name in _CALLS:
        sub = eqn.params[_CALLS[name]]
        return _run(getattr(sub, "jaxpr", sub), states, result, where)
    if any(isinstance(s, BatchSum) for s in states):
        return [_batch_sum(eqn, states, result, where)] * n_out
    for var in eqn.invars:
        if isinstance(var, jcore.Literal):
            result.literals.append((name, _literal_value(var)))
    if all(s is None for s in states):
        if name in _DRAWS:
            result.draws.append((name, tuple(getattr(eqn.outvars[0].aval, "shape", ()))))
        return [None] * n_out
    try:
        axes, inner = _unmerged(states)
        out = _axis_rule(eqn, axes, inner)
    except _Mixes:
        if result.mode is Mode.PRE:
            return [None] * n_out
        if result.mode is Mode.LOSS and name == "reduce_sum":
            result.n_terms += 1
            return [BatchSum(((result.n_terms - 1, 1.0),))]
        fix = FIX_IN_LAYERS if result.mode is Mode.BODY else FIX_IN_LOSS
        raise MixesError(MSG_MIXES.format(op=name, where=where, fix=fix)) from None
    return [out] * n_out


class MixesError(PipelineError):
    """A refusal because the code mixes examples (:data:`MSG_MIXES`, :data:`MSG_ON_SUM`); the
    stage pass adds which arguments it took for the batch."""


class _Mixes(Exception):
    """The equation mixes examples along the batch axis (or cannot be shown not to)."""


def _unmerged(states) -> tuple[list, int]:
    """The operands' batch axes, and the elements per example they share on them (1: none is
    merged); :class:`_Mixes` where the operands merge it differently."""
    inners = {s.inner for s in states if isinstance(s, Merged)}
    if not inners:
        return list(states), 1
    if len(inners) > 1 or any(isinstance(s, int) for s in states):
        raise _Mixes
    return [s.axis if isinstance(s, Merged) else s for s in states], inners.pop()


def _agree(axes) -> int:
    found = {a for a in axes if a is not None}
    if len(found) != 1:
        raise _Mixes
    return found.pop()


def _axis_rule(eqn, states, inner: int = 1):
    """The state of ``eqn``'s results from its operands' batch axes (``states``), which hold
    ``inner`` elements per example (:class:`Merged`)."""
    if eqn.primitive.name == "reshape":
        shape = tuple(getattr(eqn.invars[0].aval, "shape", ()))
        return _reshape(shape, tuple(eqn.outvars[0].aval.shape), _agree(states[:1]), inner)
    return _state(_axis(eqn, states), inner)


def _axis(eqn, states) -> int:
    """The batch axis of ``eqn``'s results, for every primitive but ``reshape``."""
    name, params = eqn.primitive.name, eqn.params
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    out_shape = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
    if name == "broadcast_in_dim":
        return params["broadcast_dimensions"][_agree(states)]
    if name == "transpose":
        return list(params["permutation"]).index(_agree(states))
    if name == "squeeze":
        a = _agree(states)
        if a in params["dimensions"]:
            raise _Mixes
        return a - sum(d < a for d in params["dimensions"])
    if name in _REDUCTIONS:
        a = _agree(states)
        if a in params["axes"]:
            raise _Mixes
        return a - sum(d < a for d in params["axes"])
    if name in _ALONG:
        a, along = _agree(states), params[_ALONG[name]]
        if a in (along if isinstance(along, tuple) else (along,)):
            raise _Mixes
        return a
    if name in _KEYS_TO_MORE:   # per-key results on trailing axes: each example's own key
        return _agree(states)
    if name == "random_wrap":   # key data's trailing axis becomes the key
        a = _agree(states)
        if a == len(shapes[0]) - 1:
            raise _Mixes
        return a
    if name == "dot_general":
        return _dot(params["dimension_numbers"], shapes, states)
    if name == "gather":
        return _gather(params, shapes, out_shape, states)
    if name == "slice":
        a = _agree(states)
        full = (params["start_indices"][a] == 0 and params["limit_indices"][a] == shapes[0][a]
                and (params["strides"] is None or params["strides"][a] == 1))
        if not full:
            raise _Mixes
        return a
    if name == "dynamic_slice":
        a = _agree(states[:1])
        if any(states[1:]) or params["slice_sizes"][a] != shapes[0][a]:
            raise _Mixes
        return a
    if name == "dynamic_update_slice":
        a = _agree(states[:2])
        if any(states[2:]) or shapes[1][a] != shapes[0][a]:
            raise _Mixes
        return a
    if name == "concatenate":
        a = _agree(states)
        if a == params["dimension"]:
            raise _Mixes
        return a
    if name == "pad":
        a = _agree(states[:1])
        if states[1] is not None or tuple(params["padding_config"][a]) != (0, 0, 0):
            raise _Mixes
        return a
    if name in _NOT_ELEMENTWISE or not all(_broadcasts(s, out_shape) for s in shapes):
        raise _Mixes
    return _agree(states)  # elementwise: every non-scalar operand has the output's shape


def _broadcasts(shape, out_shape) -> bool:
    """An elementwise operand: a scalar, or the output's rank with each dim equal or 1."""
    return not shape or (len(shape) == len(out_shape)
                         and all(d in (o, 1) for d, o in zip(shape, out_shape)))


def _reshape(shape, new, a: int, inner: int):
    """The state after reshaping ``shape`` (the batch the outer factor of axis ``a``, ``inner``
    elements per example) to ``new``: the axis that starts where ``a`` did, if the whole batch
    is its outer factor (row-major, each example keeps its contiguous block)."""
    batch = shape[a] // inner
    before = int(np.prod(shape[:a]))
    for b in range(len(new)):
        if int(np.prod(new[:b])) == before and new[b] >= batch > 0 and new[b] % batch == 0:
            return _state(b, new[b] // batch)
    raise _Mixes


def _dot(dimension_numbers, shapes, states) -> int:
    (lc, rc), (lb, rb) = dimension_numbers
    n_batch = len(lb)
    lhs_free = [d for d in range(len(shapes[0])) if d not in lc and d not in lb]
    rhs_free = [d for d in range(len(shapes[1])) if d not in rc and d not in rb]
    found = []
    for a, contract, batch, free, offset in ((states[0], lc, lb, lhs_free, n_batch),
                                             (states[1], rc, rb, rhs_free,
                                              n_batch + len(lhs_free))):
        if a is None:
            continue
        if a in contract:
            raise _Mixes
        found.append(list(batch).index(a) if a in batch else offset + free.index(a))
    return _agree(found)


def _gather(params, shapes, out_shape, states) -> int:
    dn = params["dimension_numbers"]
    operand, indices = states[0], states[1]
    batch_positions = [d for d in range(len(out_shape)) if d not in dn.offset_dims]
    found = []
    if operand is not None:
        offset_operand = [d for d in range(len(shapes[0]))
                          if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
        if operand in dn.operand_batching_dims:
            j = dn.start_indices_batching_dims[list(dn.operand_batching_dims).index(operand)]
            if indices is not None and indices != j:
                raise _Mixes
            found.append(batch_positions[j])
        elif (operand in offset_operand
              and params["slice_sizes"][operand] == shapes[0][operand]):
            found.append(dn.offset_dims[offset_operand.index(operand)])
        else:
            raise _Mixes
    if indices is not None:
        if indices == len(shapes[1]) - 1:
            raise _Mixes
        found.append(batch_positions[indices])
    return _agree(found)


def _batch_sum(eqn, states, result: Analysis, where: str) -> BatchSum:
    """Rules for an equation with a batch-sum operand (mode LOSS only produces them)."""
    name = eqn.primitive.name
    sums = [s for s in states if isinstance(s, BatchSum)]
    fail = MixesError(MSG_ON_SUM.format(op=name, where=where, fix=FIX_IN_LOSS))
    if name not in _SCALE_OPS:
        raise fail
    if name in ("add", "sub"):
        if len(sums) != 2:
            raise fail  # a sum over examples plus a batch-independent or per-example value
        second = sums[1].scaled(-1.0 if name == "sub" else 1.0)
        return BatchSum(sums[0].scales + second.scales)
    if name in ("mul", "div"):
        other = eqn.invars[1] if isinstance(states[0], BatchSum) else eqn.invars[0]
        value = _literal_value(other)
        if len(sums) != 1 or not isinstance(value, (int, float)) or (
                name == "div" and not isinstance(states[0], BatchSum)):
            raise fail
        return sums[0].scaled(value if name == "mul" else 1.0 / value)
    if name == "neg":
        return sums[0].scaled(-1.0)
    if any(s is not None and not isinstance(s, BatchSum) for s in states):
        raise fail
    return sums[0]
