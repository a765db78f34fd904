"""autopar.cost_model.hlo_ir and hlo_roofline: instructions of HLO text and the roofline time of
one kernel, on hand-written lines (numbers worked out from the shapes) and compiled programs."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from autopar.cost_model.hlo_ir import parse_module, tuple_elements
from autopar.cost_model.hlo_roofline import bytes_moved, kernel_time_s, matmuls

from .test_timeline import ROUND

MODULE = """\
HloModule m, is_scheduled=true

%fused_slice (p0: f32[8,1024], p1: s32[]) -> f32[1,1024] {
  %p0 = f32[8,1024]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,1024]{1,0} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={1,1024}
}

%fused_update (q0: f32[8,1024], q1: f32[1,1024], q2: s32[]) -> f32[8,1024] {
  %q0 = f32[8,1024]{1,0} parameter(0)
  %q1 = f32[1,1024]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %neg = f32[1,1024]{1,0} negate(%q1)
  ROOT %dus = f32[8,1024]{1,0} dynamic-update-slice(%q0, %neg, %q2, %z)
}

%fused_round_trip (t0: bf16[8,1024], t1: f32[1,1024], t2: s32[]) -> bf16[8,1024] {
  %t0 = bf16[8,1024]{1,0} parameter(0)
  %t1 = f32[1,1024]{1,0} parameter(1)
  %t2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %wide = f32[8,1024]{1,0} convert(%t0)
  %dus = f32[8,1024]{1,0} dynamic-update-slice(%wide, %t1, %t2, %z)
  ROOT %narrow = bf16[8,1024]{1,0} convert(%dus)
}

