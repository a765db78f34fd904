"""Hardware profiles: the per-device numbers the cost model turns FLOPs and bytes into seconds.

A :class:`HardwareProfile` describes **one device** (a TPU chip, a GPU, or one simulated CPU
device) and the interconnect levels around it:

* ``peak_flops_per_s``: dense peak FLOP/s of one device, keyed by the jnp dtype name of the
  matmul operands (``"bfloat16"``, ``"float16"``, ``"float32"``, ``"float8_e4m3fn"``; GPU
  profiles also carry ``"tensorfloat32"``). ``"float32"`` is the rate of a matmul computed to
  full float32 accuracy (``precision=HIGHEST`` / ``F32_F32_F32``). JAX's *default* precision
  may run float32 dots faster (bfloat16 passes on TPU, TF32 on Ampere and newer GPUs, see
  https://docs.jax.dev/en/latest/201/precision.html); a caller that knows the program runs at
  default precision should ask for ``"bfloat16"`` (TPU) or ``"tensorfloat32"`` (GPU) instead.
  Use :meth:`HardwareProfile.peak_flops` rather than indexing, it applies the fallbacks.
* ``hbm_bandwidth_bytes_per_s`` / ``hbm_capacity_bytes``: the device's own memory.
* ``levels``: the interconnect hierarchy, innermost first (ICI / NVLink / HOST, then DCN or
  InfiniBand). Each :class:`LinkLevel` has

  - ``bandwidth_bytes_per_s``: bytes per second that **one device sends in one direction**
    when a ring collective runs along **one mesh axis** at that level. The collective
    formulas in the cost model are ring formulas over the bytes each device sends (an
    all-reduce of ``B`` bytes over ``n`` devices sends ``2(n-1)/n * B`` per device), so the
    time of one collective is ``steps * latency_s + wire_bytes / bandwidth_bytes_per_s``.
    Datasheets quote *bidirectional* and often *aggregate* numbers; every constant below
    says how it was converted. For NVLink behind an NVSwitch any ring can use the whole
    per-GPU link budget in each direction (H100: 900 GB/s bidirectional -> 450 GB/s). On
    a TPU torus a ring along one axis only uses the two ICI ports that face along that
    axis (a bidirectional ring sends half of the data each way), so the level bandwidth is
    ``2 x (one port, one direction)``, not the chip's aggregate.
  - ``latency_s``: the fixed cost (alpha) of one collective step.
  - ``devices_per_group``: how many devices share the level (8 GPUs behind one NVSwitch,
    256 chips in a v5e pod); ``None`` for the outermost, unbounded level.

* ``matmul_efficiency``: the fraction of peak that a large, well-shaped matmul reaches.
* ``launch_overhead_s``: a floor on the time of any one kernel/op.

Units are SI throughout: seconds, bytes (1 GB = 1e9 bytes, 1 GiB = 2**30 bytes, each number
below uses the unit its source states), FLOP/s (one multiply-add = 2 FLOPs).

Profiles are frozen, hashable dataclasses made by the named factories below
(:func:`tpu_v5e`, :func:`h100`, ...) or read from a JSON file written by
``autopar profile`` (:meth:`HardwareProfile.to_json` / :meth:`HardwareProfile.from_json`).
:func:`get_profile` resolves a name, alias, file path, profile or ``None`` (the current jax
backend); :func:`axis_levels` maps each axis of a ``jax.sharding.Mesh`` to the level its
collectives cross.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 names with numpy)
import numpy as np

from autopar.errors import (HardwareWarning, MeshError, ProfileError, UnknownHardwareError,
                            warn)

__all__ = [
    "PROFILE_FORMAT_VERSION",
    "HardwareProfile",
    "LevelKind",
    "LinkLevel",
    "a100_40gb",
    "a100_80gb",
    "axis_levels",
    "b200",
    "cpu",
    "get_profile",
    "h100",
    "h200",
    "known_profiles",
    "l4",
    "nearest_profile",
    "t4",
    "tpu_v2",
    "tpu_v3",
    "tpu_v4",
    "tpu_v5e",
    "tpu_v5p",
    "tpu_v6e",
]

#: Version of the JSON layout written by :meth:`HardwareProfile.to_json`.
PROFILE_FORMAT_VERSION = 2
#: Older layouts this version still reads (version 1 had no measured fields).
_READABLE_VERSIONS = (1, 2)

_REGENERATE_HINT = "re-run `autopar profile` to write a current profile file"


# --------------------------------------------------------------------------------------------
# Data model
# --------------------------------------------------------------------------------------------


class LevelKind(enum.Enum):
    """The kind of an interconnect level."""

    ICI = "ici"  # TPU inter-chip interconnect (torus inside a slice)
    NVLINK = "nvlink"  # NVLink / NVSwitch inside one GPU node
    DCN = "dcn"  # TPU data-center network between slices (through the hosts)
    INFINIBAND = "infiniband"  # GPU scale-out network between nodes
    ETHERNET = "ethernet"  # plain Ethernet scale-out (measured profiles only)
    PCIE = "pcie"  # GPUs of one host joined by PCIe only (T4, L4: no NVLink)
    HOST = "host"  # simulated devices in one process (memory copies)


_LEVEL_ALIASES: Mapping[str, LevelKind] = MappingProxyType(
    {
        **{k.value: k for k in LevelKind},
        **{k.name.lower(): k for k in LevelKind},
        "ib": LevelKind.INFINIBAND,
        "eth": LevelKind.ETHERNET,
        "nvswitch": LevelKind.NVLINK,
    }
)


def _level_kind(value: Any) -> LevelKind:
    """A LevelKind from an enum member or its name/value (case-insensitive); else ValueError."""
    if isinstance(value, LevelKind):
        return value
    if isinstance(value, str):
        kind = _LEVEL_ALIASES.get(value.strip().lower())
        if kind is not None:
            return kind
    raise ValueError(value)


def _valid_level_names() -> str:
    return ", ".join(repr(k.value) for k in LevelKind)


def _number(owner: str, field: str, value: Any, *, positive: bool = True, at_most: float | None = None) -> float:
    """``value`` as a finite float, or ProfileError naming ``owner.field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{owner}: field {field!r} must be a number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ProfileError(f"{owner}: field {field!r} must be finite, got {value!r}")
    if positive and out <= 0:
        raise ProfileError(f"{owner}: field {field!r} must be > 0, got {value!r}")
    if not positive and out < 0:
        raise ProfileError(f"{owner}: field {field!r} must be >= 0, got {value!r}")
    if at_most is not None and out > at_most:
        raise ProfileError(f"{owner}: field {field!r} must be <= {at_most}, got {value!r}")
    return out


@dataclass(frozen=True)
class LinkLevel:
    """One interconnect level, seen from one device (see the module docstring for units)."""

    kind: LevelKind
    bandwidth_bytes_per_s: float  # per device, one direction, along one mesh axis
    latency_s: float  # alpha: fixed cost of one collective step
    devices_per_group: int | None = None  # devices sharing this level; None = unbounded
    # Measured alpha-beta per collective on one mesh axis, from `autopar profile`:
    # ((collective kind name, latency_s, bandwidth_bytes_per_s), ...). Empty: use the above.
    fits: tuple[tuple[str, float, float], ...] = ()

    def fit(self, kind: str) -> tuple[float, float] | None:
        """(latency_s, bandwidth_bytes_per_s) measured for collective ``kind``, or None."""
        for name, latency_s, bandwidth in self.fits:
            if name == kind:
                return latency_s, bandwidth
        return None

    def __post_init__(self) -> None:
        owner = "LinkLevel"
        try:
            kind = _level_kind(self.kind)
        except ValueError:
            raise ProfileError(
                f"{owner}: field 'kind' must be one of {_valid_level_names()}, got {self.kind!r}"
            ) from None
        object.__setattr__(self, "kind", kind)
        owner = f"LinkLevel({kind.value})"
        object.__setattr__(
            self, "bandwidth_bytes_per_s", _number(owner, "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        )
        object.__setattr__(self, "latency_s", _number(owner, "latency_s", self.latency_s, positive=False))
        dpg = self.devices_per_group
        if dpg is not None and (isinstance(dpg, bool) or not isinstance(dpg, int) or dpg < 1):
            raise ProfileError(
                f"{owner}: field 'devices_per_group' must be a positive integer or None "
                f"(unbounded), got {dpg!r}"
            )


class _FrozenMapping(Mapping[str, float]):
    """An immutable, hashable str -> float mapping (keeps insertion order, compares like a dict)."""

    __slots__ = ("_items", "_index")

    def __init__(self, items: Mapping[str, float]) -> None:
        self._items = tuple(items.items())
        self._index = dict(self._items)

    def __getitem__(self, key: str) -> float:
        return self._index[key]

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._index == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return f"{{{', '.join(f'{k!r}: {v!r}' for k, v in self._items)}}}"


# Short dtype spellings accepted by HardwareProfile.peak_flops, besides jnp dtype names.
_DTYPE_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "bf16": "bfloat16",
        "f16": "float16",
        "fp16": "float16",
        "half": "float16",
        "f32": "float32",
        "fp32": "float32",
        "single": "float32",
        "float": "float32",
        "tf32": "tensorfloat32",
        "fp8": "float8_e4m3fn",
        "f8": "float8_e4m3fn",
    }
)

