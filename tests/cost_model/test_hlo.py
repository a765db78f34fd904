"""autopar.cost_model.hlo against real compiled programs on 8 CPU devices and literal HLO snippets.

Every expected number is worked out by hand from the shapes; the comments show the sums.
"""

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autopar.cost_model.hlo import (CollectiveKind, HloSummary, analyze, loop_matmul_flops,
                                    parse_collectives, shape_bytes)
from autopar.cost_model.hlo_ir import parse_module

AR, AG, RS, A2A, CP = (
    CollectiveKind.ALL_REDUCE,
    CollectiveKind.ALL_GATHER,
    CollectiveKind.REDUCE_SCATTER,
    CollectiveKind.ALL_TO_ALL,
    CollectiveKind.COLLECTIVE_PERMUTE,
)
GLOBAL = (256, 128)  # global f32 array fed to every shard_map program below
SHARD_4 = 64 * 128 * 4  # bytes of its f32[64,128] block when split 4 ways over 'model'
SHARD_2 = 128 * 128 * 4  # bytes of its f32[128,128] block when split 2 ways over 'data'
SHARD_8 = 32 * 128 * 4  # bytes of its f32[32,128] block when split over all 8 devices
FULL = 256 * 128 * 4


def _shard_map(mesh, body, in_spec, out_spec, *shapes):
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False)
    shapes = shapes or [(GLOBAL, jnp.float32)]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    return jax.jit(fn).lower(*args).compile()


def _jit(mesh, fn, in_spec, out_spec, shape=GLOBAL):
    jitted = jax.jit(fn, in_shardings=NamedSharding(mesh, in_spec),
                     out_shardings=NamedSharding(mesh, out_spec))
    return jitted.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile()


def _scan_psum(a):
    def body(carry, _):
        return lax.psum(carry, "model") * 0.5, None

    return lax.scan(body, a, None, length=5)[0]


def _nested_scan_psum(a):
    def inner(carry, _):
        return lax.psum(carry, "model") * 0.5, None

    def outer(carry, _):
        return lax.scan(inner, carry, None, length=3)[0], None

    return lax.scan(outer, a, None, length=2)[0]


def _dynamic_loop_psum(a):
    steps = a[0, 0].astype(jnp.int32)
    return lax.fori_loop(0, steps, lambda i, c: lax.psum(c, "model") * 0.5, a)


def _cond_psum(a):
    return lax.cond(a[0, 0] > 0, lambda c: lax.psum(c, "model"), lambda c: c * 2, a)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable  # mesh_2d (data=2, model=4) -> jax.stages.Compiled
    kind: CollectiveKind
    group_size: int
    in_bytes: int
    out_bytes: int
    wire_bytes: float
    trip_count: int = 1
    trip_count_known: bool = True


RING = [(i, (i + 1) % 4) for i in range(4)]

