"""Turning what the user calls a mesh into a jax Mesh with Auto axes."""

from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding

from autopar._compat import backends_initialized
from autopar._meshspec import parse_mesh_spec
from autopar.errors import ArgumentError, HardwareWarning, MeshError

def simulate_hint(n: int | str = "N") -> str:
    """How to get ``n`` simulated CPU devices, in Python and on the command line."""
    return (f"To simulate {n} devices on CPU, call autopar.simulate_cpu_devices({n}) before jax "
            f"starts, or set XLA_FLAGS=--xla_force_host_platform_device_count={n} before jax is "
            f"imported (with the CLI: --simulate-devices {n}).")


def as_auto_mesh(mesh) -> Mesh:
    """A Mesh over the same devices whose axes are all Auto (with_sharding_constraint needs it)."""
    if isinstance(mesh, str):
        mesh = parse_mesh_spec(mesh)
    if isinstance(mesh, Mapping):
        return _mesh_from_dict(dict(mesh))
    if not isinstance(mesh, Mesh):
        raise MeshError(f"`mesh` must be a jax.sharding.Mesh or a dict like "
                        f"{{'data': 2, 'model': 4}}, not {type(mesh).__name__}")
    _check_mesh(mesh)
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def mesh_text(mesh: Mesh) -> str:
    """``data=2 x model=4``: a mesh's axes and sizes, major to minor."""
    return " x ".join(f"{a}={n}" for a, n in axis_sizes(mesh).items())


def mesh_in_context(mesh):
    """A context manager setting ``mesh`` (:func:`as_auto_mesh`'s argument) as jax's mesh
    (``jax.set_mesh``). No change inside a trace, or for a mesh that is not one (the planner
    reports that)."""
    try:
        return jax.set_mesh(as_auto_mesh(mesh))
    except (ValueError, MeshError):
        return contextlib.nullcontext()


def with_mesh_when_asked(run, mesh):
    """``run()``; when the user's function asked jax for a mesh in context (a bare
    ``PartitionSpec`` in ``with_sharding_constraint``, which a dict mesh gives no Mesh to
    build a NamedSharding from), ``run()`` again with ``mesh`` set (:func:`mesh_in_context`).
    Only then: traced under a mesh, values carry it, which the pipeline's manual regions
    cannot take."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 (re-raised unless it is jax asking for a mesh)
        if not _asks_for_mesh(e):
            raise
    with mesh_in_context(mesh):
        return run()


def _asks_for_mesh(e: BaseException | None) -> bool:
    """Whether ``e``, or an exception it came from, is jax's "requires a non-empty mesh in
    context"."""
    seen = set()
    while e is not None and id(e) not in seen:
        if "non-empty mesh in context" in str(e):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


#: Mesh axis names autopar takes: ASCII words (XLA aborts the process on some others).
AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def check_axis_name(name) -> None:
    """MeshError unless ``name`` is a mesh axis name autopar takes (:data:`AXIS_NAME`)."""
    if not isinstance(name, str):
        raise MeshError(f"`mesh` axis names must be strings such as 'data', got {name!r} "
                        f"({type(name).__name__})")
    if not AXIS_NAME.fullmatch(name):
        raise MeshError(f"`mesh` axis name {name!r} is not an ASCII word: use letters, digits, "
                        "'_', '.' or '-' (starting with a letter or '_'), such as 'data'; "
                        "XLA cannot take other names")


def _check_mesh(mesh: Mesh) -> None:
    """MeshError for a jax Mesh autopar cannot plan on: no devices, a device twice, or an axis
    name XLA cannot take."""
    for name in mesh.axis_names:
        check_axis_name(name)
    flat = list(mesh.devices.flat)
    if not flat:
        raise MeshError("`mesh` has no devices: build it over at least one, e.g. "
                        "jax.make_mesh((8,), ('data',))")
    ids = [d.id for d in flat]
    if len(set(ids)) != len(ids):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise MeshError(f"`mesh` holds device(s) {twice} more than once: each device may appear "
                        "once; build it from distinct devices (jax.make_mesh does)")


