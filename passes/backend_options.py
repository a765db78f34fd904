"""XLA options that let a planned program overlap its communication, per hardware profile.

A profile names its backend through its interconnect (NVLink or InfiniBand: GPU; ICI or DCN:
TPU; host memory: CPU). :func:`choose` returns the options of that backend's table that the
program can take: an option is set only when the program compiles for the backend it targets
and a small program on the plan's own device compiles with it (an unknown name raises there;
it is never put in ``XLA_FLAGS``, where an unknown name aborts the process). Every other
option is skipped with a note saying why. Options with a known bug in the running jaxlib are
skipped too (``BackendOption.broken_on_jaxlib``).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from types import MappingProxyType

import jax
import jax.numpy as jnp
import jaxlib
from jax.sharding import SingleDeviceSharding

from autopar.cost_model.hardware import HardwareProfile, LevelKind


class Backend(enum.Enum):
    """The XLA backend a program compiles for (``jax.Device.platform``)."""
    CPU = "cpu"
    GPU = "gpu"
    TPU = "tpu"


_BACKEND_OF_LEVEL = MappingProxyType({
    LevelKind.NVLINK: Backend.GPU, LevelKind.PCIE: Backend.GPU, LevelKind.INFINIBAND: Backend.GPU,
    LevelKind.ICI: Backend.TPU, LevelKind.DCN: Backend.TPU, LevelKind.HOST: Backend.CPU})
# jax reports CUDA and ROCm devices as "gpu"; older versions named the platform itself.
_BACKEND_OF_PLATFORM = MappingProxyType({
    "cpu": Backend.CPU, "gpu": Backend.GPU, "cuda": Backend.GPU, "rocm": Backend.GPU,
    "tpu": Backend.TPU})


@dataclass(frozen=True)
class BackendOption:
    """One XLA compile option, the backend it targets and why autopar sets it.

    ``broken_on_jaxlib``: jaxlib versions where it is known to break compilation, ``bug`` says
    how (with the issue); it is skipped there."""
    name: str
    value: bool | int | str
    backend: Backend
    why: str
    broken_on_jaxlib: tuple[str, ...] = ()
    bug: str = ""


@dataclass(frozen=True)
class OptionNote:
    """What became of one option: set (``is_set``) and why, or skipped and why not."""
    name: str
    value: bool | int | str
    is_set: bool
    why: str

    def to_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "set": self.is_set, "why": self.why}


_JAX_GPU_TIPS = "jax docs/gpu_performance_tips.md"
_MAXTEXT_FLAGS = "MaxText benchmarks/xla_flags_library.py"
_JAX_39200 = ("jax#39200: multi-streamed windowed einsum fails XLA's HLO verifier when a "
              "per-device matmul dimension exceeds about 1024 (new in jaxlib 0.10.2); "
              "single-stream windowed einsum with the same threshold is not validated there")

GPU_OPTIONS = (
    BackendOption("xla_gpu_enable_latency_hiding_scheduler", True, Backend.GPU,
                  "XLA:GPU runs collectives asynchronously (none is listed in "
                  "xla_gpu_disable_async_collectives); the latency-hiding scheduler moves each "
                  f"start early and each done late around independent compute ({_JAX_GPU_TIPS})"),
    BackendOption("xla_gpu_enable_highest_priority_async_stream", True, Backend.GPU,
                  "collectives run on the highest-priority stream, so overlapped kernels do "
                  f"not starve them ({_JAX_GPU_TIPS})"),
    BackendOption("xla_gpu_enable_pipelined_all_gather", True, Backend.GPU,
                  "in a scanned layer loop, the next iteration's all-gather starts during this "
                  f"one (FSDP weight prefetch by XLA's collective pipeliner; {_JAX_GPU_TIPS})"),
    BackendOption("xla_gpu_enable_pipelined_reduce_scatter", True, Backend.GPU,
                  "in a scanned layer loop, a gradient's reduce-scatter finishes during the "
                  f"next iteration ({_JAX_GPU_TIPS})"),
    BackendOption("xla_gpu_enable_pipelined_all_reduce", True, Backend.GPU,
                  "in a scanned layer loop, a gradient's all-reduce finishes during the next "
                  f"iteration ({_JAX_GPU_TIPS})"),
    BackendOption("xla_gpu_threshold_for_windowed_einsum_mib", 0, Backend.GPU,
                  "windowed einsum: an all-gather or reduce-scatter feeding a matmul is split "
                  "into collective-permute steps that overlap the matmul's chunks (T3, "
                  "ASPLOS'23; JAX-Toolbox and MaxText GPU recipes)",
                  broken_on_jaxlib=("0.10.2",), bug=_JAX_39200),
    BackendOption("xla_gpu_multi_streamed_windowed_einsum", True, Backend.GPU,
                  "windowed einsum's steps run on several streams, so transfers overlap the "
                  "matmul chunks",
                  broken_on_jaxlib=("0.10.2",), bug=_JAX_39200),
)

# libtpu's names; XLA:CPU and XLA:GPU do not know them. Continuation fusion hides a collective
# inside the fusions computed beside it; windowed einsum is XLA's collective matmul.
TPU_OPTIONS = (
    BackendOption("xla_tpu_enable_async_collective_fusion", True, Backend.TPU,
                  f"asynchronous collective (continuation) fusion ({_MAXTEXT_FLAGS})"),
    BackendOption("xla_tpu_enable_async_collective_fusion_fuse_all_gather", True, Backend.TPU,
                  f"continuation fusion covers all-gathers ({_MAXTEXT_FLAGS})"),
    BackendOption("xla_tpu_enable_async_collective_fusion_fuse_all_reduce", True, Backend.TPU,
                  f"continuation fusion covers all-reduces ({_MAXTEXT_FLAGS})"),
    BackendOption("xla_tpu_enable_async_collective_fusion_multiple_steps", True, Backend.TPU,
                  f"a fused collective may span several compute steps ({_MAXTEXT_FLAGS})"),
    BackendOption("xla_tpu_overlap_compute_collective_tc", True, Backend.TPU,
                  f"the TensorCore computes while a collective runs ({_MAXTEXT_FLAGS})"),
    BackendOption("xla_enable_async_all_gather", True, Backend.TPU,
                  f"all-gathers are asynchronous ({_MAXTEXT_FLAGS})"),
    BackendOption("xla_enable_async_all_reduce", True, Backend.TPU,
                  f"all-reduces are asynchronous ({_MAXTEXT_FLAGS})"),
    BackendOption("xla_enable_async_collective_permute", True, Backend.TPU,
                  "collective-permutes (collective-matmul steps, pipeline transfers) are "
                  "asynchronous"),
    BackendOption("xla_tpu_enable_windowed_einsum_for_all_gather", True, Backend.TPU,
                  "windowed einsum for an all-gather feeding a matmul (XLA's collective "
                  "matmul, T3 ASPLOS'23: 1.14-1.38x on TPU v4)"),
    BackendOption("xla_tpu_enable_windowed_einsum_for_reduce_scatter", True, Backend.TPU,
                  "windowed einsum for a matmul feeding a reduce-scatter"),
)

OPTIONS = MappingProxyType({Backend.GPU: GPU_OPTIONS, Backend.TPU: TPU_OPTIONS, Backend.CPU: ()})


def profile_backend(profile: HardwareProfile) -> Backend | None:
    """The backend ``profile`` describes, from its innermost interconnect level; None when
    that level says nothing (a measured profile over Ethernet)."""
    return _BACKEND_OF_LEVEL.get(profile.levels[0].kind)


def platform_backend(platform: str) -> Backend | None:
    """The backend of a ``jax.Device.platform`` name; None for a platform autopar does not know."""
    return _BACKEND_OF_PLATFORM.get(platform.lower())


def jaxlib_version() -> str:
    return jaxlib.__version__


@functools.cache
def _rejection(name: str, value, device) -> str | None:
    """Why ``device``'s compiler refuses option ``name``=``value`` (None: it compiles with it)."""
    arg = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=SingleDeviceSharding(device))
    try:
        jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(arg).compile()
    except (jax.errors.JaxRuntimeError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None


def rejection(option: BackendOption, device) -> str | None:
    """Why the compiler of ``device`` refuses ``option`` (None: a small program on ``device``
    compiles with it). Asked once per option, value and device."""
    return _rejection(option.name, option.value, device)


def _note(option: BackendOption, device, jaxlib_at: str) -> OptionNote:
    def skipped(why):
        return OptionNote(name=option.name, value=option.value, is_set=False, why=why)
    if jaxlib_at in option.broken_on_jaxlib:
        return skipped(f"off on jaxlib {jaxlib_at}: {option.bug}")
    if platform_backend(device.platform) is not option.backend:
        return skipped(f"targets {option.backend.value}; this program compiles for "
                       f"{device.platform}")
    refused = rejection(option, device)
    if refused is not None:
        return skipped(f"{device.platform}'s compiler refuses it ({refused})")
    return OptionNote(name=option.name, value=option.value, is_set=True, why=option.why)


def choose(profile: HardwareProfile, device, required: tuple[OptionNote, ...] = (),
           table: tuple[BackendOption, ...] | None = None) -> tuple[OptionNote, ...]:
    """A note for each option of ``profile``'s backend (``table`` replaces that list), after
    the ``required`` ones the program needs whatever the profile (already decided, kept as
    they are); the program compiles with those whose note ``is_set`` (:func:`as_options`).
    ``device``: one device the program runs on."""
    if table is None:
        table = OPTIONS.get(profile_backend(profile), ())
    jaxlib_at = jaxlib_version()
    return tuple(required) + tuple(_note(o, device, jaxlib_at) for o in table)


def as_options(notes: tuple[OptionNote, ...]) -> dict:
    """The ``compiler_options`` dict of the notes that are set."""
    return {n.name: n.value for n in notes if n.is_set}
