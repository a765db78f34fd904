"""autopar.cost_model.replica_groups: the device groups of collectives, from hand-written HLO
lines (every form, groups worked out by hand) and from programs compiled on 8 and 16
simulated devices (groups checked against the mesh's own layout)."""

import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from autopar.cost_model.hlo import analyze, parse_collectives
from autopar.cost_model.replica_groups import device_groups, group_size

from .test_hlo import _jit, _shard_map


def _groups(attribute: str, num_devices: int = 8):
    return device_groups(f"%ar = f32[64]{{0}} all-reduce(%p), {attribute}, to_apply=%add",
                         num_devices)


@pytest.mark.parametrize("attribute, groups", [
    ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("replica_groups={{0,1,2,3,4,5,6,7}}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    # iota: 0..7 as [8], read 2 at a time
    ("replica_groups=[4,2]<=[8]", ((0, 1), (2, 3), (4, 5), (6, 7))),
    # 0..7 as [4,2] = [[0,1],[2,3],[4,5],[6,7]], transposed: [[0,2,4,6],[1,3,5,7]]
    ("replica_groups=[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
    # 0..7 as [2,2,2] (i,j,k) = 4i+2j+k, read in (i,k,j) order: 0,2 1,3 4,6 5,7
    ("replica_groups=[4,2]<=[2,2,2]T(0,2,1)", ((0, 2), (1, 3), (4, 6), (5, 7))),
    # mesh axes: devices 0..7 as a=2 x b=4; a group varies the named axes
    ("replica_groups=mesh['a'=2,'b'=4] {'a'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("replica_groups=mesh['a'=2,'b'=4] {'b'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("replica_groups=mesh[a=2,b=4] {b}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("replica_groups=mesh['a'=2,'b'=4] {'b','a'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
    ("replica_groups=mesh['a'=2,'b'=4] {}", tuple((i,) for i in range(8))),
    # device array [[0,2,4,6],[1,3,5,7]] (0..7 as [4,2], transposed, as 2 x 4)
    ("replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}",
     ((0, 2, 4, 6), (1, 3, 5, 7))),
    # a listed device array [[7,6,5,4],[3,2,1,0]]
    ("replica_groups=mesh['a'=2,'b'=4], device_ids=(7,6,5,4,3,2,1,0) {'a'}",
     ((7, 3), (6, 2), (5, 1), (4, 0))),
    # sub-axes of b = b_major (pre-size 1, size 2) x b_minor (pre-size 2, size 2)
    ("replica_groups=mesh['a'=2,'b'=4] {'b':(1)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("replica_groups=mesh['a'=2,'b'=4] {'b':(2)2}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("replica_groups=mesh['a'=2,'b'=4] {'a','b':(2)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
    # both halves of b, minor first: the group lists b_minor-major order
    ("replica_groups=mesh['a'=2,'b'=4] {'b':(2)2,'b':(1)2}", ((0, 2, 1, 3), (4, 6, 5, 7))),
    ("replica_groups={}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("channel_id=3", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("replica_groups=mesh['a'=2,'b'=4], device_ids=(0,1,2) {'a'}", None),  # not 8 devices
    ("replica_groups=mesh['a'=2,'b'=4] {'c'}", None),  # no such axis
    ("replica_groups=<unknown form>", None),
])
def test_replica_group_forms(attribute, groups):
    assert _groups(attribute) == groups
    if groups is not None:
        line = f"%ar = f32[64]{{0}} all-reduce(%p), {attribute}, to_apply=%add"
        assert group_size(line, 8) == len(groups[0])


def test_source_target_pairs_are_groups_of_two():
    (permute,) = parse_collectives(
        "ENTRY %main () -> f32[] {\n  %cp = f32[8]{0} collective-permute(%x), channel_id=1, "
        "source_target_pairs={{0,1},{1,2},{2,0},{5,5}}\n}\n", num_devices=8)
    assert permute.groups == ((0, 1), (1, 2), (2, 0), (5, 5))
    assert permute.group_size == 4  # devices named: 0, 1, 2, 5


def _axis_groups(shape, axes, names) -> set[frozenset[int]]:
    """The groups of positions that vary along mesh ``axes``, from the mesh's layout."""
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    moved = np.moveaxis(ids, [names.index(a) for a in axes], range(-len(axes), 0))
    size = int(np.prod([shape[names.index(a)] for a in axes]))
    return {frozenset(map(int, row)) for row in moved.reshape(-1, size)}


def _as_sets(groups) -> set[frozenset[int]]:
    return {frozenset(g) for g in groups}


# name in sixteen_devices.py -> (mesh shape, mesh names, axes the one collective runs over)
SIXTEEN = {
    "psum_node": ((2, 8), ("node", "gpu"), ("node",)),  # replica_groups={{0,8},...}
    "psum_gpu": ((2, 8), ("node", "gpu"), ("gpu",)),
    "gather_node": ((2, 8), ("node", "gpu"), ("node",)),  # mesh[...] {'axis_0'}
    "gather_gpu": ((2, 8), ("node", "gpu"), ("gpu",)),  # mesh[...], device_ids=([2,8]T(1,0))
    "gather_ac": ((2, 2, 4), ("a", "b", "c"), ("a", "c")),  # device_ids=([2,2,4]T(0,2,1))
    "gather_ca": ((2, 2, 4), ("a", "b", "c"), ("c", "a")),  # device_ids=([4,4]T(1,0))
}


@pytest.mark.parametrize("name", SIXTEEN)
def test_groups_of_programs_compiled_on_16_devices(name, sixteen_device_hlo):
    shape, names, axes = SIXTEEN[name]
    (collective,) = parse_collectives(sixteen_device_hlo[name], 16)
    assert _as_sets(collective.groups) == _axis_groups(shape, axes, names)
    assert collective.group_size == len(collective.groups[0])


def test_gather_over_two_axes_lists_members_in_the_axes_order(sixteen_device_hlo):
    # ('c', 'a'): c is the major of the two, as in shard_map's psum over ('c', 'a')
    (collective,) = parse_collectives(sixteen_device_hlo["gather_ca"], 16)
    assert collective.groups == ((0, 8, 1, 9, 2, 10, 3, 11), (4, 12, 5, 13, 6, 14, 7, 15))


def test_ppermute_pairs_compiled_on_16_devices(sixteen_device_hlo):
    (node,) = parse_collectives(sixteen_device_hlo["ppermute_node"], 16)
    assert _as_sets(node.groups) == {frozenset((i, i + 8)) for i in range(8)}
    assert len(node.groups) == 16  # i -> i+8 and back
    (gpu,) = parse_collectives(sixteen_device_hlo["ppermute_gpu"], 16)
    assert set(gpu.groups) == {(n + i, n + (i + 1) % 8) for n in (0, 8) for i in range(8)}


def test_iota_groups_compiled_on_16_devices(sixteen_device_hlo):
    text = sixteen_device_hlo["halves_to_y"]
    assert "replica_groups=[8,2]<=[2,2,4]T(2,1,0)" in text  # the form this test is about
    gather = next(c for c in parse_collectives(text, 16) if c.kind.value == "all-gather")
    # 0..15 as [2,2,4] (i,j,k) = 8i+4j+k, read in (k,j,i) order, 2 at a time
    assert gather.groups == ((0, 8), (4, 12), (1, 9), (5, 13), (2, 10), (6, 14), (3, 11),
                             (7, 15))


def test_groups_of_programs_compiled_on_8_devices(mesh_2d):
    # (data=2, model=4): shard_map prints lists, a plain jit the mesh axes form
    by_axes = {
        ("model",): _shard_map(mesh_2d, lambda a: lax.psum(a, "model"), P("model"), P()),
        ("data",): _shard_map(mesh_2d, lambda a: lax.psum(a, "data"), P("data"), P()),
        ("data", "model"): _shard_map(mesh_2d, lambda a: lax.psum(a, ("data", "model")),
                                      P(("data", "model")), P()),
    }
    by_axes[("model", "jit")] = _jit(mesh_2d, lambda a: a * 2, P("model", None), P())
    by_axes[("data", "jit")] = _jit(mesh_2d, lambda a: a * 2, P("data", None), P())
    for axes, compiled in by_axes.items():
        (collective,) = analyze(compiled).collectives
        want = _axis_groups((2, 4), [a for a in axes if a != "jit"], ("data", "model"))
        assert _as_sets(collective.groups) == want, (axes, collective.text)
