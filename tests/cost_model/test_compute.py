"""Shape-dependent matmul efficiency: tile padding on built-in profiles, measured curves.
(A dot's matmul dims come from the op-info registry: tests/passes/test_ops.py.)"""

import dataclasses

import pytest

from autopar.cost_model.compute import matmul_efficiency, roofline_s
from autopar.cost_model.hardware import get_profile


def test_tile_multiples_run_at_the_profile_efficiency_and_small_dims_pad():
    h100 = get_profile("h100")
    assert matmul_efficiency(h100, (1024, 4096, 1024)) == h100.matmul_efficiency
    assert matmul_efficiency(h100, (1024, 4096, 64)) == pytest.approx(
        h100.matmul_efficiency / 2)
    assert matmul_efficiency(h100, (1024, 192, 1024)) == pytest.approx(
        h100.matmul_efficiency * 192 / 256)
    v6e = get_profile("tpu-v6e")
    assert matmul_efficiency(v6e, (1024, 128, 1024)) == pytest.approx(
        v6e.matmul_efficiency / 2)


def test_a_measured_curve_replaces_the_tile_model():
    prof = dataclasses.replace(get_profile("cpu"), matmul_efficiency=1.0,
                               matmul_curve=((64, 0.25), (256, 1.0)))
    assert matmul_efficiency(prof, (64, 1000, 1000)) == pytest.approx(0.25)
    assert matmul_efficiency(prof, (128, 1000, 1000)) == pytest.approx(0.625)
    assert matmul_efficiency(prof, (4096, 4096, 4096)) == 1.0


def test_small_matmuls_cost_more_per_flop():
    h100 = get_profile("h100")
    flops = 2.0 * 1024 * 1024 * 64
    big = roofline_s(flops, 0, h100, "bfloat16", contraction=True, dims=(1024, 1024, 1024))
    small = roofline_s(flops, 0, h100, "bfloat16", contraction=True, dims=(1024, 1024, 64))
    assert small == pytest.approx(2 * big)