CASES = [
    Case("psum_model", lambda m: _shard_map(m, lambda a: lax.psum(a, "model"), P("model"), P()),
         AR, 4, SHARD_4, SHARD_4, 2 * 3 / 4 * SHARD_4),
    # replica_groups={{0,4},{1,5},{2,6},{3,7}}
    Case("psum_data", lambda m: _shard_map(m, lambda a: lax.psum(a, "data"), P("data"), P()),
         AR, 2, SHARD_2, SHARD_2, 2 * 1 / 2 * SHARD_2),
    Case("psum_all",
         lambda m: _shard_map(m, lambda a: lax.psum(a, ("data", "model")),
                              P(("data", "model")), P()),
         AR, 8, SHARD_8, SHARD_8, 2 * 7 / 8 * SHARD_8),
    Case("all_gather",
         lambda m: _shard_map(m, lambda a: lax.all_gather(a, "model", tiled=True), P("model"), P()),
         AG, 4, SHARD_4, FULL, 3 / 4 * FULL),
    Case("psum_scatter",
         lambda m: _shard_map(m, lambda a: lax.psum_scatter(a, "model", tiled=True),
                              P(), P("model")),
         RS, 4, FULL, SHARD_4, 3 / 4 * FULL),
    # XLA splits the operand into 4 slices: (f32[16,128] x4) all-to-all(...), same bytes in total.
    Case("all_to_all",
         lambda m: _shard_map(m, lambda a: lax.all_to_all(a, "model", 0, 1, tiled=True),
                              P("model"), P("model")),
         A2A, 4, SHARD_4, SHARD_4, 3 / 4 * SHARD_4),
    # Two rings of 4 (one per 'data' row): all 8 devices appear in source_target_pairs.
    Case("ppermute",
         lambda m: _shard_map(m, lambda a: lax.ppermute(a, "model", RING), P("model"), P("model")),
         CP, 8, SHARD_4, SHARD_4, SHARD_4),
    Case("scan_5", lambda m: _shard_map(m, _scan_psum, P("model"), P()),
         AR, 4, SHARD_4, SHARD_4, 5 * 2 * 3 / 4 * SHARD_4, trip_count=5),
    Case("nested_scan_2x3", lambda m: _shard_map(m, _nested_scan_psum, P("model"), P()),
         AR, 4, SHARD_4, SHARD_4, 6 * 2 * 3 / 4 * SHARD_4, trip_count=6),
    # The loop bound is data-dependent: no known_trip_count, so 1 and marked unknown.
    Case("fori_dynamic", lambda m: _shard_map(m, _dynamic_loop_psum, P("model"), P()),
         AR, 4, SHARD_4, SHARD_4, 2 * 3 / 4 * SHARD_4, trip_count_known=False),
    # The psum sits in a branch_computations computation of a conditional.
    Case("cond_branch", lambda m: _shard_map(m, _cond_psum, P("model"), P()),
         AR, 4, SHARD_4, SHARD_4, 2 * 3 / 4 * SHARD_4),
    # Plain jit below: XLA prints these groups as replica_groups=mesh[...] {'axis_k'}.
    Case("jit_replicate", lambda m: _jit(m, lambda a: a * 2, P("model", None), P()),
         AG, 4, SHARD_4, FULL, 3 / 4 * FULL),
    # Row-sharded -> column-sharded over 'model' is an all-to-all of the local block.
    Case("jit_transpose_sharding",
         lambda m: _jit(m, lambda a: a * 2, P("model", None), P(None, "model")),
         A2A, 4, SHARD_4, SHARD_4, 3 / 4 * SHARD_4),
    # Summing away the sharded dim into a sharded output: XLA on CPU keeps an all-reduce of
    # the whole f32[128] partial sum followed by a dynamic-slice; it does NOT rewrite it
    # into a reduce-scatter (it does on GPU/TPU), so that is what the ground truth reports.
    Case("jit_sum_to_sharded",
         lambda m: _jit(m, lambda a: a.sum(1), P(None, "model"), P("model")),
         AR, 4, 256 * 4, 256 * 4, 2 * 3 / 4 * 256 * 4),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_single_collective_programs(case, mesh_2d):
    summary = analyze(case.build(mesh_2d))
    assert len(summary.collectives) == 1, [c.text for c in summary.collectives]
    (collective,) = summary.collectives
    assert (collective.kind, collective.group_size) == (case.kind, case.group_size)
    assert (collective.in_bytes, collective.out_bytes) == (case.in_bytes, case.out_bytes)
    assert collective.trip_count == case.trip_count
    assert collective.trip_count_known is case.trip_count_known
    assert collective.wire_bytes == pytest.approx(case.wire_bytes)
    assert summary.wire_bytes == pytest.approx(case.wire_bytes)
    assert summary.by_kind() == {case.kind: (case.trip_count, pytest.approx(case.wire_bytes))}


def test_combined_psum_is_one_tuple_all_reduce(mesh_2d):
    # psum of an f32 and a bf16 array becomes ONE all-reduce with a tuple result. XLA on CPU
    # upcasts the bf16 operand to f32 first, so the tuple is (f32[64,128], f32[64,128]).
    compiled = _shard_map(
        mesh_2d, lambda a, b: (lax.psum(a, "model"), lax.psum(b, "model")),
        (P("model"), P("model")), (P(), P()), (GLOBAL, jnp.float32), (GLOBAL, jnp.bfloat16),
    )
    (collective,) = analyze(compiled).collectives
    assert collective.kind is AR
    assert collective.text.split("=")[1].strip().startswith("(f32[64,128]{1,0}, f32[64,128]{1,0})")
    assert collective.out_bytes == 2 * SHARD_4
    assert collective.wire_bytes == 2 * 3 / 4 * 2 * SHARD_4


def test_matmul_with_sharded_contraction_needs_all_reduce(mesh_2d):
    # a[64,256] @ b[256,128], K=256 split over 'model' (4); the output is replicated, so the
    # partial products f32[64,128] are all-reduced over groups of 4.
    jitted = jax.jit(
        lambda a, b: a @ b,
        in_shardings=(NamedSharding(mesh_2d, P(None, "model")),
                      NamedSharding(mesh_2d, P("model", None))),
        out_shardings=NamedSharding(mesh_2d, P()),
    )
    compiled = jitted.lower(jax.ShapeDtypeStruct((64, 256), jnp.float32),
                            jax.ShapeDtypeStruct((256, 128), jnp.float32)).compile()
    summary = analyze(compiled)
    (collective,) = summary.collectives
    assert (collective.kind, collective.group_size, collective.out_bytes) == (AR, 4, 64 * 128 * 4)
    # Each device multiplies [64,64] @ [64,128]: 2*M*N*K / 4 devices sharing the K work.
    # cost_analysis also counts the all-reduce's 64*128 additions (+0.8%).
    assert summary.flops == pytest.approx(2 * 64 * 128 * 256 / 4, rel=0.01)


def test_flops_and_memory_of_a_row_sharded_matmul(mesh_1d):
    # a[256,128] split 8 ways by rows @ replicated b[128,64]: no communication at all.
    jitted = jax.jit(
        lambda a, b: a @ b,
        in_shardings=(NamedSharding(mesh_1d, P("data")), NamedSharding(mesh_1d, P())),
        out_shardings=NamedSharding(mesh_1d, P("data")),
    )
    compiled = jitted.lower(jax.ShapeDtypeStruct((256, 128), jnp.float32),
                            jax.ShapeDtypeStruct((128, 64), jnp.float32)).compile()
    summary = analyze(compiled)
    assert summary.collectives == ()
    assert summary.wire_bytes == 0
    assert summary.flops == pytest.approx(2 * 256 * 128 * 64 / 8, rel=0.01)
    assert summary.bytes_accessed > 0
    assert summary.argument_bytes == 32 * 128 * 4 + 128 * 64 * 4
    assert summary.output_bytes == 32 * 64 * 4
    assert summary.peak_memory_bytes >= summary.argument_bytes > 0


def test_by_kind_adds_counts_and_wire_bytes(mesh_2d):
    def body(a):
        def step(carry, _):
            return lax.psum(carry, "model") * 0.5, None

        looped = lax.scan(step, a, None, length=3)[0]
        return lax.all_gather(looped, "model", tiled=True)

    summary = analyze(_shard_map(mesh_2d, body, P("model"), P()))
    assert summary.by_kind() == {
        AR: (3, pytest.approx(3 * 2 * 3 / 4 * SHARD_4)),
        AG: (1, pytest.approx(3 / 4 * FULL)),
    }
    assert summary.wire_bytes == pytest.approx(3 * 2 * 3 / 4 * SHARD_4 + 3 / 4 * FULL)


# ----------------------------------------------------------------- literal HLO snippets

def _one(line: str, num_devices: int = 8):
    (collective,) = parse_collectives(f"ENTRY %main () -> f32[] {{\n  {line}\n}}\n", num_devices)
    return collective


@pytest.mark.parametrize("groups, size", [
    ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", 2),
    ("replica_groups={{0,1,2,3,4,5,6,7}}", 8),
    ("replica_groups=[2,4]<=[4,2]T(1,0)", 4),
    ("replica_groups=[4,2]<=[8]", 2),
    ("replica_groups=mesh['a'=2,'b'=4] {'a'}", 2),
    # as printed by this jax version for a plain jit on the (2, 4) mesh
    ("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0))"
     " {'axis_1'}", 4),
    ("replica_groups=mesh['a'=2,'b'=4] {'a','b'}", 8),
    ("replica_groups=mesh['a'=2,'b'=4] {'b':(1)2}", 2),
    ("replica_groups=mesh[a=2,b=4] {b}", 4),
    ("replica_groups=mesh['a'=2,'b'=4] {}", 1),
    ("replica_groups={}", 6),  # every device: the num_devices argument
    ("channel_id=3", 6),  # no replica_groups at all: every device too
])
def test_replica_group_forms(groups, size):
    collective = _one(f"%ar = f32[64]{{0}} all-reduce(%p), {groups}, to_apply=%add", num_devices=6)
    assert collective.group_size == size
    assert collective.wire_bytes == pytest.approx(2 * (size - 1) / size * 256)


@pytest.mark.parametrize("type_str, nbytes", [
    ("f32[8,128]{1,0}", 8 * 128 * 4),
    ("f32[]", 4),
    ("bf16[3,5]", 30),
    ("f16[2]", 4),
    ("f64[2]", 16),
    ("s32[7]", 28),
    ("u32[]", 4),
    ("s8[10]", 10),
    ("u8[10]", 10),
    ("pred[10]", 10),
    ("s64[3]", 24),
    ("u64[3]", 24),
    ("f8e4m3fn[16]", 16),
    ("f8e5m2[16]", 16),
    ("c64[2]", 16),
    ("f4e2m1fn[8]", 4),
    ("f32[<=8,2]", 64),  # dynamic dimension: its bound
    ("f32[4,4]{1,0:T(2,2)}", 64),  # tiled layout
    ("(f32[8]{0}, bf16[8]{0}, s8[])", 32 + 16 + 1),
    ("((f32[4]), f32[2], u32[])", 16 + 8 + 4),
])
def test_shape_bytes(type_str, nbytes):
    assert shape_bytes(type_str) == nbytes


def test_unknown_element_type_is_an_error():
    with pytest.raises(ValueError, match="q7"):
        shape_bytes("q7[4]")


# Async and combined forms as XLA prints them on GPU/TPU (CPU compiles collectives synchronously).
ASYNC_MODULE = """\
HloModule m, is_scheduled=true, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%wrapped_all_to_all (p: f32[8,16]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  ROOT %a2a = f32[8,16]{1,0} all-to-all(%p), channel_id=9, replica_groups={{0,1,2,3}}, dimensions={0}
}

ENTRY %main (p0: f32[64,128], p1: f32[16,8]) -> f32[] {
  %p0 = f32[64,128]{1,0} parameter(0)
  %p1 = f32[16,8]{1,0} parameter(1)
  %ars = (f32[64,128]{1,0}, bf16[32]{0}) all-reduce-start(%p0, %c), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %ard = (f32[64,128]{1,0}, bf16[32]{0}) all-reduce-done(%ars)
  %ags = (f32[16,8]{1,0}, f32[64,8]{1,0}) all-gather-start(%p1), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
  %agd = f32[64,8]{1,0} all-gather-done(%ags)
  %ags2 = ((f32[16,8]{1,0}, f32[4]{0}), (f32[64,8]{1,0}, f32[16]{0})) all-gather-start(%p1, %q), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
  %agd2 = (f32[64,8]{1,0}, f32[16]{0}) all-gather-done(%ags2)
  %rss = ((f32[64,128]{1,0}), f32[16,128]{1,0}) reduce-scatter-start(%p0), channel_id=4, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %rsd = f32[16,128]{1,0} reduce-scatter-done(%rss)
  %cps = (f32[16,8]{1,0}, f32[16,8]{1,0}, u32[], u32[]) collective-permute-start(%p1), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[16,8]{1,0} collective-permute-done(%cps)
  %aas = ((f32[8,16]{1,0}), f32[8,16]{1,0}, s32[]) async-start(%p2), calls=%wrapped_all_to_all
  %aau = ((f32[8,16]{1,0}), f32[8,16]{1,0}, s32[]) async-update(%aas), calls=%wrapped_all_to_all
  %aad = f32[8,16]{1,0} async-done(%aau), calls=%wrapped_all_to_all
  ROOT %r = f32[] constant(0)
}
"""


def test_async_and_combined_forms_count_once_with_output_shapes():
    got = [(c.kind, c.in_bytes, c.out_bytes, c.group_size, c.trip_count, c.computation)
           for c in parse_collectives(ASYNC_MODULE, num_devices=4)]
    assert got == [
        # the all-to-all wrapped by async-start/-update/-done: counted once, where it is printed
        (A2A, 512, 512, 4, 1, "wrapped_all_to_all"),
        # all-reduce-start returns its outputs: f32[64,128] + bf16[32]
        (AR, 32768 + 64, 32768 + 64, 4, 1, "main"),
        # all-gather-start returns (input, output)
        (AG, 512, 2048, 4, 1, "main"),
        # combined all-gather-start returns ((inputs), (outputs))
        (AG, (2048 + 64) // 4, 2048 + 64, 4, 1, "main"),
        # reduce-scatter-start returns ((input), output)
        (RS, 4 * 8192, 8192, 4, 1, "main"),
        # collective-permute-start returns (input, output, u32[], u32[])
        (CP, 512, 512, 2, 1, "main"),
    ]


def test_ragged_all_to_all_is_priced_as_all_to_all_of_its_output_buffer():
    collective = _one("%r = bf16[64,32]{1,0} ragged-all-to-all(%in, %out, %io, %ss, %oo, %rs),"
                      " channel_id=1, replica_groups={{0,1,2,3}}")
    assert (collective.kind, collective.in_bytes, collective.group_size) == (A2A, 64 * 32 * 2, 4)
    assert collective.wire_bytes == 3 / 4 * 64 * 32 * 2


def test_hlo_module_header_sets_devices_for_empty_groups():
    line = "%ar = f32[64]{0} all-reduce(%p), replica_groups={}, to_apply=%add"
    text = f"HloModule m, num_partitions=4\n\nENTRY %main () -> f32[] {{\n  {line}\n}}\n"
    assert parse_collectives(text, num_devices=4)[0].group_size == 4

    class _Compiled:  # only what analyze reads; cost_analysis as older jax returned it
        def as_text(self):
            return text

        def cost_analysis(self):
            return [{"flops": 12.0, "bytes accessed": 34.0}]

        def memory_analysis(self):
            return None

    summary = analyze(_Compiled())
    assert isinstance(summary, HloSummary)
    assert summary.collectives[0].group_size == 4
    assert (summary.flops, summary.bytes_accessed, summary.peak_memory_bytes) == (12.0, 34.0, 0)


def test_analyze_tolerates_missing_cost_analysis():
    class _Compiled:
        def as_text(self):
            return "HloModule m\n\nENTRY %main () -> f32[] {\n  ROOT %c = f32[] constant(0)\n}\n"

        def cost_analysis(self):
            return None

        def memory_analysis(self):
            return None

    summary = analyze(_Compiled())
    assert (summary.collectives, summary.flops, summary.bytes_accessed) == ((), 0.0, 0.0)


LOOP_MODULE = """\
HloModule loops, num_partitions=8

%cond_inner (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%p), index=1
  %ar_cond = f32[8]{0} all-reduce(%v), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %lt = pred[] constant(true)
}

%body_inner (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%p), index=1
  %ar_body = f32[8]{0} all-reduce(%v), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar_body)
}

%shared (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %cp = f32[8]{0} collective-permute(%x), channel_id=3, source_target_pairs={{0,1},{1,0}}
}

%body_outer (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %w = (s32[], f32[8]{0}) while(%p), condition=%cond_inner, body=%body_inner, backend_config={"known_trip_count":{"n":"3"}}
  %c = f32[8]{0} call(%v), to_apply=%shared
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %c)
}

%cond_outer (p: (s32[], f32[8])) -> pred[] {
  ROOT %lt = pred[] constant(true)
}

%body_unknown (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %c = f32[8]{0} call(%v), to_apply=%shared
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %c)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w1 = (s32[], f32[8]{0}) while(%t0), condition=%cond_outer, body=%body_outer, backend_config={"known_trip_count":{"n":"4"}}
  %w2 = (s32[], f32[8]{0}) while(%t0), condition=%cond_outer, body=%body_unknown
  ROOT %r = f32[8]{0} call(%a), to_apply=%shared
}
"""


def test_trip_counts_multiply_through_nested_loops_and_add_over_callers():
    got = {c.text.removeprefix("ROOT ").split()[0]: (c.trip_count, c.trip_count_known)
           for c in parse_collectives(LOOP_MODULE, num_devices=8)}
    assert got == {
        # a while condition runs once more than its body: 4 outer trips x (3 + 1)
        "%ar_cond": (16, True),
        "%ar_body": (12, True),  # 4 x 3
        # %shared is called from the 4-trip outer body, the unknown loop (1, unknown) and
        # the entry (1): 4 + 1 + 1, and unknown because one path is.
        "%cp": (6, False),
    }


MATMUL_LOOP_MODULE = """\
HloModule matmul_loop

%fused_dot (a: f32[16,32], b: f32[32,8]) -> f32[16,8] {
  %a = f32[16,32]{1,0} parameter(0)
  %b = f32[32,8]{1,0} parameter(1)
  ROOT %d = f32[16,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (f32[16,32], f32[32,8])) -> (f32[16,32], f32[32,8]) {
  %p = (f32[16,32]{1,0}, f32[32,8]{1,0}) parameter(0)
  %x = f32[16,32]{1,0} get-tuple-element(%p), index=0
  %w = f32[32,8]{1,0} get-tuple-element(%p), index=1
  %f = f32[16,8]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  ROOT %t = (f32[16,32]{1,0}, f32[32,8]{1,0}) tuple(%x, %w)
}

%cond (p: (f32[16,32], f32[32,8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[16,32], w: f32[32,8]) -> f32[16,8] {
  %x = f32[16,32]{1,0} parameter(0)
  %w = f32[32,8]{1,0} parameter(1)
  %t = (f32[16,32]{1,0}, f32[32,8]{1,0}) tuple(%x, %w)
  %l = (f32[16,32]{1,0}, f32[32,8]{1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %d = f32[16,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_loop_matmul_flops_are_the_trips_after_the_first():
    """XLA's cost analysis counts the loop's fused dot once; its other 3 trips are added (the
    entry's dot runs once and adds nothing)."""
    one_dot = 2 * 16 * 8 * 32
    assert loop_matmul_flops(parse_module(MATMUL_LOOP_MODULE)) == 3 * one_dot
    summary = HloSummary(collectives=(), flops=2 * one_dot, bytes_accessed=0.0,
                         peak_memory_bytes=0, argument_bytes=0, output_bytes=0, temp_bytes=0,
                         alias_bytes=0, loop_matmul_flops=3 * one_dot)
    assert summary.flops_all_trips == 5 * one_dot


COND_LOOP_MODULE = """\
HloModule cond_loop

%small (a: f32[16,32]) -> f32[16,16] {
  %a = f32[16,32]{1,0} parameter(0)
  ROOT %d = f32[16,16]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%large (a: f32[16,32]) -> f32[16,16] {
  %a = f32[16,32]{1,0} parameter(0)
  %d = f32[16,16]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %e = f32[16,16]{1,0} dot(%d, %d), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], f32[16,32])) -> (s32[], f32[16,32]) {
  %p = (s32[], f32[16,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[16,32]{1,0} get-tuple-element(%p), index=1
  %c = f32[16,16]{1,0} conditional(%i, %x, %x), branch_computations={%small, %large}
  ROOT %t = (s32[], f32[16,32]{1,0}) tuple(%i, %x)
}

%cond (p: (s32[], f32[16,32])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[16,32]) -> (s32[], f32[16,32]) {
  %x = f32[16,32]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[16,32]{1,0}) tuple(%z, %x)
  ROOT %l = (s32[], f32[16,32]{1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_a_conditional_in_a_loop_runs_one_branch_per_trip():
    """Each trip runs one branch: the costlier one's matmuls count per trip, not both's."""
    small, large = 2 * 16 * 16 * 32, 2 * 16 * 16 * 32 + 2 * 16 * 16 * 16
    assert loop_matmul_flops(parse_module(COND_LOOP_MODULE)) == 3 * max(small, large)


@pytest.mark.parametrize("kind, body, out_spec, out_rows", [
    (AR, lambda a: lax.psum(a, "model"), P(), 64),
    (AG, lambda a: lax.all_gather(a, "model", tiled=True), P(), 256),
    (CP, lambda a: lax.ppermute(a, "model", [(i, (i + 1) % 4) for i in range(4)]),
     P("model"), 64),
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_collective_priced_at_the_programs_dtype(kind, body, out_spec, out_rows, dtype,
                                                   mesh_2d):
    """XLA:CPU may carry a bf16 collective in float32 (converts around it); at the program's
    dtype the collective moves what a GPU would: 2 bytes an element for bf16, 4 for f32."""
    compiled = _shard_map(mesh_2d, body, P("model"), out_spec, (GLOBAL, dtype))
    (c,) = [c for c in analyze(compiled).collectives if c.kind is kind]
    itemsize = jnp.dtype(dtype).itemsize
    assert c.at_program_dtype().out_bytes == out_rows * 128 * itemsize
    assert c.out_bytes == c.widened * out_rows * 128 * itemsize
    assert c.widened == 1 or dtype == jnp.bfloat16