_REQUIRED_FLOPS_KEYS = ("float32", "bfloat16")


def _dtype_name(dtype: Any) -> str:
    """The canonical name of a dtype given as a name, numpy/jnp dtype or type, or an array."""
    if isinstance(dtype, str):
        name = dtype.strip().lower()
        name = _DTYPE_ALIASES.get(name, name)
        if name == "tensorfloat32":
            return name
        try:
            return np.dtype(name).name
        except TypeError:
            return name
    for candidate in (dtype, getattr(dtype, "dtype", None)):  # dtypes/types, then arrays
        if candidate is None:
            continue
        try:
            return np.dtype(candidate).name
        except TypeError:
            pass
    return str(dtype).strip().lower()


@dataclass(frozen=True)
class HardwareProfile:
    """Per-device compute, memory and interconnect numbers of one kind of hardware."""

    name: str
    peak_flops_per_s: Mapping[str, float]  # dense peak per device, keyed by jnp dtype name
    hbm_bandwidth_bytes_per_s: float
    hbm_capacity_bytes: int
    levels: tuple[LinkLevel, ...]  # innermost first
    # Fraction of peak a large matmul reaches. 0.7 is a middle-of-the-road default for
    # hand-built profiles; every built-in factory sets its own value with a source.
    matmul_efficiency: float = 0.7
    # Floor on the duration of one kernel. 5 us is a generic default (see h100() for a
    # measured GPU figure); built-in factories set their own.
    launch_overhead_s: float = 5e-6
    # Matmul dims pad to this tile on the matrix units (MXU / tensor cores), so a per-device
    # dim of d runs at d / (ceil(d / tile) * tile) of the large-matmul rate. Each factory
    # sets its own with a source.
    matmul_tile: int = 128
    # Measured (square matmul size, fraction of peak) points from `autopar profile`; when
    # present they replace the tile model (interpolated on log2 of the smallest dim).
    matmul_curve: tuple[tuple[int, float], ...] = ()
    # Measured collectives: ((mesh axis name, collective kind name, latency_s,
    # bandwidth_bytes_per_s), ...). An axis of that name in a planned mesh is priced with them.
    collective_fits: tuple[tuple[str, str, float, float], ...] = ()
    # The peak_flops_per_s entry a float32 matmul runs at under jax's default precision:
    # "tensorfloat32" on NVIDIA GPUs since Ampere, where XLA:GPU computes default-precision
    # float32 dots on TF32 tensor cores. A dot at HIGHEST precision runs at "float32".
    float32_matmul: str = "float32"
    # Fraction of hbm_bandwidth_bytes_per_s that memory-bound kernels reach; each factory sets
    # its own with a source (1.0 where the bandwidth is itself measured).
    hbm_efficiency: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ProfileError(f"hardware profile: field 'name' must be a non-empty string, got {self.name!r}")
        owner = f"hardware profile {self.name!r}"

        flops = self.peak_flops_per_s
        if not isinstance(flops, Mapping) or not flops:
            raise ProfileError(
                f"{owner}: field 'peak_flops_per_s' must be a non-empty mapping from dtype name "
                f"to FLOP/s, got {flops!r}"
            )
        checked: dict[str, float] = {}
        for key, value in flops.items():
            if not isinstance(key, str) or not key:
                raise ProfileError(f"{owner}: field 'peak_flops_per_s' has a non-string key {key!r}")
            checked[key] = _number(owner, f"peak_flops_per_s[{key!r}]", value)
        missing = [k for k in _REQUIRED_FLOPS_KEYS if k not in checked]
        if missing:
            raise ProfileError(
                f"{owner}: field 'peak_flops_per_s' must have entries for "
                f"{', '.join(map(repr, _REQUIRED_FLOPS_KEYS))}; missing {', '.join(map(repr, missing))}"
            )
        object.__setattr__(self, "peak_flops_per_s", _FrozenMapping(checked))

        object.__setattr__(
            self,
            "hbm_bandwidth_bytes_per_s",
            _number(owner, "hbm_bandwidth_bytes_per_s", self.hbm_bandwidth_bytes_per_s),
        )
        cap = self.hbm_capacity_bytes
        if isinstance(cap, float) and cap.is_integer():
            cap = int(cap)
        if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
            raise ProfileError(f"{owner}: field 'hbm_capacity_bytes' must be a positive integer, got {cap!r}")
        object.__setattr__(self, "hbm_capacity_bytes", cap)

        levels = self.levels
        if isinstance(levels, LinkLevel) or not isinstance(levels, (tuple, list)) or not levels:
            raise ProfileError(
                f"{owner}: field 'levels' must be a non-empty sequence of LinkLevel, innermost "
                f"first, got {levels!r}"
            )
        for i, lvl in enumerate(levels):
            if not isinstance(lvl, LinkLevel):
                raise ProfileError(f"{owner}: levels[{i}] must be a LinkLevel, got {lvl!r}")
        kinds = [lvl.kind for lvl in levels]
        if len(set(kinds)) != len(kinds):
            raise ProfileError(
                f"{owner}: field 'levels' names a level kind twice: {[k.value for k in kinds]}"
            )
        for i, lvl in enumerate(levels[:-1]):
            if lvl.devices_per_group is None:
                raise ProfileError(
                    f"{owner}: levels[{i}] ({lvl.kind.value}) has devices_per_group=None "
                    f"(unbounded) but is not the outermost level; only the last level may be unbounded"
                )
            nxt = levels[i + 1].devices_per_group
            if nxt is not None and nxt < lvl.devices_per_group:
                raise ProfileError(
                    f"{owner}: field 'levels' must be ordered innermost first: levels[{i + 1}] "
                    f"({levels[i + 1].kind.value}) groups {nxt} devices, fewer than levels[{i}] "
                    f"({lvl.kind.value}) with {lvl.devices_per_group}"
                )
        object.__setattr__(self, "levels", tuple(levels))

        object.__setattr__(
            self, "matmul_efficiency", _number(owner, "matmul_efficiency", self.matmul_efficiency, at_most=1.0)
        )
        object.__setattr__(
            self, "launch_overhead_s", _number(owner, "launch_overhead_s", self.launch_overhead_s, positive=False)
        )
        tile = self.matmul_tile
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
            raise ProfileError(f"{owner}: field 'matmul_tile' must be a positive integer, got {tile!r}")
        curve = []
        for i, point in enumerate(self.matmul_curve):
            if not isinstance(point, (tuple, list)) or len(point) != 2:
                raise ProfileError(f"{owner}: matmul_curve[{i}] must be [size, fraction], got {point!r}")
            curve.append((int(_number(owner, f"matmul_curve[{i}] size", point[0])),
                          _number(owner, f"matmul_curve[{i}] fraction", point[1], at_most=1.0)))
        object.__setattr__(self, "matmul_curve", tuple(sorted(curve)))
        fits = []
        for i, fit in enumerate(self.collective_fits):
            if not isinstance(fit, (tuple, list)) or len(fit) != 4 or not all(
                    isinstance(x, str) for x in fit[:2]):
                raise ProfileError(f"{owner}: collective_fits[{i}] must be [axis, collective, "
                                   f"latency_s, bandwidth_bytes_per_s], got {fit!r}")
            if fit[1] not in _COLLECTIVE_NAMES:
                raise ProfileError(f"{owner}: collective_fits[{i}] names collective {fit[1]!r}; "
                                   f"known ones are {', '.join(_COLLECTIVE_NAMES)}")
            fits.append((fit[0], fit[1],
                         _number(owner, f"collective_fits[{i}] latency_s", fit[2], positive=False),
                         _number(owner, f"collective_fits[{i}] bandwidth_bytes_per_s", fit[3])))
        object.__setattr__(self, "collective_fits", tuple(fits))
        if self.float32_matmul not in checked:
            raise ProfileError(f"{owner}: field 'float32_matmul' must name an entry of "
                               f"'peak_flops_per_s' ({', '.join(sorted(checked))}), got "
                               f"{self.float32_matmul!r}")
        object.__setattr__(self, "hbm_efficiency",
                           _number(owner, "hbm_efficiency", self.hbm_efficiency, at_most=1.0))

    # -- queries ---------------------------------------------------------------------------

    def peak_flops(self, dtype: Any) -> float:
        """Dense peak FLOP/s of one device for matmuls whose operands have ``dtype``.

        ``dtype`` may be a jnp/numpy dtype or scalar type, an array, or a name (``"bfloat16"``,
        short forms like ``"bf16"``/``"fp32"``, or ``"tensorfloat32"``). Fallbacks: float16
        without an entry uses the bfloat16 number; any float8 (or smaller float) type uses
        the ``float8_e4m3fn`` number, else bfloat16; ``tensorfloat32`` without an entry, and
        every other dtype (integers, bool, float64, complex, unknown names), use the float32
        number.
        """
        name = _dtype_name(dtype)
        table = self.peak_flops_per_s
        if name in table:
            return table[name]
        if name == "float16":
            return table["bfloat16"]
        if name.startswith(("float8_", "float6_", "float4_")):
            return table.get("float8_e4m3fn", table["bfloat16"])
        return table["float32"]

    def matmul_flops(self, dtype: Any, highest: bool = False) -> float:
        """Peak FLOP/s of a matmul whose operands have ``dtype``, as XLA runs it: a float32
        one at jax's default precision runs at ``float32_matmul``'s rate; ``highest``
        (``precision=HIGHEST``) keeps it at the float32 rate."""
        if not highest and _dtype_name(dtype) == "float32":
            return self.peak_flops(self.float32_matmul)
        return self.peak_flops(dtype)

    @property
    def achieved_hbm_bytes_per_s(self) -> float:
        """The memory bandwidth a memory-bound kernel reaches."""
        return self.hbm_bandwidth_bytes_per_s * self.hbm_efficiency

    def level(self, kind: LevelKind | str) -> LinkLevel:
        """The level of ``kind`` (a LevelKind or its name); ProfileError if the profile lacks it."""
        try:
            wanted = _level_kind(kind)
        except ValueError:
            raise ProfileError(
                f"{kind!r} is not an interconnect level kind; valid kinds are {_valid_level_names()}"
            ) from None
        for lvl in self.levels:
            if lvl.kind is wanted:
                return lvl
        raise ProfileError(
            f"hardware profile {self.name!r} has no {wanted.value!r} level; its levels are "
            f"{', '.join(repr(lvl.kind.value) for lvl in self.levels)}"
        )

    @property
    def async_collectives(self) -> bool:
        """Whether collectives run beside compute (GPU and TPU streams), so that splitting one
        into steps can hide it; XLA:CPU (the ``host`` level) runs every collective in line."""
        return all(lvl.kind is not LevelKind.HOST for lvl in self.levels)

    @property
    def innermost(self) -> LinkLevel:
        """The fastest, innermost interconnect level."""
        return self.levels[0]

    # -- JSON ------------------------------------------------------------------------------

    def to_json(self) -> str:
        """This profile as JSON text (with ``format_version``); :meth:`from_json` reads it back."""
        doc = {
            "format_version": PROFILE_FORMAT_VERSION,
            "name": self.name,
            "peak_flops_per_s": dict(self.peak_flops_per_s),
            "hbm_bandwidth_bytes_per_s": self.hbm_bandwidth_bytes_per_s,
            "hbm_capacity_bytes": self.hbm_capacity_bytes,
            "levels": [
                {
                    "kind": lvl.kind.value,
                    "bandwidth_bytes_per_s": lvl.bandwidth_bytes_per_s,
                    "latency_s": lvl.latency_s,
                    "devices_per_group": lvl.devices_per_group,
                }
                for lvl in self.levels
            ],
            "matmul_efficiency": self.matmul_efficiency,
            "launch_overhead_s": self.launch_overhead_s,
            "matmul_tile": self.matmul_tile,
            "matmul_curve": [list(p) for p in self.matmul_curve],
            "collective_fits": [list(f) for f in self.collective_fits],
            "float32_matmul": self.float32_matmul,
            "hbm_efficiency": self.hbm_efficiency,
        }
        return json.dumps(doc, indent=2) + "\n"

    def axis_fits(self, axis: str) -> tuple[tuple[str, float, float], ...]:
        """The measured (collective, latency_s, bandwidth_bytes_per_s) of mesh axis ``axis``."""
        return tuple((kind, lat, bw) for a, kind, lat, bw in self.collective_fits if a == axis)

    @classmethod
    def from_json(cls, s: str | bytes) -> HardwareProfile:
        """Parse :meth:`to_json` output; ProfileError naming the bad field if it is malformed."""
        try:
            doc = json.loads(s)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
            raise ProfileError(
                f"hardware profile is not valid JSON ({e}); {_REGENERATE_HINT}"
            ) from None
        if isinstance(doc, dict) and "in_shardings" in doc and "peak_flops_per_s" not in doc:
            raise ProfileError("this is a saved plan, not a hardware profile: read it with "
                               "autopar.Plan.load(path) or `autopar show PATH`, and pass a "
                               "profile written by `autopar profile` (or a built-in name) as "
                               "the hardware")
        try:
            return _profile_from_doc(cls, doc)
        except ProfileError as e:
            raise ProfileError(f"invalid hardware profile JSON: {e}; fix that field or {_REGENERATE_HINT}") from None