def _mesh_from_dict(axes: dict[str, int]) -> Mesh:
    if not axes:
        raise MeshError("`mesh` has no axes: give at least one, e.g. {'data': 8}")
    for name, size in axes.items():
        check_axis_name(name)
        if (not isinstance(size, (int, np.integer)) or isinstance(size, (bool, np.bool_))
                or size < 1):
            raise MeshError(f"`mesh` axis {name!r} has size {size!r}: give a positive integer, "
                            "e.g. {'data': 8}")
    axes = {name: int(size) for name, size in axes.items()}
    devices = jax.devices()
    need = math.prod(axes.values())
    if need > len(devices):
        raise MeshError(f"mesh {axes} needs {need} devices but {len(devices)} "
                        f"{devices[0].platform} device(s) exist. {simulate_hint(need)}")
    if need != len(devices):
        cli = (f"drop {SIMULATE_FLAG} from XLA_FLAGS and pass --simulate-devices {need}"
               if _user_sets_count() else f"--simulate-devices {need}")
        raise MeshError(f"mesh {axes} needs {need} devices but {len(devices)} "
                        f"{devices[0].platform} device(s) exist: make the sizes multiply to "
                        f"{len(devices)}, or pass a jax.sharding.Mesh over the devices you want "
                        f"to use (on simulated CPU devices: {cli} on the command line, "
                        f"autopar.simulate_cpu_devices({need}) before jax starts in Python)")
    return Mesh(np.array(devices).reshape(tuple(axes.values())), tuple(axes),
                axis_types=(AxisType.Auto,) * len(axes))


def off_explicit_mesh():
    """A context manager clearing jax's abstract mesh while a user's ``jax.set_mesh`` of a
    mesh with Explicit (or Manual) axes is in effect, so that a trace does not record those
    axes in its equations (the plan runs on Auto axes; replayed under the Explicit mesh, each
    equation would fail jax's check that its context mesh matches its operands'). No change
    otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or all(t == AxisType.Auto for t in mesh.axis_types):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(AbstractMesh((), ()))


def on_explicit_axes(x) -> bool:
    """Whether ``x`` (an array or ShapeDtypeStruct) is placed on a mesh with Explicit (or
    Manual) axes, its sharding part of its type: autopar traces it as a plain value and runs
    the plan on Auto axes over the same devices (see :func:`as_auto_mesh`)."""
    sharding = getattr(x, "sharding", None)
    return isinstance(sharding, NamedSharding) and any(t != AxisType.Auto
                                                       for t in sharding.mesh.axis_types)


def axis_sizes(mesh: Mesh | AbstractMesh) -> dict[str, int]:
    """Each axis's size, major to minor (a loaded plan's mesh may have no devices here)."""
    return dict(mesh.shape)


def same_axes(a: Mesh | AbstractMesh, b: Mesh | AbstractMesh) -> bool:
    """Whether ``a`` and ``b`` have the same axes of the same sizes, in the same order."""
    return [*axis_sizes(a).items()] == [*axis_sizes(b).items()]


SIMULATE_FLAG = "--xla_force_host_platform_device_count"
#: The device counts :func:`simulate_cpu_devices` wrote into XLA_FLAGS itself (not the user).
_SET_HERE: list[int] = []


def _user_sets_count() -> bool:
    """Whether the user's XLA_FLAGS set the host device count (not autopar on their behalf)."""
    return SIMULATE_FLAG in os.environ.get("XLA_FLAGS", "") and not _SET_HERE


def simulate_cpu_devices(n: int) -> bool:
    """Ask XLA for ``n`` host (CPU) devices, to plan and run a mesh on one machine. Takes
    effect only before jax creates its devices (the first ``jax.devices()`` or computation);
    only the CPU platform is affected. Returns whether it took effect (False also when
    ``XLA_FLAGS`` already sets a count, which is kept). A HardwareWarning says when it came
    too late, or ``XLA_FLAGS`` holds, and fewer than ``n`` CPU devices are there. ``n`` must
    be a positive int (an ArgumentError otherwise: XLA would abort the process on it)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
        raise ArgumentError(f"autopar.simulate_cpu_devices(n): n must be a positive int, got "
                            f"{n!r}; pass the number of CPU devices to simulate, e.g. 8")
    n = int(n)
    if backends_initialized():
        have = len(jax.devices("cpu"))
        if have < n:
            warnings.warn(f"autopar.simulate_cpu_devices({n}) came too late: jax has made its "
                          f"devices already ({have} CPU). Call it before the first "
                          "jax.devices() or computation, or set "
                          f"XLA_FLAGS={SIMULATE_FLAG}={n} before Python starts.",
                          HardwareWarning, stacklevel=2)
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    if SIMULATE_FLAG in flags:
        kept = re.findall(re.escape(SIMULATE_FLAG) + r"=(\d+)", flags)
        if kept and int(kept[-1]) < n:
            where = (f"an earlier autopar.simulate_cpu_devices({_SET_HERE[-1]}) set "
                     f"{SIMULATE_FLAG}={kept[-1]} in XLA_FLAGS, which is kept: call it once, "
                     "with the most devices you need" if _SET_HERE else
                     f"XLA_FLAGS sets {SIMULATE_FLAG}={kept[-1]}, which is kept; change it "
                     "there")
            warnings.warn(f"autopar.simulate_cpu_devices({n}): {where}.", HardwareWarning,
                          stacklevel=2)
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {SIMULATE_FLAG}={n}".strip()
    _SET_HERE.append(n)
    return True
