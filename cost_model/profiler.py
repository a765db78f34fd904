"""The live profiler: measure the backend a mesh runs on and fit the cost model to it.

:func:`profile` times, on the devices of a mesh:

* matmuls per dtype over a few square sizes: the best rate becomes the dtype's peak, and the
  rate of each size relative to it becomes the profile's ``matmul_curve``;
* an elementwise pass on one device: the memory bandwidth. Matmuls and this pass are timed
  as chains inside one program, so the time to dispatch a program does not count;
* every collective (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute) on
  every mesh axis over message sizes from ``min_bytes`` to ``max_bytes`` (per device: the
  operand, or the result for all-gather). ``time = a + b * wire_bytes`` is fitted by
  non-negative least squares on relative error, with wire bytes per the contract's ring table
  (:func:`cost_model.hlo.wire_bytes`); ``a / ring_steps`` is the latency (alpha) and ``1 / b``
  the bandwidth, so the fit plugs into the same formula that prices plans
  (:meth:`cost_model.collectives.CommStep.time_s`).

Each measurement compiles once, runs ``warmup`` times, then takes the least of ``repeats``
timed runs (other work on the machine only ever adds time), each ended by ``block_until_ready``: right on GPU and TPU, where dispatch is
asynchronous, as on CPU. The result is a :class:`HardwareProfile` based on the backend's
built-in profile (or ``base``) whose JSON ``hardware=`` accepts.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable

import numpy as np

from autopar.errors import MeshError, ProfileError
from autopar.cost_model.collectives import ring_steps
from autopar.cost_model.hardware import HardwareProfile, get_profile
from autopar.cost_model.hlo import CollectiveKind, wire_bytes

_ACCELERATOR_MATMUL_SIZES = (256, 512, 1024, 2048, 4096)
_CPU_MATMUL_SIZES = (64, 128, 256, 512)


def _time_s(fn: Callable, arg, warmup: int, repeats: int) -> float:
    """Least wall time of ``fn(arg)`` over ``repeats`` runs, after ``warmup`` untimed runs:
    other work on the machine only adds time, and a median of few runs under load can make
    a small message slower than a large one, which no latency-plus-bandwidth fit takes."""
    for _ in range(warmup):
        fn(arg).block_until_ready()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(arg).block_until_ready()
        samples.append(time.perf_counter() - t0)
    return min(samples)


def fit_alpha_beta(kind: CollectiveKind, group_size: int, wire_bytes_list, times_s
                   ) -> tuple[float, float]:
    """(latency_s, bandwidth_bytes_per_s) of ``time = steps * latency + wire / bandwidth``,
    by non-negative least squares on relative error. ProfileError if the bandwidth term is not
    positive (times that do not grow with the message size)."""
    from scipy.optimize import nnls

    w = np.asarray(wire_bytes_list, dtype=float)
    t = np.asarray(times_s, dtype=float)
    design = np.stack([np.ones_like(w), w], axis=1) / t[:, None]
    (a, b), _ = nnls(design, np.ones_like(t))
    if b <= 0 or a <= 0:
        raise ProfileError(
            f"the {kind.value} timings over {group_size} devices do not fit latency + bytes / "
            f"bandwidth with both terms positive (times {', '.join(f'{x:.3g}' for x in t)} s); "
            "widen the message range (--min-bytes/--max-bytes) or raise --repeats")
    return a / ring_steps(kind, group_size), 1.0 / b


def _collective_program(kind: CollectiveKind, axis: str, mesh):
    """A jitted shard_map applying one collective over ``axis`` to a per-device 1-D buffer."""
    import jax
    from jax.sharding import PartitionSpec as P

    n = mesh.shape[axis]
    bodies = {
        CollectiveKind.ALL_REDUCE: lambda x: jax.lax.psum(x, axis),
        CollectiveKind.ALL_GATHER: lambda x: jax.lax.all_gather(x, axis, tiled=True),
        CollectiveKind.REDUCE_SCATTER: lambda x: jax.lax.psum_scatter(x, axis, tiled=True),
        CollectiveKind.ALL_TO_ALL: lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True),
        CollectiveKind.COLLECTIVE_PERMUTE: lambda x: jax.lax.ppermute(
            x, axis, perm=[(i, (i + 1) % n) for i in range(n)]),
    }
    spec = P(tuple(mesh.axis_names))
    return jax.jit(jax.shard_map(bodies[kind], mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False))


def _local_elems(kind: CollectiveKind, message_bytes: int, n: int, itemsize: int) -> int:
    """Per-device input elements for a message of ``message_bytes`` (the result for
    all-gather), rounded so every collective divides it."""
    elems = max(message_bytes // itemsize, n)
    elems -= elems % n
    return elems // n if kind is CollectiveKind.ALL_GATHER else elems


def measure_collective(kind: CollectiveKind, axis: str, mesh, sizes_bytes, *, warmup: int = 2,
                       repeats: int = 5) -> tuple[list[float], list[float]]:
    """(wire bytes per device, least seconds) of ``kind`` on ``axis`` at each size."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.shape[axis]
    program = _collective_program(kind, axis, mesh)
    itemsize = 4
    wires, times = [], []
    for size in sizes_bytes:
        local = _local_elems(kind, size, n, itemsize)
        x = jax.device_put(jnp.ones((local * mesh.devices.size,), jnp.float32),
                           NamedSharding(mesh, P(tuple(mesh.axis_names))))
        in_bytes = local * itemsize
        out_bytes = {CollectiveKind.ALL_GATHER: in_bytes * n,
                     CollectiveKind.REDUCE_SCATTER: in_bytes // n}.get(kind, in_bytes)
        wires.append(wire_bytes(kind, in_bytes, out_bytes, n))
        times.append(_time_s(program, x, warmup, repeats))
    return wires, times


def _per_call_s(program: Callable[[int], Callable], arg, iters: int, warmup: int,
                repeats: int) -> float:
    """Seconds one call takes on the device, without the cost of dispatching a program.

    ``program(n)`` is a jitted function making ``n`` chained calls. ``program(iters)`` and
    ``program(2 * iters)`` are timed; their difference over ``iters`` is the per-call time. A
    single timed call on a GPU is mostly dispatch for any kernel shorter than a few hundred
    microseconds. Falls back to the longer program's time over ``2 * iters`` where timing
    noise makes the difference negative.
    """
    once = _time_s(program(iters), arg, warmup, repeats)
    twice = _time_s(program(2 * iters), arg, warmup, repeats)
    return (twice - once) / iters if twice > once else twice / (2 * iters)


def _unrolled(body: Callable) -> Callable[[int], Callable]:
    """``n`` -> ``body`` applied ``n`` times in straight-line code (XLA:GPU syncs with the
    host on every trip of a while loop); for ops XLA does not fuse, such as matmuls."""
    import jax

    def program(n: int):
        def chain(x):
            for _ in range(n):
                x = body(x)
            return x
        return jax.jit(chain)
    return program


def _looped(body: Callable) -> Callable[[int], Callable]:
    """``n`` -> ``body`` applied ``n`` times in a loop, so XLA cannot fuse the calls into one
    kernel; for kernels long enough that a trip's host sync is small beside them."""
    import jax

    return lambda n: jax.jit(lambda x: jax.lax.fori_loop(0, n, lambda _, c: body(c), x))


def measure_matmul(device, dtype, sizes, *, warmup: int = 2, repeats: int = 5,
                   iters: int = 8) -> list[tuple[int, float]]:
    """[(size, FLOP/s)] of square matmuls of ``dtype`` on ``device``."""
    import jax

    out = []
    for size in sizes:
        # Unit-scale random values keep the chained products finite (and, unlike zeros or
        # ones, exercise the matrix units at their usual power).
        key = jax.random.PRNGKey(size)
        a = jax.device_put(
            (jax.random.normal(key, (size, size)) / size ** 0.5).astype(dtype), device)
        seconds = _per_call_s(_unrolled(lambda c, a=a: c @ a), a, iters, warmup, repeats)
        out.append((size, 2.0 * size ** 3 / seconds))
    return out


def measure_copy_bandwidth(device, nbytes: int, *, warmup: int = 2, repeats: int = 5,
                           iters: int = 8) -> float:
    """Bytes/s of an elementwise pass over ``nbytes`` (each byte read once and written once)."""
    import jax
    import jax.numpy as jnp

    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)
    seconds = _per_call_s(_looped(lambda c: c * 0.5 + 1.0), x, iters, warmup, repeats)
    return 2.0 * x.nbytes / seconds