%fused_two_dots (r0: bf16[64,128], r1: bf16[128,32]) -> bf16[64,32] {
  %r0 = bf16[64,128]{1,0} parameter(0)
  %r1 = bf16[128,32]{1,0} parameter(1)
  %d1 = bf16[64,32]{1,0} dot(%r0, %r1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %d2 = bf16[64,32]{1,0} add(%d1, %d1)
}

ENTRY %main (a: f32[8,1024], i: s32[], x: bf16[4,64,128], y: bf16[4,128,32]) -> f32[8,1024] {
  %a = f32[8,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = bf16[4,64,128]{2,1,0} parameter(2)
  %y = bf16[4,128,32]{2,1,0} parameter(3)
  %bd = bf16[4,64,32]{2,1,0} dot(%x, %y), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  %x2 = f32[64,128]{1,0} parameter(4)
  %y2 = f32[128,32]{1,0} parameter(5)
  %gemm = (f32[64,32]{1,0}, s8[1024]{0}) custom-call(%x2, %y2), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %sl = f32[1,1024]{1,0} fusion(%a, %i), kind=kLoop, calls=%fused_slice
  %up = f32[8,1024]{1,0} fusion(%a, %sl, %i), kind=kLoop, calls=%fused_update
  %x3 = bf16[64,128]{1,0} parameter(6)
  %td = bf16[64,32]{1,0} fusion(%x3, %y2), kind=kOutput, calls=%fused_two_dots
  %e = f32[8,1024]{1,0} exponential(%a)
  %fs = ((f32[8,1024]{1,0}, f32[1,1024]{1,0}, s32[]), f32[8,1024]{1,0}, u32[]) fusion-start(%a, %sl, %i), kind=kLoop, calls=%fused_update
  %fd = f32[8,1024]{1,0} fusion-done(%fs)
  %b16 = bf16[8,1024]{1,0} parameter(7)
  %rt = bf16[8,1024]{1,0} fusion(%b16, %sl, %i), kind=kLoop, calls=%fused_round_trip
  %hi = f32[64,32]{1,0} dot(%x2, %y2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, operand_precision={highest,highest}
  %lo = f32[64,32]{1,0} dot(%x2, %y2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %out = (f32[8,1024]{1,0}, f32[1,1024]{1,0}) tuple(%up, %sl)
}
"""


@pytest.fixture(scope="module")
def module():
    return parse_module(MODULE)


def _get(module, name, computation="main"):
    return next(i for i in module.computations[computation] if i.name == name)


def test_instructions_with_operands_types_and_attributes(module):
    assert module.entry == "main"
    bd = _get(module, "bd")
    assert (bd.opcode, bd.operands, bd.result_type) == ("dot", ("x", "y"), "bf16[4,64,32]{2,1,0}")
    assert bd.dims("lhs_contracting_dims") == (2,) and bd.dims("lhs_batch_dims") == (0,)
    assert bd.dims("feature_group_count") == ()
    assert _get(module, "up").called("calls") == ("fused_update",)
    assert module.type_of("main", "sl") == "f32[1,1024]{1,0}"
    assert module.type_of("fused_slice", "p1") == "s32[]"
    out = _get(module, "out")
    assert out.root and out.operands == ("up", "sl")
    assert tuple_elements(out.result_type)[1] == "f32[1,1024]{1,0}"


def test_matmul_flops_from_shapes(module):
    # batched: 4 x [64,128] @ [128,32]: 2 * 4*64*32 * 128 flops, M, N, K = 64, 32, 128
    (batched,) = matmuls(module, "main", _get(module, "bd"))
    assert (batched.flops, batched.dtype, batched.dims) == (2 * 4 * 64 * 32 * 128, "bfloat16",
                                                             (64, 32, 128))
    # cuBLAS gemm custom-call: result (f32[64,32], workspace), contracting dim 1 of f32[64,128]
    (gemm,) = matmuls(module, "main", _get(module, "gemm"))
    assert (gemm.flops, gemm.dtype, gemm.dims) == (2 * 64 * 32 * 128, "float32", (64, 32, 128))
    # a fusion's dots, found in its fused computation
    (fused,) = matmuls(module, "main", _get(module, "td"))
    assert fused.flops == 2 * 64 * 32 * 128
    assert matmuls(module, "main", _get(module, "e")) == []


def test_bytes_moved(module):
    # exponential: reads and writes f32[8,1024]
    assert bytes_moved(module, "main", _get(module, "e")) == 2 * 8 * 1024 * 4
    # a fusion that only dynamic-slices its big operand reads the row it slices, and the index
    assert bytes_moved(module, "main", _get(module, "sl")) == 1024 * 4 + 4 + 1024 * 4
    # a fusion whose root updates its operand 0 in place: reads the row and the index, writes
    # the row; the f32[8,1024] buffer is neither read nor written whole
    assert bytes_moved(module, "main", _get(module, "up")) == 1024 * 4 + 4 + 1024 * 4
    # XLA:GPU's async form of the same fusion (its result tuple holds the operands first)
    assert bytes_moved(module, "main", _get(module, "fs")) == 1024 * 4 + 4 + 1024 * 4
    # XLA:CPU carries a bf16 update in f32: the whole buffer converted, updated and converted
    # back, each element exactly; a GPU updates in place (reads the f32 row and the index,
    # writes a bf16 row)
    rt = _get(module, "rt")
    assert bytes_moved(module, "main", rt) == 8 * 1024 * 2 + 1024 * 4 + 4 + 8 * 1024 * 2
    assert bytes_moved(module, "main", rt, round_trips=True) == 1024 * 4 + 4 + 1024 * 2


def test_float32_dots_run_at_the_profiles_default_precision_rate(module):
    # XLA:GPU computes a default-precision float32 dot on TF32 tensor cores; HIGHEST does not
    tf32 = dataclasses.replace(ROUND, peak_flops_per_s={"float32": 1e11, "bfloat16": 1e12,
                                                        "tensorfloat32": 5e11},
                               float32_matmul="tensorfloat32", launch_overhead_s=0.0)
    flops = 2 * 64 * 32 * 128
    (lo,), (hi,) = matmuls(module, "main", _get(module, "lo")), matmuls(module, "main",
                                                                         _get(module, "hi"))
    assert (lo.highest, hi.highest) == (False, True)
    assert kernel_time_s(module, "main", _get(module, "lo"), tf32) == pytest.approx(flops / 5e11)
    assert kernel_time_s(module, "main", _get(module, "hi"), tf32) == pytest.approx(flops / 1e11)
    # a profile without TF32 prices both at the float32 rate
    plain = dataclasses.replace(tf32, float32_matmul="float32")
    assert kernel_time_s(module, "main", _get(module, "lo"), plain) == pytest.approx(flops / 1e11)


def test_kernel_time_is_the_roofline(module):
    # 2*4*64*32*128 = 2,097,152 flops at 1e12/s: 2.1 us, against 106,496 bytes at 1e12 B/s
    bd = _get(module, "bd")
    data_bytes = 2 * (4 * 64 * 128 + 4 * 128 * 32 + 4 * 64 * 32)
    assert bytes_moved(module, "main", bd) == data_bytes
    assert kernel_time_s(module, "main", bd, ROUND) == pytest.approx(2 * 4 * 64 * 32 * 128 / 1e12)
    # a memory-bound kernel: bytes at 1 TB/s
    assert kernel_time_s(module, "main", _get(module, "e"), ROUND) == pytest.approx(
        2 * 8 * 1024 * 4 / 1e12)


def test_kernel_time_has_the_launch_floor_and_dtype_override(module):
    floored = dataclasses.replace(ROUND, launch_overhead_s=1e-3)
    assert kernel_time_s(module, "main", _get(module, "e"), floored) == 1e-3
    # memory-bound kernels at the bandwidth they reach
    slower = dataclasses.replace(ROUND, hbm_efficiency=0.5)
    assert kernel_time_s(module, "main", _get(module, "e"), slower) == pytest.approx(
        2 * 2 * 8 * 1024 * 4 / 1e12)
    slow_f32 = dataclasses.replace(ROUND, peak_flops_per_s={"float32": 1e11, "bfloat16": 1e12})
    bd = _get(module, "bd")
    assert kernel_time_s(module, "main", bd, slow_f32) == pytest.approx(2 * 4 * 64 * 32 * 128 / 1e12)
    assert kernel_time_s(module, "main", bd, slow_f32, dtype="float32") == pytest.approx(
        2 * 4 * 64 * 32 * 128 / 1e11)


@pytest.mark.parametrize("build, flops", [
    # NHWC x HWIO, 2 feature groups: each output element sums 3*3*32 products
    (lambda: jax.jit(lambda x, k: jax.lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2))
     .lower(jax.ShapeDtypeStruct((8, 32, 32, 64), jnp.float32),
            jax.ShapeDtypeStruct((3, 3, 32, 128), jnp.float32)), 2 * 8 * 32 * 32 * 128 * 3 * 3 * 32),
    (lambda: jax.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))
     .lower(jax.ShapeDtypeStruct((4, 64, 32), jnp.float32),
            jax.ShapeDtypeStruct((4, 32, 16), jnp.float32)), 2 * 4 * 64 * 32 * 16),
], ids=["grouped_convolution", "batched_dot"])
def test_matmul_flops_of_compiled_programs(build, flops):
    module = parse_module(build().compile().as_text())
    entry = module.computations[module.entry]
    assert sum(m.flops for i in entry for m in matmuls(module, module.entry, i)) == flops
