"""The on-disk plan cache of :func:`autopar.parallelize` (``cache_dir=``).

A restart should not solve the ILP again. An entry holds the solved strategy index of every
node of the planned program and the layers it rematerializes. Its key covers everything the
plan was solved under: the function (module, name, source, and the values it closes over and
its defaults), the mesh and its devices, the hardware profile, the input signature and the
shardings typed into it, the static arguments, every planning option (hints, memory budget,
remat, time limit, ...), and the versions of autopar (its sources too) and jax. Loading
re-traces the function and re-emits the program with the stored choice, which skips the solve
(the slow part).

An entry is used only when it is this key's (its ``solved_under`` digest), it is intact (its
checksum), its program is this one (the graph fingerprint) and its choice gives the plan it
recorded (the predicted step time and peak). Anything else, or any I/O problem (a read-only
folder, a folder or FIFO where an entry should be, a file too deeply nested to parse), is a
warning and a fresh plan, never an exception in the user's step: a
:class:`StalePlanCacheWarning` for an entry ignored, an :class:`UnusableCacheDirWarning` for a
folder or an entry that cannot be made or written (the plan is then not cached).
Opening an entry never blocks (``O_NONBLOCK``, then only regular files are read).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import math
import os
import re
import stat
import tempfile
from collections.abc import Callable

import jax

from autopar._mesh import on_explicit_axes
from autopar.errors import AutoparError, StalePlanCacheWarning, UnusableCacheDirWarning, warn
from autopar.passes.pipeline import Remat

FORMAT_VERSION = 2
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
#: An entry larger than this is not a plan this cache wrote (one int per node).
MAX_ENTRY_BYTES = 64 * 2**20
#: How close a re-emitted plan's predictions must be to the entry's.
ESTIMATE_RTOL = 1e-6


#: dtype -> its name (str() of a numpy dtype is slow).
_DTYPE_NAMES: dict = {}


def dtype_name(dtype) -> str:
    """``str(dtype)``, made once per dtype: graph fingerprints and call signatures name every
    value's."""
    return _DTYPE_NAMES.get(dtype) or _DTYPE_NAMES.setdefault(dtype, str(dtype))


def graph_fingerprint(graph) -> str:
    """A hash of the planned program's structure: every node's primitive and value shapes."""
    h = hashlib.sha256()
    values = graph.values
    for node in graph.nodes:
        shapes = [(values[v].shape, dtype_name(values[v].dtype)) for v in node.outs]
        h.update(repr((node.prim, node.kind.value, shapes)).encode())
    return h.hexdigest()


def _source_of(fn) -> str:
    """``fn``'s source and, where it has one, its code (two lambdas on one line share their
    source line, not their code)."""
    target = inspect.unwrap(fn)
    code = getattr(target, "__code__", None)
    compiled = "" if code is None else repr((code.co_code, code.co_consts, code.co_names))
    try:
        return inspect.getsource(target) + compiled
    except (OSError, TypeError):
        return compiled or repr(target)