def _sizes(min_bytes: int, max_bytes: int) -> list[int]:
    if not 0 < min_bytes < max_bytes:
        raise ProfileError(f"the message range must satisfy 0 < min_bytes < max_bytes; got "
                           f"{min_bytes} and {max_bytes}")
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= 4
    if sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


def profile(mesh, *, base=None, min_bytes: int = 2**10, max_bytes: int = 2**26,
            matmul_sizes=None, dtypes=("bfloat16", "float32"), warmup: int = 2,
            repeats: int = 5, verbose: bool = True) -> HardwareProfile:
    """Measure the live backend on ``mesh`` and return a fitted :class:`HardwareProfile`.

    Args:
      mesh: a ``jax.sharding.Mesh`` or a dict such as ``{"data": 2, "model": 4}``; its axis
        names key the measured collective fits, which price plans on meshes with those names.
      base: the profile whose unmeasured fields (capacity, interconnect levels for other axis
        names) are kept; default: the current backend's built-in profile.
      min_bytes / max_bytes: the collective message range (per device), stepped by 4x.
      matmul_sizes: square matmul sizes; default by platform.
      dtypes: matmul dtypes to measure.
      warmup / repeats: untimed and timed runs per measurement (the least time is kept).
      verbose: print progress to stderr.

    Example::

      prof = autopar.profile({"data": 2, "model": 4})
      open("my_gpu.json", "w").write(prof.to_json())
      plan = autopar.plan(step, *args, mesh={"data": 2, "model": 4}, hardware="my_gpu.json")
    """
    import jax.numpy as jnp

    from autopar._mesh import as_auto_mesh

    say = (lambda m: print(f"[autopar profile] {m}", file=sys.stderr, flush=True)) if verbose \
        else (lambda m: None)
    jax_mesh = as_auto_mesh(mesh)
    if not all(jax_mesh.shape[a] > 1 for a in jax_mesh.axis_names):
        raise MeshError(f"every mesh axis must have more than one device to measure its "
                        f"collectives; got {dict(jax_mesh.shape)}")
    base = get_profile(base)
    device = jax_mesh.devices.flat[0]
    sizes = _sizes(min_bytes, max_bytes)
    if matmul_sizes is None:
        matmul_sizes = _CPU_MATMUL_SIZES if device.platform == "cpu" \
            else _ACCELERATOR_MATMUL_SIZES

    peaks, curve = dict(base.peak_flops_per_s), ()
    for i, name in enumerate(dtypes):
        say(f"matmul {name}: sizes {list(matmul_sizes)}")
        rates = measure_matmul(device, jnp.dtype(name), matmul_sizes, warmup=warmup,
                               repeats=repeats)
        best = max(r for _, r in rates)
        peaks[jnp.dtype(name).name] = best
        say(f"  best {best / 1e9:.1f} GFLOP/s")
        if i == 0:
            curve = tuple((s, r / best) for s, r in rates)
    say("memory bandwidth")
    hbm = measure_copy_bandwidth(device, 2**24 if device.platform == "cpu" else 2**30,
                                 warmup=warmup, repeats=repeats)
    say(f"  {hbm / 1e9:.1f} GB/s")

    fits = []
    kinds = list(CollectiveKind)
    total = len(kinds) * len(jax_mesh.axis_names)
    done = 0
    for axis in jax_mesh.axis_names:
        n = jax_mesh.shape[axis]
        for kind in kinds:
            done += 1
            say(f"[{done}/{total}] {kind.value} over `{axis}` ({n} devices), "
                f"{len(sizes)} sizes {sizes[0]}..{sizes[-1]} B")
            wires, times = measure_collective(kind, axis, jax_mesh, sizes, warmup=warmup,
                                              repeats=repeats)
            latency_s, bandwidth = fit_alpha_beta(kind, n, wires, times)
            say(f"  latency {latency_s * 1e6:.2f} us/step, bandwidth {bandwidth / 1e9:.2f} GB/s")
            fits.append((axis, kind.value, latency_s, bandwidth))
    return dataclasses.replace(
        base, name=f"{base.name}-profiled", peak_flops_per_s=peaks,
        hbm_bandwidth_bytes_per_s=hbm, matmul_efficiency=1.0, matmul_curve=curve,
        # Measured as XLA runs them: float32 at the default precision, bandwidth as reached.
        float32_matmul="float32", hbm_efficiency=1.0,
        collective_fits=tuple(fits))
