"""autopar.cost_model.reference: each collective of a compiled program is priced on the link
level its device groups cross. On the h100 profile (NVLink within blocks of 8 device ids,
InfiniBand beyond), a 16-device mesh node=2 x gpu=8 has its 'node' groups {i, i+8} across
nodes and its 'gpu' groups inside one."""

import dataclasses

import jax.numpy as jnp
import pytest

from autopar.cost_model.hardware import LevelKind, get_profile
from autopar.cost_model.hlo import CollectiveKind, HloSummary, parse_collectives
from autopar.cost_model.reference import (
    collective_level,
    reference_comm_time_s,
    reference_step_time_s,
)

H100 = get_profile("h100")
NVLINK, IB = H100.level(LevelKind.NVLINK), H100.level(LevelKind.INFINIBAND)


def _summary(collectives, flops: float = 0.0) -> HloSummary:
    return HloSummary(collectives=tuple(collectives), flops=flops, bytes_accessed=0.0,
                      peak_memory_bytes=0, argument_bytes=0, output_bytes=0, temp_bytes=0,
                      alias_bytes=0)


@pytest.mark.parametrize("name, level", [
    ("psum_node", IB), ("psum_gpu", NVLINK),
    ("ppermute_node", IB), ("ppermute_gpu", NVLINK),
    ("gather_node", IB), ("gather_gpu", NVLINK),
])
def test_level_of_a_collective_is_the_one_its_groups_cross(name, level, sixteen_device_hlo):
    (collective,) = parse_collectives(sixteen_device_hlo[name], 16)
    assert collective_level(H100, collective) == level


def test_all_reduce_over_node_moves_its_bytes_at_infiniband_bandwidth(sixteen_device_hlo):
    (node,) = parse_collectives(sixteen_device_hlo["psum_node"], 16)
    (gpu,) = parse_collectives(sixteen_device_hlo["psum_gpu"], 16)
    # psum over node: f32[128,128] (65536 bytes) over groups of 2: 2 ring steps, 65536 wire bytes
    assert (node.group_size, node.wire_bytes) == (2, 65536)
    assert reference_comm_time_s(_summary([node]), H100) == pytest.approx(
        2 * IB.latency_s + 65536 / IB.bandwidth_bytes_per_s)
    # psum over gpu: f32[32,128] (16384 bytes) over groups of 8: 14 steps, 2*7/8*16384 bytes
    assert reference_comm_time_s(_summary([gpu]), H100) == pytest.approx(
        14 * NVLINK.latency_s + 2 * 7 / 8 * 16384 / NVLINK.bandwidth_bytes_per_s)
    # the group-size rule alone would have put the 2-device groups on NVLink
    assert collective_level(H100, dataclasses.replace(node, groups=None)) == NVLINK


def test_ppermute_over_node_moves_its_bytes_at_infiniband_bandwidth(sixteen_device_hlo):
    (permute,) = parse_collectives(sixteen_device_hlo["ppermute_node"], 16)
    # each device sends its f32[128,128] block once: one step
    assert reference_comm_time_s(_summary([permute]), H100) == pytest.approx(
        IB.latency_s + 65536 / IB.bandwidth_bytes_per_s)


def test_step_time_adds_compute_and_each_collective_on_its_level(sixteen_device_hlo):
    (node,) = parse_collectives(sixteen_device_hlo["psum_node"], 16)
    (gpu,) = parse_collectives(sixteen_device_hlo["psum_gpu"], 16)
    flops = 1e12
    want = (flops / (H100.peak_flops(jnp.bfloat16) * H100.matmul_efficiency)
            + 2 * IB.latency_s + 65536 / IB.bandwidth_bytes_per_s
            + 14 * NVLINK.latency_s + 2 * 7 / 8 * 16384 / NVLINK.bandwidth_bytes_per_s)
    assert reference_step_time_s(_summary([node, gpu], flops), H100, jnp.bfloat16) == (
        pytest.approx(want))


def _all_reduce(groups, size=None):
    line = "%ar = f32[64]{0} all-reduce(%p), replica_groups={}, to_apply=%add"
    (collective,) = parse_collectives(f"ENTRY %main () -> f32[] {{\n  {line}\n}}\n", 16)
    return dataclasses.replace(collective, groups=groups,
                               group_size=size or (len(groups[0]) if groups else 16))


@pytest.mark.parametrize("groups, size, level", [
    (((0, 1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14, 15)), None, NVLINK),
    (((4, 5, 6, 7, 8, 9, 10, 11),), None, IB),  # 8 devices, but across the block boundary
    (((7, 8),), None, IB),
    (((0,), (9,)), None, NVLINK),  # nothing to send
    (tuple((i,) for i in range(16)), None, NVLINK),
    ((tuple(range(16)),), None, IB),
    (None, 2, NVLINK),  # groups unknown: the group-size rule
    (None, 16, IB),
])
def test_level_from_hand_written_groups(groups, size, level):
    assert collective_level(H100, _all_reduce(groups, size)) == level


def test_device_ids_map_partition_ids_to_devices():
    # a mesh whose device list is [0, 2, 4, ..., 14, 1, 3, ..., 15]: partitions 0..7 sit on
    # both nodes, partitions {i, i+8} on devices {2i, 2i+1}, in one node
    device_ids = list(range(0, 16, 2)) + list(range(1, 16, 2))
    first_eight = _all_reduce(((0, 1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14, 15)))
    pairs = _all_reduce(tuple((i, i + 8) for i in range(8)))
    assert collective_level(H100, first_eight, device_ids) == IB
    assert collective_level(H100, pairs, device_ids) == NVLINK
    assert pairs.kind is CollectiveKind.ALL_REDUCE
