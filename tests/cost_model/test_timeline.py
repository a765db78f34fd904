"""autopar.cost_model.timeline: one device's step simulated from compiled HLO text.

XLA:CPU compiles collectives synchronously, so programs compiled here show a sync collective
adding its time to the step; async pairs (as XLA prints them on GPU) are hand-written modules.
The ROUND profile has round numbers: 1 TFLOP/s at 100% efficiency, 1 TB/s of HBM, no launch
floor and no latency, 10 GB/s NVLink within 8 device ids and 1 GB/s InfiniBand beyond.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from autopar.cost_model.hardware import HardwareProfile, LevelKind, LinkLevel
from autopar.cost_model.hlo import CollectiveKind, native_reduce_scatters, parse_collectives
from autopar.cost_model.reference import (
    collective_time_s,
    reference_comm_time_s,
    reference_compute_time_s,
)
from autopar.cost_model.hlo_ir import parse_module
from autopar.cost_model.timeline import FULL_TRIPS, simulate, simulate_compiled, width_kernels
from tests.cost_model.compiled_cases import H100, autopar_case

ROUND = HardwareProfile(
    name="round", peak_flops_per_s={"float32": 1e12, "bfloat16": 1e12},
    hbm_bandwidth_bytes_per_s=1e12, hbm_capacity_bytes=2**40,
    levels=(LinkLevel(LevelKind.NVLINK, 1e10, 0.0, devices_per_group=8),
            LinkLevel(LevelKind.INFINIBAND, 1e9, 0.0, devices_per_group=None)),
    matmul_efficiency=1.0, launch_overhead_s=0.0, matmul_tile=1)
NVLINK, IB = LevelKind.NVLINK, LevelKind.INFINIBAND

# bf16[1024,1024] @ bf16[1024,1024]: 2 * 1024^3 flops at 1e12/s (its 6 MiB of operands and
# result take 6.3 us at 1 TB/s, less)
DOT_S = 2 * 1024**3 / 1e12
# all-reduce of f32[1024,1024] (4 MiB): over 8 devices 2 * 7/8 * 4 MiB at 10 GB/s; over the
# pairs {i, i+8} 2 * 1/2 * 4 MiB at 1 GB/s
AR8_S = 2 * 7 / 8 * 4 * 2**20 / 1e10
AR_PAIRS_S = 4 * 2**20 / 1e9

HEADER = """\
HloModule m, is_scheduled=true, num_partitions=16

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused_dot (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %d = bf16[1024,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
GPU8 = "replica_groups={{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14,15}}"
PAIRS = "replica_groups={{0,8},{1,9},{2,10},{3,11},{4,12},{5,13},{6,14},{7,15}}"
ASYNC = 'backend_config={"collective_backend_config":{"is_sync":false}}'


def _module(*lines: str) -> str:
    body = "\n".join(f"  {line}" for line in lines)
    return (HEADER + "\nENTRY %main (a: bf16[1024,1024], b: bf16[1024,1024], g: f32[1024,1024])"
            " -> f32[1024,1024] {\n  %a = bf16[1024,1024]{1,0} parameter(0)\n"
            "  %b = bf16[1024,1024]{1,0} parameter(1)\n  %g = f32[1024,1024]{1,0} parameter(2)\n"
            f"{body}\n}}\n")


def _all_reduce(name: str, groups: str, operand: str = "%g", start: str = "",
                extra: str = "") -> str:
    opcode = f"all-reduce{start}"
    return (f"%{name} = f32[1024,1024]{{1,0}} {opcode}({operand}), channel_id=1, {groups}, "
            f"to_apply=%add{extra}")


DOT = "%f = bf16[1024,1024]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot"


def test_async_all_reduce_overlaps_the_dot_issued_after_its_start():
    timeline = simulate(_module(
        _all_reduce("ars", GPU8, start="-start", extra=", " + ASYNC),
        DOT,
        "ROOT %ard = f32[1024,1024]{1,0} all-reduce-done(%ars)"), ROUND)
    assert timeline.compute_busy_s == pytest.approx(DOT_S)
    assert timeline.comm_busy_s == {NVLINK: pytest.approx(AR8_S)}
    # the 0.73 ms all-reduce runs under the 2.1 ms dot: nothing exposed
    assert timeline.step_time_s == pytest.approx(max(DOT_S, AR8_S)) == pytest.approx(DOT_S)
    assert timeline.exposed_comm_s == pytest.approx(0.0)


def test_async_all_reduce_longer_than_the_dot_shows_the_rest():
    timeline = simulate(_module(
        _all_reduce("ars", PAIRS, start="-start", extra=", " + ASYNC),
        DOT,
        "ROOT %ard = f32[1024,1024]{1,0} all-reduce-done(%ars)"), ROUND)
    # 4.2 ms over InfiniBand from t=0, the dot 2.1 ms beside it
    assert timeline.comm_busy_s == {IB: pytest.approx(AR_PAIRS_S)}
    assert timeline.step_time_s == pytest.approx(AR_PAIRS_S)
    assert timeline.exposed_comm_s == pytest.approx(AR_PAIRS_S - DOT_S)


@pytest.mark.parametrize("collective", [
    _all_reduce("ar", GPU8),  # synchronous
    _all_reduce("ar", GPU8, start="-start", extra=', backend_config={"collective_backend_config":'
                '{"is_sync":true}}') + "\n  %ard = f32[1024,1024]{1,0} all-reduce-done(%ar)",
])
def test_sync_all_reduce_adds_its_time(collective):
    timeline = simulate(_module(collective, "ROOT " + DOT), ROUND)
    assert timeline.step_time_s == pytest.approx(AR8_S + DOT_S)
    assert timeline.exposed_comm_s == pytest.approx(AR8_S)
    names = [e.name for e in timeline.events]
    assert names == ["ar", "f"]


def test_done_right_after_start_overlaps_nothing():
    timeline = simulate(_module(
        _all_reduce("ars", GPU8, start="-start", extra=", " + ASYNC),
        "%ard = f32[1024,1024]{1,0} all-reduce-done(%ars)",
        "ROOT " + DOT), ROUND)
    assert timeline.step_time_s == pytest.approx(AR8_S + DOT_S)


def test_a_consumer_waits_for_its_operand_from_a_collective():
    # the dot needs the all-gathered operand: it starts when the all-gather is done
    gather = ("%ags = (bf16[128,1024]{1,0}, bf16[1024,1024]{1,0}) all-gather-start(%s), "
              f"channel_id=2, {GPU8}, dimensions={{0}}, {ASYNC}")
    timeline = simulate(_module(
        "%s = bf16[128,1024]{1,0} slice(%a), slice={[0:128], [0:1024]}",
        gather,
        "%agd = bf16[1024,1024]{1,0} all-gather-done(%ags)",
        "ROOT %f = bf16[1024,1024]{1,0} fusion(%agd, %b), kind=kCustom, calls=%fused_dot"),
        ROUND)
    slice_s = 2 * 128 * 1024 * 2 / 1e12  # reads and writes bf16[128,1024]
    gather_s = 7 / 8 * 2 * 2**20 / 1e10  # 7/8 of the gathered 2 MiB
    events = {e.name: e for e in timeline.events}
    assert events["ags"].start_s == pytest.approx(slice_s)
    assert events["f"].start_s == pytest.approx(slice_s + gather_s)
    assert timeline.step_time_s == pytest.approx(slice_s + gather_s + DOT_S)


WRAPPED = """
%wrapped_all_to_all (w: f32[1024,1024]) -> f32[1024,1024] {
  %w = f32[1024,1024]{1,0} parameter(0)
  ROOT %a2a = f32[1024,1024]{1,0} all-to-all(%w), channel_id=9, GROUPS, dimensions={0}
}
""".replace("GROUPS", GPU8)


@pytest.mark.parametrize("sync_on", [None, "start", "wrapped"])
def test_generic_async_start_of_a_wrapped_collective(sync_on):
    # "is_sync":true on the async-start or on the collective it wraps makes the pair sync
    config = ', backend_config={"collective_backend_config":{"is_sync":true}}'
    text = _module(
        f"%aas = ((f32[1024,1024]{{1,0}}), f32[1024,1024]{{1,0}}, s32[]) async-start(%g), "
        f"calls=%wrapped_all_to_all{config if sync_on == 'start' else ''}",
        DOT,
        "ROOT %aad = f32[1024,1024]{1,0} async-done(%aas), calls=%wrapped_all_to_all",
    ).replace("\nENTRY", WRAPPED.replace("dimensions={0}", "dimensions={0}"
                                         + (config if sync_on == "wrapped" else "")) + "\nENTRY")
    a2a_s = 7 / 8 * 4 * 2**20 / 1e10  # 0.37 ms, under the 2.1 ms dot unless sync
    timeline = simulate(text, ROUND)
    assert timeline.comm_busy_s == {NVLINK: pytest.approx(a2a_s)}
    assert timeline.step_time_s == pytest.approx(DOT_S + a2a_s if sync_on else DOT_S)


def test_each_level_has_its_own_stream():
    both = [_all_reduce("nv", GPU8, start="-start", extra=", " + ASYNC),
            _all_reduce("ib", PAIRS, start="-start", extra=", " + ASYNC),
            "%nvd = f32[1024,1024]{1,0} all-reduce-done(%nv)",
            "ROOT %ibd = f32[1024,1024]{1,0} all-reduce-done(%ib)"]
    apart = simulate(_module(*both), ROUND)
    assert apart.step_time_s == pytest.approx(max(AR8_S, AR_PAIRS_S))  # side by side
    same = simulate(_module(*[line.replace(PAIRS, GPU8) for line in both]), ROUND)
    assert same.step_time_s == pytest.approx(2 * AR8_S)  # one after the other on NVLink
    assert same.comm_busy_s == {NVLINK: pytest.approx(2 * AR8_S)}


CARRY = "(s32[], f32[1024,1024]{1,0}, bf16[1024,1024]{1,0})"
LOOP_COMPUTATIONS = f"""
%cond (c: {CARRY}) -> pred[] {{
  %c = {CARRY} parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(10)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

%body (c: {CARRY}) -> {CARRY} {{
  %c = {CARRY} parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %v = f32[1024,1024]{{1,0}} get-tuple-element(%c), index=1
  %w = bf16[1024,1024]{{1,0}} get-tuple-element(%c), index=2
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  {{body}}
  ROOT %t = {CARRY} tuple(%i1, %next, %f)
}}
"""
LOOP_DOT = "%f = bf16[1024,1024]{1,0} fusion(%w, %w), kind=kCustom, calls=%fused_dot"
# scalar bookkeeping in the loop (compare, add) moves a few bytes: 1e-11 s, inside approx


def _loop_module(body: list[str], before: str = "%s0 = f32[1024,1024]{1,0} copy(%g)",
                 after: str = "ROOT %out = f32[1024,1024]{1,0} get-tuple-element(%w), index=1",
                 trips: int = 10) -> str:
    text = _module(
        "%zero = s32[] constant(0)", before,
        f"%init = {CARRY} tuple(%zero, %s0, %a)",
        f'%w = {CARRY} while(%init), condition=%cond, body=%body, '
        f'backend_config={{"known_trip_count":{{"n":"{trips}"}}}}', after)
    computations = LOOP_COMPUTATIONS.replace("{body}", "\n  ".join(body))
    return text.replace("\nENTRY", computations + "\nENTRY")


COPY_S = 2 * 4 * 2**20 / 1e12  # the copy before the loop reads and writes 4 MiB


def test_loop_with_a_sync_all_reduce_adds_it_every_trip():
    timeline = simulate(_loop_module([_all_reduce("next", GPU8, operand="%v"), LOOP_DOT]), ROUND)
    assert timeline.step_time_s == pytest.approx(COPY_S + 10 * (AR8_S + DOT_S))
    assert timeline.comm_busy_s == {NVLINK: pytest.approx(10 * AR8_S)}
    assert timeline.exposed_comm_s == pytest.approx(10 * AR8_S)
    # trips past FULL_TRIPS repeat the last one and list no events
    assert sum(e.name == "f" for e in timeline.events) == FULL_TRIPS < 10
    assert timeline.trip_counts_known


@pytest.mark.parametrize("trips", [3, 10])
def test_loop_with_an_async_all_reduce_hides_it_under_the_dot(trips):
    body = [_all_reduce("ars", GPU8, operand="%v", start="-start", extra=", " + ASYNC),
            LOOP_DOT, "%next = f32[1024,1024]{1,0} all-reduce-done(%ars)"]
    timeline = simulate(_loop_module(body, trips=trips), ROUND)
    assert timeline.step_time_s == pytest.approx(COPY_S + trips * DOT_S)
    assert timeline.comm_busy_s == {NVLINK: pytest.approx(trips * AR8_S)}


def test_collective_started_in_one_trip_and_done_in_the_next():
    # the first all-reduce starts before the loop; each trip waits for the previous one,
    # starts the next and runs its dot: only the first is exposed
    body = ["%prev = f32[1024,1024]{1,0} all-reduce-done(%v)",
            _all_reduce("next", GPU8, operand="%prev", start="-start", extra=", " + ASYNC),
            LOOP_DOT]
    timeline = simulate(_loop_module(
        body, before=_all_reduce("s0", GPU8, start="-start", extra=", " + ASYNC),
        after="%last = f32[1024,1024]{1,0} get-tuple-element(%w), index=1\n"
              "  ROOT %out = f32[1024,1024]{1,0} all-reduce-done(%last)"), ROUND)
    assert timeline.step_time_s == pytest.approx(AR8_S + 10 * DOT_S)
    assert timeline.exposed_comm_s == pytest.approx(AR8_S)
    assert timeline.comm_busy_s == {NVLINK: pytest.approx(11 * AR8_S)}


def test_loop_without_a_known_trip_count_runs_once_and_says_so():
    text = _loop_module([_all_reduce("next", GPU8, operand="%v"), LOOP_DOT])
    text = text.replace(', backend_config={"known_trip_count":{"n":"10"}}', "")
    timeline = simulate(text, ROUND)
    assert timeline.step_time_s == pytest.approx(COPY_S + AR8_S + DOT_S)
    assert not timeline.trip_counts_known


def test_conditional_takes_its_slowest_branch():
    text = _module(
        "%p = pred[] constant(true)",
        "ROOT %r = bf16[1024,1024]{1,0} conditional(%p, %a, %a), true_computation=%slow, "
        "false_computation=%fast").replace("\nENTRY", """
%slow (x: bf16[1024,1024]) -> bf16[1024,1024] {
  %x = bf16[1024,1024]{1,0} parameter(0)
  ROOT %f = bf16[1024,1024]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot
}

%fast (y: bf16[1024,1024]) -> bf16[1024,1024] {
  ROOT %y = bf16[1024,1024]{1,0} parameter(0)
}
\nENTRY""")
    timeline = simulate(text, ROUND)
    assert timeline.step_time_s == pytest.approx(DOT_S)
    assert [e.name for e in timeline.events] == ["f"]


# ----------------------------------------------------------- programs compiled on 8 devices

def _compiled(mesh, body, in_specs, out_specs, *shapes):
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
    return jax.jit(fn).lower(*args).compile()


def _matmul_psum(x, w):
    return lax.psum(jnp.tanh(x @ w), "model")


def test_compiled_matmul_then_psum_adds_the_psum(mesh_2d):
    # x[512,1024] @ w[1024,512] with the contraction split over 'model' (4): a local
    # [512,256] @ [256,512] dot, tanh, then a synchronous all-reduce of f32[512,512]
    compiled = _compiled(mesh_2d, _matmul_psum, (P(None, "model"), P("model", None)), P(),
                         (512, 1024), (1024, 512))
    timeline = simulate_compiled(compiled, ROUND)
    (psum,) = parse_collectives(compiled.as_text(), 8)
    comm_s = collective_time_s(ROUND, psum)
    assert comm_s == pytest.approx(2 * 3 / 4 * 512 * 512 * 4 / 1e10)
    assert timeline.comm_busy_s == {NVLINK: pytest.approx(comm_s)}
    assert timeline.step_time_s == pytest.approx(timeline.compute_busy_s + comm_s)
    assert timeline.exposed_comm_s == pytest.approx(comm_s)
    # the dot alone is 2*512*512*256 flops at 1 TFLOP/s; the kernels take at least that
    assert timeline.compute_busy_s >= 2 * 512 * 512 * 256 / 1e12
    comm = next(e for e in timeline.events if e.level is NVLINK)
    assert comm.start_s == pytest.approx(max(e.end_s for e in timeline.events
                                             if e.level is None and e.end_s <= comm.start_s))


def test_compiled_dot_is_priced_by_its_flops(mesh_1d):
    # one f32 [256,4096] @ [4096,256] dot per device (rows split 8 ways): 2*256*256*4096 flops
    # = 0.54 ms at 1 TFLOP/s, against 8.6 us for its 8.6 MB at 1 TB/s
    fn = jax.jit(lambda x, w: x @ w)
    compiled = fn.lower(jax.ShapeDtypeStruct((256, 4096), jnp.float32),
                        jax.ShapeDtypeStruct((4096, 256), jnp.float32)).compile()
    timeline = simulate_compiled(compiled, ROUND)
    assert timeline.comm_busy_s == {} and timeline.exposed_comm_s == pytest.approx(0.0)
    assert timeline.step_time_s == pytest.approx(2 * 256 * 256 * 4096 / 1e12, rel=0.02)


def test_compiled_scan_runs_its_psum_every_trip(mesh_2d):
    def body(a):
        return lax.scan(lambda c, _: (lax.psum(c, "model") * 0.5, None), a, None, length=6)[0]

    compiled = _compiled(mesh_2d, body, P("model"), P(), (256, 128))
    timeline = simulate_compiled(compiled, ROUND)
    (psum,) = parse_collectives(compiled.as_text(), 8)
    assert psum.trip_count == 6
    assert timeline.comm_busy_s == {NVLINK: pytest.approx(6 * collective_time_s(ROUND, psum))}
    assert timeline.step_time_s == pytest.approx(
        timeline.compute_busy_s + 6 * collective_time_s(ROUND, psum))


def test_collectives_across_nodes_run_on_the_infiniband_stream(sixteen_device_hlo):
    node = simulate(sixteen_device_hlo["psum_node"], H100)
    gpu = simulate(sixteen_device_hlo["psum_gpu"], H100)
    assert set(node.comm_busy_s) == {IB} and set(gpu.comm_busy_s) == {NVLINK}
    (collective,) = parse_collectives(sixteen_device_hlo["psum_node"], 16)
    assert node.comm_busy_s[IB] == pytest.approx(collective_time_s(H100, collective))


@pytest.mark.parametrize("model", ["gpt", "moe"])
def test_realistic_plans_compiled_on_cpu_expose_all_their_communication(model):
    # XLA:CPU runs every collective synchronously: the timeline's communication is the
    # reference's, all of it exposed, and the step is compute plus communication
    case = autopar_case(model, "2d")
    timeline = simulate(case.hlo_text, H100, jnp.bfloat16)
    comm_s = reference_comm_time_s(case.truth, H100)
    assert comm_s > 0
    assert sum(timeline.comm_busy_s.values()) == pytest.approx(comm_s)
    assert timeline.exposed_comm_s == pytest.approx(comm_s)
    assert timeline.step_time_s == pytest.approx(timeline.compute_busy_s + comm_s)
    # every kernel takes at least its matmul flops at peak: the compute is no less than the
    # reference's flops-only compute time
    assert timeline.compute_busy_s >= reference_compute_time_s(case.truth, H100, jnp.bfloat16)
    assert timeline.trip_counts_known


def test_a_widened_collective_at_the_programs_dtype(mesh_2d):
    """A bf16 psum that XLA:CPU carries in float32 moves half the bytes read at the program's
    dtype: its stream is busy for the all-reduce of the bf16 values."""
    fn = jax.shard_map(lambda a: lax.psum(a, "model"), mesh=mesh_2d, in_specs=P("model"),
                       out_specs=P(), check_vma=False)
    text = jax.jit(fn).lower(jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)).compile(
        ).as_text()
    (widened,) = parse_collectives(text, 8)
    as_compiled = simulate(text, ROUND).comm_busy_s[NVLINK]
    at_bf16 = simulate(text, ROUND, program_dtypes=True).comm_busy_s[NVLINK]
    assert as_compiled == pytest.approx(collective_time_s(ROUND, widened))
    assert at_bf16 == pytest.approx(collective_time_s(ROUND, widened.at_program_dtype()))
    assert at_bf16 == pytest.approx(as_compiled / widened.widened)   # no latency in ROUND


@pytest.mark.parametrize("collective", ["psum", "all_gather"])
def test_the_converts_around_a_widened_collective_are_not_run_at_the_programs_dtype(
        mesh_2d, collective):
    """XLA:CPU converts a bf16 collective's operand up to float32 and its result back down;
    read at the program's dtype, those kernels are gone and the rest remain."""
    def body(a):
        moved = (lax.psum(a, "model") if collective == "psum"
                 else lax.all_gather(a, "model", tiled=True))
        return jnp.tanh(moved)
    fn = jax.shard_map(body, mesh=mesh_2d, in_specs=P("model"),
                       out_specs=P() if collective == "psum" else P(), check_vma=False)
    text = jax.jit(fn).lower(jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)).compile(
        ).as_text()
    module = parse_module(text)
    widths = width_kernels(module, parse_collectives(text, 8))
    assert widths, "XLA:CPU put no convert around the collective"
    opcodes = {i.name: i.opcode for c, ins in module.computations.items() for i in ins}
    kernels = {e.name for e in simulate(text, ROUND).events if e.level is None}
    native = {e.name for e in simulate(text, ROUND, program_dtypes=True).events
              if e.level is None}
    assert {name for _, name in widths} <= kernels
    assert native == kernels - {name for _, name in widths}
    assert native, "the tanh still runs"
    assert all(opcodes[name] in ("convert", "fusion") for _, name in widths)


