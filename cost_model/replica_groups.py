"""The device groups of one collective instruction in compiled HLO text.

A collective runs within groups of partition ids; with jax's SPMD programs (``replica_count=1``)
partition id ``i`` is position ``i`` of the mesh's flat device list (``mesh.devices.flat``),
whatever the devices' own ids are. The forms ``Compiled.as_text()`` prints:

* ``replica_groups={{0,8},{1,9}}``: the groups, listed.
* ``replica_groups=[G,S]<=[d0,d1,...]T(p0,p1,...)``: iota form, ``G`` groups of ``S``: the
  ids ``0..n-1`` laid out as ``[d0,d1,...]``, transposed by ``p`` (absent: none), read
  ``S`` at a time.
* ``replica_groups=mesh['a'=2,'b'=8], device_ids=([8,2]T(1,0)) {'a'}``: mesh axes form. The
  mesh's device array (``device_ids`` as an iota ``[dims]T(perm)`` or a list of ids; absent:
  ``0..n-1``) has the axes' shape; a group varies the named axes (in their order) with the
  others fixed. A sub-axis ``'b':(k)m`` is the factor of size ``m`` of axis ``b`` below the
  factors of product ``k`` (major to minor), as in XLA's ``MeshAxesReplicaGroupList``.
* ``replica_groups={}`` or no ``replica_groups`` at all: one group of every device.
* ``source_target_pairs={{0,1},{1,2}}`` (collective-permute): each pair is a group.
"""

from __future__ import annotations

import math
import re

import numpy as np

Groups = tuple[tuple[int, ...], ...]

_INTEGER = re.compile(r"\d+")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<pairs>[\d,{}\s]*)\}")
_GROUPS_LIST = re.compile(r"replica_groups=\{(?P<groups>(?:\{[\d,\s]*\}[,\s]*)*)\}")
_GROUP = re.compile(r"\{(?P<ids>[\d,\s]*)\}")
_GROUPS_IOTA = re.compile(
    r"replica_groups=\[(?P<count>\d+),(?P<size>\d+)\]<=\[(?P<dims>[\d,]+)\]"
    r"(?:T\((?P<perm>[\d,]+)\))?"
)
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<devices>[^)]*\)?)\))?\s*\{(?P<used>[^}]*)\}"
)
_MESH_AXIS = re.compile(r"'?(?P<name>[\w.\-]+)'?=(?P<size>\d+)")
_USED_AXIS = re.compile(r"'?(?P<name>[\w.\-]+)'?(?::\((?P<pre>\d+)\)(?P<sub>\d+))?")
_IOTA_DEVICES = re.compile(r"^\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?$")


def _ints(text: str) -> list[int]:
    return [int(i) for i in _INTEGER.findall(text)]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    """``0..n-1`` laid out as ``dims`` and transposed by ``perm``."""
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _mesh_axes(text: str) -> tuple[dict[str, int], list[tuple[str, int | None, int | None]]]:
    """Axis name -> size of ``mesh[...]``, and the named ``(axis, pre_size, size)`` refs."""
    mesh = _GROUPS_MESH.search(text)
    sizes = {m["name"]: int(m["size"]) for m in _MESH_AXIS.finditer(mesh["axes"])}
    used = [(u["name"], int(u["pre"]) if u["pre"] else None, int(u["sub"]) if u["sub"] else None)
            for u in _USED_AXIS.finditer(mesh["used"])]
    return sizes, used


def group_size(line: str, num_devices: int) -> int:
    """Devices per group of a collective instruction line (collective-permute: every device
    its pairs name)."""
    if pairs := _PAIRS.search(line):
        return len(set(_INTEGER.findall(pairs["pairs"])))
    if _GROUPS_MESH.search(line):
        sizes, used = _mesh_axes(line)
        return math.prod(sub if sub else sizes[name] for name, _, sub in used)
    if iota := _GROUPS_IOTA.search(line):
        return int(iota["size"])
    listed = _GROUPS_LIST.search(line)
    if listed and (first := _GROUP.search(listed["groups"])):
        return len(_INTEGER.findall(first["ids"]))
    return num_devices


def _mesh_devices(text: str | None, shape: list[int]) -> np.ndarray | None:
    """The mesh's device array from its ``device_ids=(...)`` text (None: ``0..n-1``)."""
    n = math.prod(shape)
    if text is None:
        return np.arange(n).reshape(shape)
    if iota := _IOTA_DEVICES.match(text.strip()):
        ids = _iota(_ints(iota["dims"]), _ints(iota["perm"]) if iota["perm"] else None)
    else:  # a listed permutation, maybe after its dimensions
        listed = _ints(text)[-n:]
        if sorted(listed) != list(range(n)):
            return None
        ids = np.array(listed)
    return ids.reshape(shape) if ids.size == n else None


def _split_axis(full: int, refs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Factors of an axis of size ``full`` for its (pre_size, size) refs, major first, and
    the factor each ref is, in the order given."""
    order = sorted(range(len(refs)), key=lambda i: refs[i][0])
    factors, position, product = [], {}, 1
    for i in order:
        pre, size = refs[i]
        if pre != product:
            factors.append(pre // product)
            product = pre
        position[i] = len(factors)
        factors.append(size)
        product *= size
    if product != full:
        factors.append(full // product)
    return factors, [position[i] for i in range(len(refs))]


def _mesh_groups(line: str) -> Groups | None:
    sizes, used = _mesh_axes(line)
    names = list(sizes)
    devices = _mesh_devices(_GROUPS_MESH.search(line)["devices"], [sizes[a] for a in names])
    if devices is None or any(name not in sizes for name, _, _ in used):
        return None
    refs: dict[str, list[tuple[int, int]]] = {}
    for name, pre, sub in used:
        refs.setdefault(name, []).append((pre, sub) if sub else (1, sizes[name]))
    shape, grouped, offset, seen = [], [], {}, {}
    for name in names:
        factors, positions = _split_axis(sizes[name], refs.get(name, [(1, sizes[name])]))
        offset[name] = [len(shape) + p for p in positions]
        shape.extend(factors)
    for name, _, _ in used:
        grouped.append(offset[name][seen.get(name, 0)])
        seen[name] = seen.get(name, 0) + 1
    rest = [d for d in range(len(shape)) if d not in grouped]
    size = math.prod(shape[d] for d in grouped)
    table = devices.reshape(shape).transpose(rest + grouped).reshape(-1, size)
    return tuple(tuple(int(d) for d in row) for row in table)


def device_groups(line: str, num_devices: int) -> Groups | None:
    """The groups of partition ids of a collective instruction line; None if its form is
    not one of the module's (the caller then knows only the group size)."""
    if pairs := _PAIRS.search(line):
        return tuple(tuple(_ints(p["ids"])) for p in _GROUP.finditer(pairs["pairs"]))
    if _GROUPS_MESH.search(line):
        return _mesh_groups(line)
    if iota := _GROUPS_IOTA.search(line):
        dims = _ints(iota["dims"])
        ids = _iota(dims, _ints(iota["perm"]) if iota["perm"] else None)
        table = ids.reshape(int(iota["count"]), int(iota["size"]))
        return tuple(tuple(int(d) for d in row) for row in table)
    if (listed := _GROUPS_LIST.search(line)) and _GROUP.search(listed["groups"]):
        return tuple(tuple(_ints(g["ids"])) for g in _GROUP.finditer(listed["groups"]))
    if "replica_groups=" in line and not re.search(r"replica_groups=\{\}", line):
        return None  # a form this module does not read
    return (tuple(range(num_devices)),)
