"""Compute cost: a roofline from an op's flops and bytes to seconds.

What an op computes (its flops, its matmul's dims) is per-primitive knowledge and lives with
the op-info registry (``passes.rules``); this prices the numbers.
"""

from __future__ import annotations

import math

import numpy as np


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
    if contraction:
        return max(flops / (profile.matmul_flops(dtype) * matmul_efficiency(profile, dims)),
                   bytes_moved / profile.achieved_hbm_bytes_per_s)
    return flops / profile.peak_flops(dtype)


def memory_bound_s(flops: float, bytes_moved: float, profile, dtype) -> float:
    """max(compute, memory) time on one device of an op outside matrix units (elementwise,
    layout, reductions): its flops at peak, or the bytes its kernel reads and writes."""
    return max(flops / profile.peak_flops(dtype) if flops else 0.0,
               bytes_moved / profile.achieved_hbm_bytes_per_s)