_TOP_FIELDS = (
    "format_version",
    "name",
    "peak_flops_per_s",
    "hbm_bandwidth_bytes_per_s",
    "hbm_capacity_bytes",
    "levels",
    "matmul_efficiency",
    "launch_overhead_s",
)
# Fields added in format version 2, optional so that version-1 files still load.
_OPTIONAL_TOP_FIELDS = ("matmul_tile", "matmul_curve", "collective_fits", "float32_matmul",
                        "hbm_efficiency")
_COLLECTIVE_NAMES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                     "collective-permute")
_LEVEL_FIELDS = ("kind", "bandwidth_bytes_per_s", "latency_s", "devices_per_group")


def _check_fields(where: str, obj: Any, fields: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    if not isinstance(obj, dict):
        raise ProfileError(f"{where} must be a JSON object, got {type(obj).__name__}")
    missing = [f for f in fields if f not in obj]
    if missing:
        raise ProfileError(f"{where} is missing field {missing[0]!r} (expected fields: {', '.join(fields)})")
    extra = [f for f in obj if f not in fields and f not in optional]
    if extra:
        raise ProfileError(f"{where} has unknown field {extra[0]!r} (expected fields: {', '.join(fields)})")


def _profile_from_doc(cls: type[HardwareProfile], doc: Any) -> HardwareProfile:
    if isinstance(doc, dict) and "format_version" in doc:
        version = doc["format_version"]
        if version not in _READABLE_VERSIONS or isinstance(version, bool):
            raise ProfileError(
                f"field 'format_version' is {version!r}, but this autopar reads versions "
                f"{', '.join(map(str, _READABLE_VERSIONS))}"
            )
    _check_fields("the top level", doc, _TOP_FIELDS, _OPTIONAL_TOP_FIELDS)
    raw_levels = doc["levels"]
    if not isinstance(raw_levels, list) or not raw_levels:
        raise ProfileError(f"field 'levels' must be a non-empty list, got {raw_levels!r}")
    levels = []
    for i, raw in enumerate(raw_levels):
        where = f"levels[{i}]"
        _check_fields(where, raw, _LEVEL_FIELDS)
        try:
            kind = _level_kind(raw["kind"])
        except ValueError:
            raise ProfileError(
                f"{where}.kind is {raw['kind']!r}; valid kinds are {_valid_level_names()}"
            ) from None
        try:
            levels.append(
                LinkLevel(kind, raw["bandwidth_bytes_per_s"], raw["latency_s"], raw["devices_per_group"])
            )
        except ProfileError as e:
            raise ProfileError(f"{where}: {e}") from None
    if not isinstance(doc["peak_flops_per_s"], dict):
        raise ProfileError(
            f"field 'peak_flops_per_s' must be an object mapping dtype names to FLOP/s, "
            f"got {doc['peak_flops_per_s']!r}"
        )
    return cls(
        name=doc["name"],
        peak_flops_per_s=doc["peak_flops_per_s"],
        hbm_bandwidth_bytes_per_s=doc["hbm_bandwidth_bytes_per_s"],
        hbm_capacity_bytes=doc["hbm_capacity_bytes"],
        levels=tuple(levels),
        matmul_efficiency=doc["matmul_efficiency"],
        launch_overhead_s=doc["launch_overhead_s"],
        matmul_tile=doc.get("matmul_tile", 128),
        matmul_curve=tuple(tuple(p) if isinstance(p, list) else p
                           for p in _json_list(doc, "matmul_curve")),
        collective_fits=tuple(tuple(f) if isinstance(f, list) else f
                              for f in _json_list(doc, "collective_fits")),
        float32_matmul=doc.get("float32_matmul", "float32"),
        hbm_efficiency=doc.get("hbm_efficiency", 1.0),
    )


def _json_list(doc: dict, field: str) -> list:
    value = doc.get(field, [])
    if not isinstance(value, list):
        raise ProfileError(f"field {field!r} must be a list, got {value!r}")
    return value


# --------------------------------------------------------------------------------------------
# Built-in profiles. Every number cites its source; "estimate" marks a judgement call that
# `autopar profile` should replace with a measurement.
# --------------------------------------------------------------------------------------------

_GB = 1e9
_GIB = 2**30
_TFLOPS = 1e12

# TPU float32 matmuls to full float32 accuracy (Precision.HIGHEST) run as six bfloat16 MXU
# passes: jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
# https://docs.jax.dev/en/latest/201/precision.html
_TPU_F32_PASSES = 6

# ICI: ~1 us per hop, estimate (the TPU torus forwards in hardware; the scaling book treats
# ICI latency as ~1 us, https://jax-ml.github.io/scaling-book/tpus/).
_ICI_LATENCY_S = 1e-6
# DCN between slices goes through the host CPUs and NICs
# (https://cloud.google.com/tpu/docs/multislice-introduction); ~20 us per step is an estimate
# of a data-center round trip plus host staging.
_DCN_LATENCY_S = 20e-6
# A large MXU-bound matmul on TPU runs close to peak; 0.85 leaves room for pipeline fill and
# HBM stalls. Estimate (the scaling book's rooflines treat large matmuls as near-peak).
_TPU_MATMUL_EFFICIENCY = 0.85
# An XLA:TPU step is one compiled program, not a stream of host-launched kernels; 1 us per
# op is a conservative floor (estimate).
_TPU_LAUNCH_OVERHEAD_S = 1e-6

# NCCL's own latency model charges per ring step ~0.4-5.7 us on NVLink and ~0.9-9.6 us on
# the network, depending on protocol (LL / LL128 / Simple):
# https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc (hwLat). We take 2 us and 6 us.
_NVLINK_LATENCY_S = 2e-6
_IB_LATENCY_S = 6e-6
# Per-kernel floor on NVIDIA GPUs. XLA:GPU records a program's kernels into CUDA graphs
# (command buffers), which run back to back: on an H200 (jax 0.11.2, 2026-11-27,
# benchmarks.device_step, docs/design.md "Measured on a GPU") the median kernel under 10 us
# took 1.5-1.7 us in each of seven train steps, loop bodies included. We take 2 us. Without
# CUDA graphs a tiny kernel takes 3.8 us (https://developer.nvidia.com/blog/cuda-graphs/).
_GPU_LAUNCH_OVERHEAD_S = 2e-6
# Memory-bound kernels reach about 80% of the datasheet's HBM bandwidth: on the same H200
# run, XLA's elementwise and transpose fusions of 100 MB to 3 GB moved 3.6-3.9 TB/s of 4.8,
# and a chained elementwise pass 4.2; reductions reach less.
_GPU_HBM_EFFICIENCY = 0.8


def _ici_axis_bandwidth(bidirectional_per_chip_bytes_per_s: float, ports_per_chip: int) -> float:
    """Per-direction bandwidth a ring along one torus axis gets: the two ports facing that axis.

    ``bidirectional_per_chip`` is the chip's aggregate over all ports and both directions (how
    Google Cloud quotes it), so one port carries ``bidi / 2 / ports`` per direction, and a
    bidirectional ring on one axis uses two ports.
    """
    return 2 * bidirectional_per_chip_bytes_per_s / 2 / ports_per_chip


def _tpu_slice(name: str, bf16_flops: float, hbm_bytes_per_s: float, hbm_bytes: int,
               ici_axis_bytes_per_s: float, slice_chips: int,
               dcn_bytes_per_s: float, matmul_tile: int = 128) -> HardwareProfile:
    """A TPU chip (one JAX device) in a slice of ``slice_chips`` joined by ICI; slices (and
    hosts beyond a slice) joined by DCN. float32 is HIGHEST precision: 6 bf16 passes."""
    return HardwareProfile(
        name=name,
        peak_flops_per_s={"bfloat16": bf16_flops, "float32": bf16_flops / _TPU_F32_PASSES},
        hbm_bandwidth_bytes_per_s=hbm_bytes_per_s,
        hbm_capacity_bytes=hbm_bytes,
        levels=(
            LinkLevel(LevelKind.ICI, ici_axis_bytes_per_s, _ICI_LATENCY_S,
                      devices_per_group=slice_chips),
            LinkLevel(LevelKind.DCN, dcn_bytes_per_s, _DCN_LATENCY_S, devices_per_group=None),
        ),
        matmul_efficiency=_TPU_MATMUL_EFFICIENCY,
        launch_overhead_s=_TPU_LAUNCH_OVERHEAD_S,
        # v4, v5e and v5p MXUs are 128x128 systolic arrays
        # (https://cloud.google.com/tpu/docs/system-architecture-tpu-vm#tensorcore).
        matmul_tile=matmul_tile,
    )


def tpu_v4() -> HardwareProfile:
    """Cloud TPU v4 (one chip = two TensorCores, one JAX device), https://cloud.google.com/tpu/docs/v4."""
    return _tpu_slice(
        "tpu-v4",
        # "Peak compute per chip 275 teraflops (bf16 or int8)", cloud.google.com/tpu/docs/v4
        bf16_flops=275 * _TFLOPS,
        hbm_bytes_per_s=1200 * _GB,  # "HBM2 ... 1200 GBps", cloud.google.com/tpu/docs/v4
        hbm_bytes=32 * _GIB,  # "HBM2 capacity ... 32 GiB", cloud.google.com/tpu/docs/v4
        # 6 ICI ports per chip in a 3D torus (Jouppi et al., "TPU v4", ISCA 2023,
        # arXiv:2304.01433); 4.5e10 bytes/s per port one way
        # (https://jax-ml.github.io/scaling-book/tpus/). A ring on one axis uses 2 ports.
        ici_axis_bytes_per_s=2 * 4.5e10,
        slice_chips=4096,  # "TPU Pod size 4096 chips", cloud.google.com/tpu/docs/v4
        # Estimate: not published for v4. Taken equal to v5p's 50 Gbps per chip
        # (cloud.google.com/tpu/docs/v5p), which has the same 4-chip host.
        dcn_bytes_per_s=50e9 / 8,
    )


def tpu_v5e() -> HardwareProfile:
    """Cloud TPU v5e ("TPU v5 lite"), https://cloud.google.com/tpu/docs/v5e."""
    return _tpu_slice(
        "tpu-v5e",
        # "Peak compute per chip (bf16) 197 TFLOPs", cloud.google.com/tpu/docs/v5e
        bf16_flops=197 * _TFLOPS,
        hbm_bytes_per_s=819 * _GB,  # "HBM2 capacity and bandwidth 16 GB, 819 GBps", docs/v5e
        hbm_bytes=16 * 10**9,  # same line: 16 GB
        # "Bidirectional ICI bandwidth (per chip) 400 GBps", "ICI ports per chip 4",
        # 2D torus (docs/v5e): 50 GB/s per port per direction, 2 ports per axis.
        ici_axis_bytes_per_s=_ici_axis_bandwidth(400 * _GB, 4),
        slice_chips=256,  # "TPU Pod size 256 chips", docs/v5e
        # "Per-host NIC configuration 2 x 100 Gbps NIC", "Chips per host 8" (docs/v5e):
        # 200 Gbps per direction per host / 8 chips = 3.125 GB/s per chip per direction.
        dcn_bytes_per_s=2 * 100e9 / 8 / 8,
    )


def tpu_v5p() -> HardwareProfile:
    """Cloud TPU v5p, https://cloud.google.com/tpu/docs/v5p."""
    return _tpu_slice(
        "tpu-v5p",
        # "Peak compute per chip (BF16) 459 TFLOPs", cloud.google.com/tpu/docs/v5p. docs/v5p
        # lists FP8 peak = 459 TFLOPs, the same as bf16: fp8 falls back to bf16.
        bf16_flops=459 * _TFLOPS,
        hbm_bytes_per_s=2765 * _GB,  # "HBM2e capacity and bandwidth 95GB, 2765 GBps", docs/v5p
        hbm_bytes=95 * _GIB,  # "HBM capacity per chip (GiB) 95", docs/v5p
        # "Bidirectional ICI bandwidth per chip 1200 GBps", 3D torus = 6 ports
        # (docs/v5p): 100 GB/s per port per direction, 2 ports per axis.
        ici_axis_bytes_per_s=_ici_axis_bandwidth(1200 * _GB, 6),
        # "Single slice training is supported for up to 6144 chips", docs/v5p.
        slice_chips=6144,
        # "Data center network (DCN) bandwidth per chip (Gbps) 50", docs/v5p.
        dcn_bytes_per_s=50e9 / 8,
    )


def tpu_v6e() -> HardwareProfile:
    """Cloud TPU v6e (Trillium, "TPU v6 lite"), https://cloud.google.com/tpu/docs/v6e."""
    return _tpu_slice(
        "tpu-v6e",
        # "Peak compute per chip (bf16) 918 TFLOPs", cloud.google.com/tpu/docs/v6e
        bf16_flops=918 * _TFLOPS,
        hbm_bytes_per_s=1638 * _GB,  # "HBM bandwidth per chip 1638 GBps", docs/v6e
        hbm_bytes=32 * 10**9,  # "HBM capacity per chip 32 GB", docs/v6e
        # "Bidirectional ICI bandwidth (per chip) 800 GBps", "ICI ports per chip 4",
        # 2D torus (docs/v6e): 100 GB/s per port per direction, 2 ports per axis.
        ici_axis_bytes_per_s=_ici_axis_bandwidth(800 * _GB, 4),
        slice_chips=256,  # "TPU Pod size 256 chips", docs/v6e
        # "Per-host NIC configuration 4 x 200 Gbps NIC", "Chips per host 8"
        # (cloud.google.com/tpu/docs/v6e): 800 Gbps / 8 chips = 12.5 GB/s per direction.
        dcn_bytes_per_s=4 * 200e9 / 8 / 8,
        # Trillium's MXU grew to 256x256 (cloud.google.com/tpu/docs/v6e: "expanded size of
        # matrix multiply units").
        matmul_tile=256,
    )


def _tpu_per_core(name: str, chip_bf16_flops: float, chip_hbm_bytes_per_s: float,
                  chip_hbm_bytes: int, link_bytes_per_s: float, slice_chips: int) -> HardwareProfile:
    """TPU v2/v3: each chip's two TensorCores are two JAX devices, so every per-chip figure
    is halved; a 2D torus of 4 ICI links per chip, two per axis, shared by the two cores."""
    profile = _tpu_slice(name, bf16_flops=chip_bf16_flops / 2,
                         hbm_bytes_per_s=chip_hbm_bytes_per_s / 2, hbm_bytes=chip_hbm_bytes // 2,
                         ici_axis_bytes_per_s=2 * link_bytes_per_s / 2,
                         slice_chips=2 * slice_chips,
                         # Estimate: not published for v2/v3; v4's per-chip figure, halved.
                         dcn_bytes_per_s=50e9 / 8 / 2)
    return profile


def tpu_v2() -> HardwareProfile:
    """Cloud TPU v2 (Colab's TPU runtime), one TensorCore per JAX device,
    https://cloud.google.com/tpu/docs/v2."""
    return _tpu_per_core(
        "tpu-v2",
        # "Peak compute per chip 45 teraflops (bf16)", "HBM2 capacity and bandwidth 16 GiB,
        # 600 GBps", "TPU Pod size 256 chips", 2D torus: cloud.google.com/tpu/docs/v2.
        chip_bf16_flops=45 * _TFLOPS, chip_hbm_bytes_per_s=600 * _GB, chip_hbm_bytes=16 * _GIB,
        # Jouppi et al., "A Domain-Specific Supercomputer for Training Deep Neural Networks"
        # (CACM 63(7), 2020), Table 3: 4 ICI links per chip at 496 Gbit/s (taken per direction).
        link_bytes_per_s=496e9 / 8, slice_chips=256)


def tpu_v3() -> HardwareProfile:
    """Cloud TPU v3, one TensorCore per JAX device, https://cloud.google.com/tpu/docs/v3."""
    return _tpu_per_core(
        "tpu-v3",
        # "Peak compute per chip 123 teraflops (bf16)", "HBM2 capacity and bandwidth 32 GiB,
        # 900 GBps", "TPU Pod size 1024 chips", 2D torus: cloud.google.com/tpu/docs/v3.
        chip_bf16_flops=123 * _TFLOPS, chip_hbm_bytes_per_s=900 * _GB, chip_hbm_bytes=32 * _GIB,
        # Jouppi et al. (CACM 2020), Table 3: 4 ICI links per chip at 656 Gbit/s.
        link_bytes_per_s=656e9 / 8, slice_chips=1024)


def _pcie_gpu(name: str, flops: dict, hbm_bytes_per_s: float, hbm_bytes: int,
              pcie_bytes_per_s: float) -> HardwareProfile:
    """A GPU whose peers on the host are reached over PCIe only, hosts over Ethernet."""
    return HardwareProfile(
        name=name, peak_flops_per_s=dict(flops), hbm_bandwidth_bytes_per_s=hbm_bytes_per_s,
        hbm_capacity_bytes=hbm_bytes,
        levels=(
            # Cloud VMs hold up to 8 such GPUs (e.g. g2-standard-96: 8 L4,
            # https://cloud.google.com/compute/docs/gpus#l4-gpus); PCIe hops through the host.
            LinkLevel(LevelKind.PCIE, pcie_bytes_per_s, _IB_LATENCY_S, devices_per_group=8),
            # Estimate: a 100 Gbit/s VM NIC shared by 8 GPUs; 20 us per step as DCN.
            LinkLevel(LevelKind.ETHERNET, 100e9 / 8 / 8, _DCN_LATENCY_S, devices_per_group=None),
        ),
        matmul_efficiency=_A100_MATMUL_EFFICIENCY,  # estimate: no GEMM study at hand
        launch_overhead_s=_GPU_LAUNCH_OVERHEAD_S, matmul_tile=128,
        # Turing (T4) has no TF32 tensor cores; Ada (L4) has.
        float32_matmul="tensorfloat32" if "tensorfloat32" in flops else "float32",
        hbm_efficiency=_GPU_HBM_EFFICIENCY)


def t4() -> HardwareProfile:
    """NVIDIA T4 (Colab's GPU runtime), https://www.nvidia.com/content/dam/en-zz/Solutions/
    Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf."""
    return _pcie_gpu(
        "t4",
        {"float16": 65 * _TFLOPS,  # "Mixed Precision (FP16/FP32) 65 TFLOPS"
         # Turing has no bf16 tensor cores: XLA computes bf16 dots in f32 (estimate: FP32 rate).
         "bfloat16": 8.1 * _TFLOPS,
         "float32": 8.1 * _TFLOPS},  # "Single-Precision 8.1 TFLOPS"
        hbm_bytes_per_s=320 * _GB,  # "GPU Memory 16 GB GDDR6, 320+ GB/s"
        hbm_bytes=16 * 10**9,
        pcie_bytes_per_s=32 * _GB / 2)  # "Interconnect Bandwidth 32 GB/s" (PCIe 3 x16, both ways)


def l4() -> HardwareProfile:
    """NVIDIA L4, https://www.nvidia.com/en-us/data-center/l4/ (dense = the datasheet's
    sparsity figures / 2)."""
    return _pcie_gpu(
        "l4",
        {"bfloat16": 121 * _TFLOPS,  # "BF16 Tensor Core 242 teraFLOPS*" / 2
         "float16": 121 * _TFLOPS,  # "FP16 Tensor Core 242 teraFLOPS*" / 2
         "float8_e4m3fn": 242.5 * _TFLOPS,  # "FP8 Tensor Core 485 teraFLOPS*" / 2
         "tensorfloat32": 60 * _TFLOPS,  # "TF32 Tensor Core 120 teraFLOPS*" / 2
         "float32": 30.3 * _TFLOPS},  # "FP32 30.3 teraFLOPS"
        hbm_bytes_per_s=300 * _GB,  # "GPU memory bandwidth 300GB/s"
        hbm_bytes=24 * 10**9,  # "GPU memory 24GB"
        pcie_bytes_per_s=64 * _GB / 2)  # "Interconnect PCIe Gen4 x16 64GB/s" (both ways)


# A100 datasheet: https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
# (dense numbers; the datasheet's starred figures are 2x with 2:4 sparsity).
_A100_FLOPS = {
    "bfloat16": 312 * _TFLOPS,  # "BFLOAT16 Tensor Core 312 TFLOPS"
    "float16": 312 * _TFLOPS,  # "FP16 Tensor Core 312 TFLOPS"
    "tensorfloat32": 156 * _TFLOPS,  # "Tensor Float 32 (TF32) 156 TFLOPS"
    "float32": 19.5 * _TFLOPS,  # "FP32 19.5 TFLOPS"
}
# A100 SXM4: 12 third-generation NVLinks, 600 GB/s total (both directions) per GPU
# (datasheet "NVLink: 600GB/s") -> 300 GB/s per direction; HGX/DGX A100 put 8 GPUs behind
# NVSwitch (DGX A100 User Guide, https://docs.nvidia.com/dgx/dgxa100-user-guide/).
_A100_NVLINK_BYTES_PER_S = 600 * _GB / 2
# DGX A100: 8 single-port ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU (DGX A100 User
# Guide) -> 25 GB/s per GPU per direction.
_A100_IB_BYTES_PER_S = 200e9 / 8
# Estimate: large bf16 GEMMs on A100 are taken to reach ~80% of 312 TFLOP/s; tile and wave
# quantization keep real shapes below peak (NVIDIA, "Matrix Multiplication Background User's
# Guide", https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/).
# Replace with an `autopar profile` measurement where it matters.
_A100_MATMUL_EFFICIENCY = 0.8


def _gpu_node(name: str, flops: dict, hbm_bytes_per_s: float, hbm_bytes: int,
              nvlink_bytes_per_s: float, ib_bytes_per_s: float,
              matmul_efficiency: float) -> HardwareProfile:
    """A GPU in an 8-GPU NVSwitch node, nodes joined by one InfiniBand NIC per GPU."""
    return HardwareProfile(
        name=name,
        peak_flops_per_s=dict(flops),
        hbm_bandwidth_bytes_per_s=hbm_bytes_per_s,
        hbm_capacity_bytes=hbm_bytes,
        levels=(
            LinkLevel(LevelKind.NVLINK, nvlink_bytes_per_s, _NVLINK_LATENCY_S, devices_per_group=8),
            LinkLevel(LevelKind.INFINIBAND, ib_bytes_per_s, _IB_LATENCY_S, devices_per_group=None),
        ),
        matmul_efficiency=matmul_efficiency,
        launch_overhead_s=_GPU_LAUNCH_OVERHEAD_S,
        float32_matmul="tensorfloat32",
        hbm_efficiency=_GPU_HBM_EFFICIENCY,
        # cuBLAS/CUTLASS GEMMs run in thread-block tiles, typically 128 rows/cols on Ampere and
        # Hopper; dims not a multiple of the tile leave part of the last tile idle ("tile
        # quantization", NVIDIA Matrix Multiplication Background User's Guide,
        # https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/).
        matmul_tile=128,
    )


def _a100(name: str, hbm_bytes_per_s: float, hbm_bytes: int) -> HardwareProfile:
    return _gpu_node(name, _A100_FLOPS, hbm_bytes_per_s, hbm_bytes, _A100_NVLINK_BYTES_PER_S,
                     _A100_IB_BYTES_PER_S, _A100_MATMUL_EFFICIENCY)


def a100_40gb() -> HardwareProfile:
    """NVIDIA A100 SXM4 40GB in an 8-GPU HGX/DGX node."""
    # A100 datasheet, "A100 40GB SXM": "GPU Memory 40GB HBM2", "GPU Memory Bandwidth 1,555GB/s".
    return _a100("a100-40gb", 1555 * _GB, 40 * 10**9)


def a100_80gb() -> HardwareProfile:
    """NVIDIA A100 SXM4 80GB in an 8-GPU HGX/DGX node."""
    # A100 datasheet, "A100 80GB SXM": "GPU Memory 80GB HBM2e", "GPU Memory Bandwidth 2,039GB/s".
    return _a100("a100-80gb", 2039 * _GB, 80 * 10**9)


# H100 SXM datasheet: https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
# (dense = the datasheet's sparsity figures / 2). H200 SXM has the same GH100 compute and
# NVLink: https://www.nvidia.com/en-us/data-center/h200/.
_HOPPER_FLOPS = {
    "bfloat16": 989 * _TFLOPS,  # "BFLOAT16 Tensor Core 1,979 teraFLOPS*" (sparse) / 2
    "float16": 989 * _TFLOPS,  # "FP16 Tensor Core 1,979 teraFLOPS*" / 2
    "float8_e4m3fn": 1979 * _TFLOPS,  # "FP8 Tensor Core 3,958 teraFLOPS*" / 2 (e4m3 and e5m2)
    "tensorfloat32": 494.5 * _TFLOPS,  # "TF32 Tensor Core 989 teraFLOPS*" / 2
    "float32": 67 * _TFLOPS,  # "FP32 67 teraFLOPS"
}
# NVLink 4: "NVLink 900GB/s" per GPU, both directions together (datasheet) -> 450 GB/s per
# direction, to any of the 8 GPUs behind the NVSwitches of an HGX/DGX H100/H200 node.
_HOPPER_NVLINK_BYTES_PER_S = 900 * _GB / 2
# DGX H100/H200: 8 single-port ConnectX-7 400 Gb/s NDR InfiniBand, one per GPU
# (DGX H100/H200 User Guide, https://docs.nvidia.com/dgx/dgxh100-user-guide/) -> 50 GB/s.
_HOPPER_IB_BYTES_PER_S = 400e9 / 8
# Best-case torch.mm bf16 on H100 SXM measured at ~780 TFLOP/s = 0.79 of 989
# (https://gist.github.com/Chillee/2ec89696db8b7ed1c24461159e325405). On an H200 (jax
# 0.11.2, 2026-11-27, benchmarks.device_step), the gemms of seven realistic train steps took
# 0.95-1.05x of their time priced at 0.8 (the largest ran at 0.85, (16384, 2048, 2048) ones
# at 0.74-0.79).
_HOPPER_MATMUL_EFFICIENCY = 0.8


def _hopper(name: str, hbm_bytes_per_s: float, hbm_bytes: int) -> HardwareProfile:
    return _gpu_node(name, _HOPPER_FLOPS, hbm_bytes_per_s, hbm_bytes, _HOPPER_NVLINK_BYTES_PER_S,
                     _HOPPER_IB_BYTES_PER_S, _HOPPER_MATMUL_EFFICIENCY)


def h100() -> HardwareProfile:
    """NVIDIA H100 SXM5 80GB in an 8-GPU HGX/DGX node."""
    # H100 SXM datasheet: "GPU Memory 80GB", "GPU Memory Bandwidth 3.35TB/s".
    return _hopper("h100", 3.35e12, 80 * 10**9)


def h200() -> HardwareProfile:
    """NVIDIA H200 SXM 141GB in an 8-GPU HGX/DGX node."""
    # https://www.nvidia.com/en-us/data-center/h200/: "GPU Memory 141GB", "GPU Memory Bandwidth 4.8TB/s".
    return _hopper("h200", 4.8e12, 141 * 10**9)


def b200() -> HardwareProfile:
    """NVIDIA B200 in an 8-GPU HGX/DGX B200 node.

    Per-GPU numbers are the HGX B200 system figures (https://www.nvidia.com/en-us/data-center/hgx/)
    divided by 8 GPUs, and halved again where NVIDIA quotes them with 2:4 sparsity.
    """
    flops = {
        "bfloat16": 2.25e15,  # HGX B200 "FP16/BF16 Tensor Core 36 PFLOPS*" / 8 / 2
        "float16": 2.25e15,  # same line
        "float8_e4m3fn": 4.5e15,  # "FP8/FP6 Tensor Core 72 PFLOPS*" / 8 / 2
        "tensorfloat32": 1.125e15,  # "TF32 Tensor Core 18 PFLOPS*" / 8 / 2
        "float32": 75 * _TFLOPS,  # "FP32 600 TFLOPS" / 8
    }
    return _gpu_node(
        "b200", flops,
        # NVIDIA quotes "up to 8 TB/s" per GPU (DGX B200, 64 TB/s for 8 GPUs,
        # https://www.nvidia.com/en-us/data-center/dgx-b200/); the driver reports a 7680-bit bus
        # at 3996 MHz, i.e. 7.67 TB/s (https://github.com/pytorch/ao/pull/4002). We use 7.7 TB/s.
        hbm_bytes_per_s=7.7e12,
        hbm_bytes=180 * 10**9,  # DGX B200 "1,440GB total GPU memory" / 8
        # NVLink 5: "1.8TB/s" GPU-to-GPU per GPU, both directions (HGX B200) -> 900 GB/s.
        nvlink_bytes_per_s=1800 * _GB / 2,
        # DGX B200: 8 single-port ConnectX-7 400 Gb/s, one per GPU (dgx-b200 page) -> 50 GB/s.
        ib_bytes_per_s=400e9 / 8,
        # No published B200 GEMM study at hand; assume Hopper-like 0.75 (estimate).
        matmul_efficiency=_HOPPER_MATMUL_EFFICIENCY,
    )


def cpu() -> HardwareProfile:
    """Simulated CPU devices (``--xla_force_host_platform_device_count``) sharing one host.

    These numbers are deliberately modest round figures for a test/development host, not a
    measurement of any machine: the simulated devices of one process share the host's cores
    and memory, so every per-device figure is a share of the host. Measure with
    ``autopar profile`` when CPU timings matter.
    """
    # One AVX-512 core at ~3 GHz peaks near 16 lanes x 2 FMA units x 2 FLOPs x 3e9 = 192
    # GFLOP/s fp32 (96 with AVX2); 8 simulated devices share the host's cores. 100 GFLOP/s
    # per device (about one core's worth) is an estimate; on a 2-core CI VM XLA:CPU measured
    # ~100 GFLOP/s for one device and ~10 GFLOP/s per device with 8 devices running at once.
    # XLA:CPU has no faster bf16 matmul path on most x86 hosts (it measured the same as f32),
    # so bf16 = f32.
    per_device = 100e9
    return HardwareProfile(
        name="cpu",
        peak_flops_per_s={"float32": per_device, "bfloat16": per_device},
        # A server socket streams ~100 GB/s from DRAM (e.g. 8 channels DDR4-3200 = 204.8 GB/s
        # theoretical); an eighth of ~80 GB/s achieved is 10 GB/s per device. Estimate.
        hbm_bandwidth_bytes_per_s=10 * _GB,
        # An eighth of a 32 GiB development host. Estimate.
        hbm_capacity_bytes=4 * _GIB,
        levels=(
            LinkLevel(
                LevelKind.HOST,
                # XLA:CPU collectives between devices of one process are memory copies (each
                # byte read and written once): half of the per-device DRAM share -> 5 GB/s.
                bandwidth_bytes_per_s=5 * _GB,
                # Thread rendezvous per collective step; estimate (a whole 8-device psum of a
                # few bytes measured ~0.4 ms including dispatch on a 2-core VM).
                latency_s=10e-6,
                devices_per_group=None,
            ),
        ),
        # Eigen/oneDNN GEMMs reach well under nominal peak once the cores are shared; estimate.
        matmul_efficiency=0.5,
        # Per-op dispatch cost of the XLA:CPU runtime; estimate.
        launch_overhead_s=5e-6,
        # GEMM micro-kernels work on register blocks of a few SIMD vectors (16 float32 lanes
        # with AVX-512); estimate. `autopar profile` measures the real curve.
        matmul_tile=16,
    )


# --------------------------------------------------------------------------------------------
# Lookup
# --------------------------------------------------------------------------------------------

_FACTORIES: Mapping[str, Callable[[], HardwareProfile]] = MappingProxyType(
    {
        "tpu-v2": tpu_v2,
        "tpu-v3": tpu_v3,
        "tpu-v4": tpu_v4,
        "tpu-v5e": tpu_v5e,
        "tpu-v5p": tpu_v5p,
        "tpu-v6e": tpu_v6e,
        "a100-40gb": a100_40gb,
        "a100-80gb": a100_80gb,
        "h100": h100,
        "h200": h200,
        "b200": b200,
        "t4": t4,
        "l4": l4,
        "cpu": cpu,
    }
)

# Normalized alias -> canonical name. Includes the device_kind strings jax reports
# (jax/_src/pallas/mosaic/tpu_info.py for TPUs; nvidia-smi product names for GPUs), so that
# get_profile(None) and get_profile(device.device_kind) share one table. Only SXM parts are
# mapped: PCIe/NVL variants have different clocks, memory and links.
_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        # TPU v2, v3 (jax's device_kind: "TPU v2", "TPU v3")
        "v2": "tpu-v2",
        "tpuv2": "tpu-v2",
        "v3": "tpu-v3",
        "tpuv3": "tpu-v3",
        # TPU v4
        "v4": "tpu-v4",
        "tpuv4": "tpu-v4",
        "tpu-v4p": "tpu-v4",
        "v4p": "tpu-v4",
        # TPU v5e
        "v5e": "tpu-v5e",
        "tpuv5e": "tpu-v5e",
        "v5litepod": "tpu-v5e",
        "v5-lite": "tpu-v5e",
        "tpu-v5-lite": "tpu-v5e",
        "tpu-v5-litepod": "tpu-v5e",
        # TPU v5p
        "v5p": "tpu-v5p",
        "tpuv5p": "tpu-v5p",
        "tpu-v5": "tpu-v5p",
        # TPU v6e
        "v6e": "tpu-v6e",
        "tpuv6e": "tpu-v6e",
        "trillium": "tpu-v6e",
        "tpu-trillium": "tpu-v6e",
        "v6-lite": "tpu-v6e",
        "tpu-v6-lite": "tpu-v6e",
        # A100 ("a100" alone means the 80GB part, the common one today)
        "a100": "a100-80gb",
        "a100-80g": "a100-80gb",
        "a100-sxm": "a100-80gb",
        "a100-sxm4-80gb": "a100-80gb",
        "nvidia-a100-sxm4-80gb": "a100-80gb",
        "nvidia-a100-80gb": "a100-80gb",
        "a100-40g": "a100-40gb",
        "a100-sxm4-40gb": "a100-40gb",
        "nvidia-a100-sxm4-40gb": "a100-40gb",
        "nvidia-a100-40gb": "a100-40gb",
        # H100
        "h100-sxm": "h100",
        "h100-sxm5": "h100",
        "h100-80gb": "h100",
        "h100-sxm-80gb": "h100",
        "nvidia-h100": "h100",
        "nvidia-h100-80gb-hbm3": "h100",
        # H200
        "h200-sxm": "h200",
        "h200-141gb": "h200",
        "nvidia-h200": "h200",
        # B200
        "b200-sxm": "b200",
        "hgx-b200": "b200",
        "dgx-b200": "b200",
        "nvidia-b200": "b200",
        # T4, L4 (device_kind "Tesla T4", "NVIDIA L4")
        "tesla-t4": "t4",
        "nvidia-t4": "t4",
        "nvidia-l4": "l4",
        # CPU
        "host": "cpu",
    }
)