def _gspmd_reduction(mesh, out_spec):
    """The compiled text of a contraction over rows split on every device of ``mesh``, its
    result laid out as ``out_spec``: GSPMD reduces its partial sums over the mesh."""
    from jax.sharding import NamedSharding
    rows = NamedSharding(mesh, P(tuple(mesh.axis_names), None))
    fn = jax.jit(lambda x, w: x.T @ (x @ w), out_shardings=NamedSharding(mesh, out_spec))
    return fn.lower(jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=rows),
                    jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)).compile().as_text()


@pytest.mark.parametrize("scheduled", [False, True])
def test_an_all_reduce_each_device_slices_is_read_as_a_reduce_scatter(mesh_2d, scheduled):
    """XLA:CPU reduce-scatters by all-reducing and slicing each device's part out by its
    partition id; read as a GPU or TPU compiles it, that is one reduce-scatter of the
    program's dtype, and the step's communication is that reduce-scatter's."""
    text = _gspmd_reduction(mesh_2d, P(("data", "model"), None))
    collectives = parse_collectives(text, 8)
    assert [c.kind for c in collectives] == [CollectiveKind.ALL_REDUCE]
    (native,) = native_reduce_scatters(parse_module(text), collectives)
    assert native.kind is CollectiveKind.REDUCE_SCATTER
    assert native.out_bytes * 8 == native.in_bytes == collectives[0].out_bytes
    as_compiled = simulate(text, ROUND, scheduled=scheduled).comm_busy_s[NVLINK]
    read = simulate(text, ROUND, scheduled=scheduled, program_dtypes=True).comm_busy_s[NVLINK]
    assert as_compiled == pytest.approx(collective_time_s(ROUND, collectives[0]))
    assert read == pytest.approx(collective_time_s(ROUND, native.at_program_dtype()))
    assert read == pytest.approx(as_compiled / 4)  # half the wire bytes, at half the width


def test_an_all_reduce_read_whole_stays_one(mesh_2d):
    """A psum every device reads whole, and GSPMD's reduction to a replicated result, are
    no reduce-scatter."""
    fn = jax.shard_map(lambda a: jnp.tanh(lax.psum(a, "model")), mesh=mesh_2d,
                       in_specs=P("model"), out_specs=P(), check_vma=False)
    whole = jax.jit(fn).lower(jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)).compile(
        ).as_text()
    for text in (whole, _gspmd_reduction(mesh_2d, P())):
        collectives = parse_collectives(text, 8)
        reductions = [c for c in collectives if c.kind is CollectiveKind.ALL_REDUCE]
        assert reductions
        assert native_reduce_scatters(parse_module(text), collectives) == collectives
