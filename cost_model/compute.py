"""Compute cost: flops and bytes of one primitive application, and a roofline to seconds."""

from __future__ import annotations

import math

import numpy as np

_FREE = frozenset({
    "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice", "iota",
    "copy", "copy_p", "input", "output", "const", "carry", "scan_in", "scan_out", "merge",
    "convert_element_type", "sharding_constraint", "reshard", "stop_gradient",
    "bitcast_convert_type", "dynamic_slice", "concatenate", "pad", "rev", "select_n", "gather",
    "scatter-add", "scatter", "dynamic_update_slice", "split", "optimization_barrier",
})


def op_flops(prim: str, in_shapes, out_shapes, params) -> float:
    """Floating-point operations of one application, on the whole (unsplit) tensors.

    Counted as XLA's cost analysis counts them: 2 per multiply-add in contractions, one per
    output element for arithmetic, one per input element for reductions; data movement is free.
    """
    if prim == "dot_general":
        (lc, _), _ = params["dimension_numbers"]
        k = math.prod(in_shapes[0][d] for d in lc)
        return 2.0 * math.prod(out_shapes[0]) * k
    if prim == "conv_general_dilated":
        rhs = in_shapes[1]
        rhs_spec = params["dimension_numbers"][1]
        window = math.prod(rhs[d] for d in rhs_spec[2:])
        return 2.0 * math.prod(out_shapes[0]) * window * rhs[rhs_spec[1]]
    if prim in _FREE:
        return 0.0
    if prim.startswith("reduce_") or prim.startswith("cum") or prim in ("argmax", "argmin"):
        return float(math.prod(in_shapes[0]))
    return float(sum(math.prod(s) for s in out_shapes))


def matmul_dims(prim: str, params, local_in_shapes) -> tuple[int, int, int] | None:
    """(M, N, K) of one device's dot_general: rows, columns and contraction length (batch
    dims are separate matmuls); None for other primitives."""
    if prim != "dot_general" or len(local_in_shapes) < 2:
        return None
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs, rhs = local_in_shapes[0], local_in_shapes[1]
    m = math.prod(lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb)
    n = math.prod(rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb)
    k = math.prod(lhs[d] for d in lc)
    return m, n, k


def _tile_fraction(dim: int, tile: int) -> float:
    """The useful fraction of the padded tiles a dim of ``dim`` occupies."""
    return dim / (math.ceil(dim / tile) * tile)


def matmul_efficiency(profile, dims: tuple[int, int, int] | None) -> float:
    """Fraction of peak one matmul of per-device ``dims`` (M, N, K) reaches on ``profile``.

    With measured points (``profile.matmul_curve``, from ``autopar profile``) it interpolates
    them on log2 of the smallest dim. Otherwise every dim pads to the profile's matrix-unit
    tile, so the large-matmul efficiency is scaled by the useful fraction of the padded tiles
    (for dims that are multiples of the tile this is 1).
    """
    if dims is None:
        return profile.matmul_efficiency
    if profile.matmul_curve:
        sizes = [math.log2(s) for s, _ in profile.matmul_curve]
        fracs = [f for _, f in profile.matmul_curve]
        return profile.matmul_efficiency * float(
            np.interp(math.log2(max(min(dims), 1)), sizes, fracs))
    tile = profile.matmul_tile
    return profile.matmul_efficiency * math.prod(_tile_fraction(max(d, 1), tile) for d in dims)


def roofline_s(flops: float, bytes_moved: float, profile, dtype, *, contraction: bool,
               dims: tuple[int, int, int] | None = None) -> float:
    """max(compute, memory) time on one device; contractions run at the matmul efficiency of
    their per-device ``dims`` (see :func:`matmul_efficiency`), the rest is usually fused by
    XLA so only its flops count."""
    peak = profile.peak_flops(dtype)
    if contraction:
        return max(flops / (peak * matmul_efficiency(profile, dims)),
                   bytes_moved / profile.hbm_bandwidth_bytes_per_s)
    return flops / peak
