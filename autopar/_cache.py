"""The on-disk plan cache of :func:`autopar.parallelize` (``cache_dir=``).

A restart should not solve the ILP again. An entry holds the solved strategy index of every
node of the planned program and the layers it rematerializes, keyed by the function (module,
name and source), the mesh, the hardware, the input signature, the static arguments, the
planning options and the autopar version. Loading re-traces the function and re-emits the program with the stored choice, which
skips the solve (the slow part). An entry whose program no longer matches (its graph
fingerprint differs), or a file that does not parse, is ignored with a
:class:`StalePlanCacheWarning`, and the function is planned again.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import warnings
from autopar.errors import StalePlanCacheWarning

FORMAT_VERSION = 1
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


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
    target = inspect.unwrap(fn)
    try:
        return inspect.getsource(target)
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)
        return repr(code.co_code) if code is not None else repr(target)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("autopar")
    except PackageNotFoundError:  # not installed as a distribution (a source checkout)
        return "dev"


class PlanCache:
    """Plans stored as JSON files in ``directory`` (created if missing)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)

    def key(self, fn, mesh, hardware, signature, static, options: dict) -> str:
        mesh_desc = (tuple(mesh.axis_names), tuple(mesh.devices.shape),
                     mesh.devices.flat[0].platform) if hasattr(mesh, "devices") else mesh
        material = repr((getattr(fn, "__module__", ""), getattr(fn, "__qualname__", ""),
                         _source_of(fn), mesh_desc, repr(hardware), repr(signature),
                         repr(static), sorted((k, repr(v)) for k, v in options.items()),
                         _version(), FORMAT_VERSION))
        # Object addresses (the functions inside a TrainState's tree structure, say) change on
        # every run; keyed by them, a restart would never find its plan. Dropping them is safe:
        # a cached choice only picks shardings, the program is always traced afresh.
        return hashlib.sha256(_ADDRESS.sub("", material).encode()).hexdigest()[:32]

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"plan-{key}.json")

    def load(self, key: str) -> dict | None:
        """The stored entry, or None (missing; or unreadable, with a warning)."""
        path = self._path(key)
        if not os.path.exists(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                entry = json.load(f)
            if (entry.get("format_version") != FORMAT_VERSION or entry.get("key") != key
                    or not all(isinstance(c, int) for c in entry["choice"])
                    or not isinstance(entry["fingerprint"], str)):
                raise ValueError("unexpected contents")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            warnings.warn(f"autopar: ignoring the corrupted plan cache entry {path} ({e}); "
                          "planning again", StalePlanCacheWarning, stacklevel=3)
            return None
        return entry

    def store(self, key: str, plan) -> None:
        choice = plan._details[2]
        entry = {"format_version": FORMAT_VERSION, "key": key,
                 "fingerprint": graph_fingerprint(plan._details[0]),
                 "choice": [int(c) for c in choice], "remat": plan.stats.get("remat")}
        tmp = self._path(key) + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(entry, f)
        os.replace(tmp, self._path(key))

    @staticmethod
    def stale(path_hint: str) -> None:
        warnings.warn(f"autopar: the cached plan {path_hint} no longer matches the program; "
                      "planning again", StalePlanCacheWarning, stacklevel=3)