def _normalize(name: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", name.strip().lower()).strip("-")


def _canonical(name: str) -> str | None:
    key = _normalize(name)
    if key in _FACTORIES:
        return key
    return _ALIASES.get(key)


def known_profiles() -> tuple[str, ...]:
    """Canonical names of the built-in profiles."""
    return tuple(_FACTORIES)


def _known_list() -> str:
    return ", ".join(known_profiles())


def _load_profile_file(path: str | os.PathLike) -> HardwareProfile:
    shown = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ProfileError(
            f"hardware profile file {shown!r} does not exist; write one with `autopar profile` "
            f"or pass a built-in name ({_known_list()})"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"cannot read hardware profile file {shown!r}: {e}") from None
    try:
        return HardwareProfile.from_json(text)
    except ProfileError as e:
        raise ProfileError(f"hardware profile file {shown!r}: {e}") from None


def _profile_for_device(platform: str, device_kind: str) -> HardwareProfile:
    """The built-in profile for a jax backend platform and device_kind; for an accelerator
    without one, the nearest (:func:`nearest_profile`) with a HardwareWarning, or
    UnknownHardwareError when there is none."""
    if platform == "cpu":
        return cpu()
    name = _canonical(device_kind)
    if name is None or name == "cpu":
        name = nearest_profile(platform, device_kind)
        if name is None:
            raise UnknownHardwareError(
                f"no built-in hardware profile for the default jax backend {platform!r} "
                f"(device_kind {device_kind!r}). Run `autopar profile` on this machine and pass "
                f"the JSON file it writes as hardware='<file>.json', or pass the closest "
                f"built-in name explicitly ({_known_list()})")
        warn(
            f"autopar: no built-in hardware profile for {device_kind!r}; planning with the "
            f"nearest, {name!r}. Pass hardware= to choose, or measure this machine with "
            "`autopar profile`.", HardwareWarning)
    return _FACTORIES[name]()


def nearest_profile(platform: str, device_kind: str) -> str | None:
    """The built-in profile nearest an accelerator without one: a TPU by its generation (the
    newest built-in one at or below it, else the oldest), an NVIDIA GPU by its family and
    memory (``a100-40gb`` for an unknown one), else None."""
    kind = _normalize(device_kind)
    if platform == "tpu":
        gen = re.search(r"v(\d+)", kind)
        tpus = sorted((int(n[5]), n) for n in _FACTORIES if n.startswith("tpu-v"))
        if gen is None:
            return "tpu-v5e"
        below = [n for g, n in tpus if g <= int(gen.group(1))]
        return "tpu-v" + (below[-1][5:] if below else tpus[0][1][5:])
    if platform in ("gpu", "cuda", "rocm"):
        for family, name in (("b200", "b200"), ("h200", "h200"), ("h100", "h100"),
                             ("h800", "h100"), ("a100", "a100-80gb" if "80" in kind
                                                 else "a100-40gb"),
                             ("l4", "l4"), ("t4", "t4")):
            if family in kind:
                return name
        if any(maker in kind for maker in ("nvidia", "tesla", "geforce", "quadro", "rtx")):
            return "a100-40gb"
    return None


def get_profile(hardware: Any = None) -> HardwareProfile:
    """Resolve ``hardware`` to a :class:`HardwareProfile`.

    * ``None``: the profile of the current jax default backend (``"cpu"`` on CPU; GPUs and
      TPUs by ``device_kind``, e.g. ``"NVIDIA H100 80GB HBM3"`` -> h100, ``"TPU v5 lite"`` ->
      tpu-v5e). An accelerator without a built-in profile gets the nearest one (``nearest_profile``)
      with a HardwareWarning.
    * a :class:`HardwareProfile`: returned as is.
    * an ``os.PathLike``, or a ``str`` ending in ``.json``: a file written by
      ``autopar profile``. A missing or malformed file raises ProfileError naming the path.
    * any other ``str``: a built-in name or alias, case-insensitive (``"h100-sxm"``,
      ``"v5e"``, ``"a100"``, ...). Unknown names raise UnknownHardwareError listing the
      known ones.
    """
    if hardware is None:
        import jax  # deferred: only needed to look at the current backend

        platform = jax.default_backend()
        device_kind = jax.devices()[0].device_kind
        return _profile_for_device(platform, device_kind)
    if isinstance(hardware, HardwareProfile):
        return hardware
    if isinstance(hardware, os.PathLike) or (
        isinstance(hardware, str) and hardware.strip().lower().endswith(".json")
    ):
        return _load_profile_file(hardware)
    if isinstance(hardware, str):
        name = _canonical(hardware)
        if name is None:
            raise UnknownHardwareError(
                f"unknown hardware {hardware!r}; known profiles are {_known_list()} (aliases "
                f"such as 'v5e', 'h100-sxm', 'a100' also work). For other hardware run "
                f"`autopar profile` and pass the JSON file it writes"
            )
        return _FACTORIES[name]()
    raise UnknownHardwareError(
        f"hardware must be None, a profile name ({_known_list()}), a HardwareProfile, or a path "
        f"to a .json profile; got {type(hardware).__name__} {hardware!r}"
    )


# --------------------------------------------------------------------------------------------
# Mesh axes -> levels
# --------------------------------------------------------------------------------------------


def _group_level_index(levels: tuple[LinkLevel, ...], group: list[Any]) -> int:
    """Index of the innermost level that connects every device of ``group``.

    Devices in one process and one TPU slice use the innermost level. Otherwise a level
    covers the group if (for ICI, when devices carry ``slice_index``) they share a slice, or
    (any other bounded level) they fall in one aligned block of ``devices_per_group``
    consecutive device ids, which is how jax numbers the devices of a node; an unbounded
    level covers everything.
    """
    processes = {getattr(d, "process_index", 0) for d in group}
    slices = {getattr(d, "slice_index", None) for d in group}
    if len(processes) == 1 and len(slices) == 1:
        return 0
    has_slices = None not in slices
    for idx, lvl in enumerate(levels):
        g = lvl.devices_per_group
        if g is None:
            return idx
        if lvl.kind is LevelKind.ICI and has_slices:
            if len(slices) == 1:
                return idx
            continue
        if len(group) <= g and len({int(d.id) // g for d in group}) == 1:
            return idx
    return len(levels) - 1


def _resolve_override(profile: HardwareProfile, axis: str, value: Any) -> LinkLevel:
    available = ", ".join(repr(lvl.kind.value) for lvl in profile.levels)
    try:
        kind = _level_kind(value)
    except ValueError:
        raise ProfileError(
            f"override for mesh axis {axis!r} names level {value!r}, which is not a level kind; "
            f"hardware profile {profile.name!r} has levels {available}"
        ) from None
    for lvl in profile.levels:
        if lvl.kind is kind:
            return lvl
    raise ProfileError(
        f"override for mesh axis {axis!r} names level {kind.value!r}, but hardware profile "
        f"{profile.name!r} has no such level; choose one of {available}"
    )


def axis_levels(
    mesh: Any,
    profile: Any,
    overrides: Mapping[str, str | LevelKind] | None = None,
) -> dict[str, LinkLevel]:
    """Map every axis of ``mesh`` to the :class:`LinkLevel` its collectives cross.

    ``mesh`` is a ``jax.sharding.Mesh`` (anything with ``devices`` and ``axis_names``);
    ``profile`` a HardwareProfile or anything :func:`get_profile` accepts. For each axis, the
    devices that vary along it (all other coordinates fixed) form the groups a collective on
    that axis runs over; the axis gets the outermost level any of its groups needs (see
    :func:`_group_level_index`): an axis inside one process (and one TPU slice) uses the
    innermost level, an axis across slices uses DCN, one across GPU nodes InfiniBand.
    ``overrides`` (e.g. ``{"data": "dcn"}``) win; naming an axis the mesh lacks raises
    MeshError, naming a level the profile lacks raises ProfileError.
    """
    profile = get_profile(profile)
    try:
        devices = getattr(mesh, "devices", None)
        names = getattr(mesh, "axis_names", None)
    except ValueError:  # jax.sharding.AbstractMesh raises on .devices
        devices = names = None
    if devices is None or names is None:
        raise MeshError(
            f"axis_levels needs a concrete jax.sharding.Mesh with devices (an AbstractMesh "
            f"has none); got {type(mesh).__name__}"
        )
    names = tuple(names)
    devices = np.asarray(devices, dtype=object)
    if devices.ndim != len(names):
        raise MeshError(f"mesh devices have shape {devices.shape} but the mesh names {len(names)} axes {names}")

    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        raise ProfileError(
            f"overrides must map mesh axis names to level kinds, e.g. {{'data': 'dcn'}}; "
            f"got {type(overrides).__name__}"
        )
    resolved: dict[str, LinkLevel] = {}
    for axis, value in overrides.items():
        if axis not in names:
            raise MeshError(
                f"override names mesh axis {axis!r}, but the mesh has axes "
                f"{', '.join(map(repr, names))}; valid levels for hardware profile "
                f"{profile.name!r} are {', '.join(repr(lvl.kind.value) for lvl in profile.levels)}"
            )
        resolved[axis] = _resolve_override(profile, axis, value)

    result: dict[str, LinkLevel] = {}
    for i, axis in enumerate(names):
        if axis in resolved:
            result[axis] = resolved[axis]
            continue
        groups = np.moveaxis(devices, i, -1).reshape(-1, devices.shape[i])
        index = max(_group_level_index(profile.levels, list(row)) for row in groups)
        result[axis] = profile.levels[index]
    for axis in names:
        fits = profile.axis_fits(axis)
        if fits:
            result[axis] = dataclasses.replace(result[axis], fits=fits)
    measured = sorted({fit[0] for fit in profile.collective_fits})
    if measured and not any(profile.axis_fits(axis) for axis in names):
        warn(f"hardware profile {profile.name!r} measured collectives over mesh axes "
             f"{', '.join(measured)}, and this mesh's axes ({', '.join(names)}) are none of "
             "them: its collectives are priced from the profile's link levels instead. Name the "
             "axes as they were profiled, or profile this mesh (`autopar profile`).",
             HardwareWarning)
    return result