def _captured(fn) -> str:
    """What ``fn`` closes over and its default arguments, as text: two closures of one source
    (``make_train_step(config)`` called with two configs) key apart. Arrays are named by shape
    and dtype, not read (a closure over the parameters would copy them to the host); a value
    whose text cannot be made counts as its type."""
    target = inspect.unwrap(fn)
    values = [getattr(target, "__defaults__", None), getattr(target, "__kwdefaults__", None)]
    for cell in getattr(target, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:   # a cell not yet filled
            values.append(None)
    out = []
    for value in values:
        try:
            out.append(repr(jax.tree_util.tree_map(_array_named, value)))
        except Exception:  # noqa: BLE001 (any object's repr may fail; the key must not)
            out.append(type(value).__qualname__)
    return repr(out)


def _array_named(leaf):
    """An array leaf as its shape and dtype, a set in sorted order (its text would follow the
    process's hash seed), anything else as it is."""
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is not None and dtype is not None:
        return f"array{tuple(shape)}:{dtype}"
    return sorted(map(repr, leaf)) if isinstance(leaf, (set, frozenset)) else leaf


@functools.lru_cache(maxsize=1)
def _autopar_version() -> str:
    """The installed version and a hash of autopar's own sources (a source checkout keeps its
    version number while its planner changes)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        number = version("autopar")
    except PackageNotFoundError:  # not installed as a distribution (a source checkout)
        number = "dev"
    h = hashlib.sha256()
    root = os.path.dirname(os.path.abspath(__file__))
    for folder, dirs, files in sorted(os.walk(root, followlinks=True)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return f"{number}+{h.hexdigest()[:16]}"


def _mesh_of(mesh) -> tuple:
    devices = list(mesh.devices.flat)
    return (tuple(mesh.axis_names), tuple(mesh.devices.shape), tuple(d.id for d in devices),
            devices[0].platform, getattr(devices[0], "device_kind", ""))


def _typed_shardings(args) -> tuple:
    """The shardings that are part of the arguments' types (Explicit mesh axes): they change
    the traced program. Other placements do not, and are left out of the key."""
    return tuple((i, str(x.sharding.spec), tuple(x.sharding.mesh.axis_names))
                 for i, x in enumerate(jax.tree_util.tree_leaves(args)) if on_explicit_axes(x))


def _warn(message: str) -> None:
    warn(f"autopar: {message}; planning afresh", StalePlanCacheWarning)


class PlanCache:
    """Plans stored as JSON files in ``directory`` (created if missing). A directory that
    cannot be made or used gives a warning, and a cache that stores and finds nothing."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.path.expanduser(os.fspath(directory))
        self.usable = True
        try:
            os.makedirs(self.directory, exist_ok=True)
        except (OSError, ValueError) as e:
            self.usable = False
            warn(f"autopar: cannot use `cache_dir` {self.directory!r} ({e}); plans will not be "
                 "cached: give a folder you can write to", UnusableCacheDirWarning)

    def key(self, fn, mesh, hardware, signature, static, options: dict, args=()) -> str:
        """The entry's name: a digest of what the plan is solved under (see the module's
        docstring). ``args``: the call's array arguments (their typed shardings)."""
        return hashlib.sha256(self._material(fn, mesh, hardware, signature, static, options,
                                             args).encode()).hexdigest()[:32]

    @staticmethod
    def _material(fn, mesh, hardware, signature, static, options, args) -> str:
        mesh_desc = _mesh_of(mesh) if hasattr(mesh, "devices") else mesh
        material = repr((getattr(fn, "__module__", ""), getattr(fn, "__qualname__", ""),
                         _source_of(fn), _captured(fn), mesh_desc, repr(hardware),
                         repr(signature),
                         _typed_shardings(args), repr(static),
                         sorted((k, repr(v)) for k, v in options.items()),
                         _autopar_version(), jax.__version__, FORMAT_VERSION))
        # Object addresses (the functions inside a TrainState's tree structure, say) change on
        # every run; keyed by them, a restart would never find its plan. Dropping them is safe:
        # a cached choice only picks shardings, the program is always traced afresh.
        return _ADDRESS.sub("", material)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"plan-{key}.json")

    def lookup(self, key: str, replan: Callable):
        """The plan of entry ``key``, re-emitted by ``replan(choice, remat)`` and verified;
        None when there is none (missing, or unusable: then with a warning)."""
        entry = self._read(key)
        if entry is None:
            return None
        try:
            plan = replan(entry["choice"], entry["remat"])
        except (AutoparError, ValueError, TypeError, KeyError, IndexError) as e:
            _warn(f"the cached plan {self._path(key)} does not fit the program "
                  f"({type(e).__name__}: {e})")
            return None
        problem = _mismatch(entry, plan)
        if problem:
            _warn(f"the cached plan {self._path(key)} {problem}")
            return None
        return plan

    def _read(self, key: str) -> dict | None:
        """The entry of ``key``, checked; None when missing, or unusable (with a warning)."""
        if not self.usable:
            return None
        path = self._path(key)
        try:
            text = _read_regular(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            _warn(f"cannot read the plan cache entry {path} ({e})")
            return None
        try:
            entry = json.loads(text)
            _check_entry(entry, key)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            _warn(f"ignoring the corrupted plan cache entry {path} ({type(e).__name__}: "
                  f"{str(e)[:200]})")
            return None
        return entry

    def store(self, key: str, plan) -> None:
        """Writes ``plan``'s entry atomically; an I/O failure is a warning."""
        if not self.usable:
            return
        entry = {"format_version": FORMAT_VERSION, "key": key,
                 "fingerprint": graph_fingerprint(plan._details[0]),
                 "choice": [int(c) for c in plan._details[2]], "remat": plan.stats.get("remat"),
                 "estimate": {"step_time_s": plan.estimate.step_time_s,
                              "peak_memory_bytes": plan.estimate.peak_memory_bytes}}
        entry["checksum"] = _checksum(entry)
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".plan-", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(entry, f)
            os.replace(tmp, self._path(key))
            tmp = None
        except (OSError, ValueError) as e:
            warn(f"autopar: cannot write the plan cache entry {self._path(key)} ({e}); this "
                 "plan is not cached", UnusableCacheDirWarning)
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


def _read_regular(path: str) -> str:
    """The text of ``path`` when it is a regular file of at most :data:`MAX_ENTRY_BYTES`;
    opened without blocking (a FIFO would block a plain open), ValueError otherwise."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > MAX_ENTRY_BYTES:
            raise ValueError(f"{info.st_size} bytes, larger than any entry")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8")


def _checksum(entry: dict) -> str:
    body = {k: v for k, v in entry.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_entry(entry, key: str) -> None:
    """ValueError unless ``entry`` is an intact entry of ``key`` as :meth:`PlanCache.store`
    writes it."""
    if not isinstance(entry, dict):
        raise ValueError(f"a {type(entry).__name__}, not an object")
    if entry.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"format {entry.get('format_version')!r}, not {FORMAT_VERSION}")
    if entry.get("key") != key:
        raise ValueError("the entry of another key")
    if entry.get("checksum") != _checksum(entry):
        raise ValueError("its checksum does not match its contents")
    choice, estimate = entry.get("choice"), entry.get("estimate")
    if not isinstance(choice, list) or not all(_is_int(c) and c >= 0 for c in choice):
        raise ValueError("`choice` is not a list of strategy indices")
    if not isinstance(entry.get("fingerprint"), str):
        raise ValueError("`fingerprint` is not a string")
    if not isinstance(estimate, dict) or not all(
            isinstance(estimate.get(k), (int, float)) and not isinstance(estimate.get(k), bool)
            for k in ("step_time_s", "peak_memory_bytes")):
        raise ValueError("`estimate` is not the plan's predictions")
    if entry.get("remat") is not None:
        remat = entry["remat"]
        if not isinstance(remat, dict) or not (remat.get("layers") is None or (
                isinstance(remat["layers"], list)
                and all(isinstance(x, str) for x in remat["layers"]))):
            raise ValueError("`remat` is not a layer list and policy")
        Remat.from_dict(remat)


def _mismatch(entry: dict, plan) -> str | None:
    """Why ``plan`` (re-emitted from ``entry``'s choice) is not the plan the entry recorded;
    None when it is."""
    if graph_fingerprint(plan._details[0]) != entry["fingerprint"]:
        return "no longer matches the program"
    recorded = entry["estimate"]
    for name, now in (("step_time_s", plan.estimate.step_time_s),
                      ("peak_memory_bytes", plan.estimate.peak_memory_bytes)):
        if not math.isclose(now, recorded[name], rel_tol=ESTIMATE_RTOL, abs_tol=1e-12):
            return (f"predicts {name} {now!r} where it recorded {recorded[name]!r}: its choice "
                    "is not the plan it was solved as")
    return None
