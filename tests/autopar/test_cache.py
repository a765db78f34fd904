"""The plan cache of ``autopar.parallelize(cache_dir=...)`` cannot be fooled and cannot crash a
step: a corrupted, foreign, unreadable or odd entry is a StalePlanCacheWarning and a fresh
plan, and a folder that cannot be made or written an UnusableCacheDirWarning and a plan not
cached (``autopar/_cache.py``)."""

import json
import os
import shutil
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autopar
from autopar._cache import PlanCache, _checksum
from autopar._mesh import as_auto_mesh
from autopar.errors import PlanCacheWarning, StalePlanCacheWarning, UnusableCacheDirWarning

MESH = {"data": 2, "model": 4}
W, X = jnp.ones((16, 16)) * 0.1, jnp.arange(32 * 16.0).reshape(32, 16) / 100


def update(w, x):
    return w - 0.1 * (x.T @ jnp.tanh(x @ w))


def _step(cache_dir, **kw):
    return autopar.parallelize(update, mesh=MESH, hardware="h100", cache_dir=cache_dir, **kw)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A folder holding the entry of ``_step`` and the result it computes."""
    folder = tmp_path_factory.mktemp("cache")
    step = _step(folder)
    want = np.asarray(step(W, X))
    [entry] = list(folder.glob("plan-*.json"))
    return entry, want


def _resealed(doc: dict) -> str:
    doc = dict(doc)
    doc["checksum"] = _checksum(doc)
    return json.dumps(doc)


def _fresh_plan_with_a_warning(folder, want, match, kinds=(StalePlanCacheWarning,)):
    """A fresh plan, with warnings of exactly ``kinds`` (one matching ``match``)."""
    step = _step(folder)
    with pytest.warns(PlanCacheWarning, match=match) as record:
        got = step(W, X)
    cache_warnings = [w for w in record if issubclass(w.category, PlanCacheWarning)]
    assert {w.category for w in cache_warnings} == set(kinds)
    # attributed to the caller's line (here), not to autopar's code
    assert {w.filename for w in cache_warnings} == {__file__}
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    assert step.plans_made == 1 and step.plans_loaded == 0


def test_an_intact_entry_is_used(stored, tmp_path):
    entry, want = stored
    shutil.copy(entry, tmp_path / entry.name)
    step = _step(tmp_path)
    np.testing.assert_allclose(np.asarray(step(W, X)), want, rtol=1e-6)
    assert step.plans_loaded == 1 and step.plan.stats["source"] == "cached"
    assert repr(step) == ("autopar.parallelize(update, mesh=data=2 x model=4): 0 plan(s) made, "
                          "1 loaded from the plan cache")
    # the report says so, rather than reading as an ILP of no variables
    (planner,) = [line for line in step.plan.report().splitlines() if line.startswith("Planner")]
    assert "the plan cache's plan (no ILP solved)" in planner and "variables" not in planner


def _all_zeros(doc):
    return _resealed({**doc, "choice": [0] * len(doc["choice"])})


#: name -> what is written in place of the entry (given its JSON), and the warning's words.
CORRUPTIONS = {
    "not json": (lambda doc: "{not json", "corrupted"),
    "null": (lambda doc: "null", "corrupted"),
    "a list": (lambda doc: "[]", "corrupted"),
    "deep nesting": (lambda doc: "[" * 200_000 + "]" * 200_000, "corrupted"),
    "binary": (lambda doc: b"\xff\xfe\x00\x81", "corrupted"),
    "edited without its checksum": (lambda doc: json.dumps({**doc, "choice": [0] * len(
        doc["choice"])}), "checksum"),
    "bad remat": (lambda doc: _resealed({**doc, "remat": {"layers": 3, "policy": "x"}}),
                  "corrupted"),
    "bad remat policy": (lambda doc: _resealed({**doc, "remat": {"layers": None,
                                                                 "policy": "x"}}),
                         "corrupted"),
    "choice out of range": (lambda doc: _resealed({**doc, "choice": [10**6] * len(
        doc["choice"])}), "does not fit"),
    "all-zero choice": (_all_zeros, "not the plan it was solved as"),
    "another key": (lambda doc: _resealed({**doc, "key": "0" * 32}), "corrupted"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_a_corrupted_entry_warns_and_plans_afresh(stored, tmp_path, name):
    entry, want = stored
    make, match = CORRUPTIONS[name]
    data = make(json.loads(entry.read_text()))
    path = tmp_path / entry.name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    _fresh_plan_with_a_warning(tmp_path, want, match)


def test_an_entry_solved_under_other_hints_is_not_taken(stored, tmp_path):
    """The entry of the same function under other hints, its key (and checksum) rewritten to
    this key's: its choice does not give the plan it recorded here."""
    entry, want = stored
    other = _step(tmp_path / "other", in_shardings=(P("model"), P("data")))
    other(W, X)
    [theirs] = list((tmp_path / "other").glob("plan-*.json"))
    assert theirs.name != entry.name  # the hints are part of the key
    doc = json.loads(theirs.read_text())
    (tmp_path / entry.name).write_text(_resealed({**doc, "key": entry.name[5:-5]}))
    _fresh_plan_with_a_warning(tmp_path, want,
                               "not the plan it was solved as|no longer matches|does not fit")


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_folder_or_fifo_in_place_of_the_entry_never_blocks(stored, tmp_path, kind):
    entry, want = stored
    path = tmp_path / entry.name
    path.mkdir() if kind == "folder" else os.mkfifo(path)
    kinds = ((StalePlanCacheWarning, UnusableCacheDirWarning) if kind == "folder"
             else (StalePlanCacheWarning,))
    failures = []

    def run():
        try:
            # the entry cannot be read (ignored); a fresh plan replaces a FIFO, not a folder
            _fresh_plan_with_a_warning(tmp_path, want, "cannot read|cannot write", kinds)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failures.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive(), "opening the entry blocked"
    if failures:
        raise failures[0]


def test_a_cache_dir_that_is_a_file_warns_and_the_step_still_runs(tmp_path):
    path = tmp_path / "not_a_folder"
    path.write_text("x")
    with pytest.warns(UnusableCacheDirWarning, match="cannot use `cache_dir`") as record:
        step = _step(path)
    assert record[0].filename == __file__ and len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(W, X)
    assert step.plans_made == 1


def test_an_unwritable_folder_warns_and_the_step_still_runs(tmp_path, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    step = _step(tmp_path)
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.warns(UnusableCacheDirWarning, match="cannot write") as record:
        step(W, X)
    assert not [w for w in record if issubclass(w.category, StalePlanCacheWarning)]
    assert step.plans_made == 1 and not list(tmp_path.glob("plan-*"))


def _key(**options):
    base = dict(in_shardings=None, memory_budget=None, remat=True, time_limit_s=300.0,
                search=True)
    mesh = options.pop("mesh", as_auto_mesh(MESH))
    hardware = options.pop("hardware", "h100")
    return PlanCache.key(PlanCache.__new__(PlanCache), update, mesh, hardware, "signature", (),
                         {**base, **options})


@pytest.mark.parametrize("change", [
    {"in_shardings": (P("data"), None)}, {"memory_budget": 10**9}, {"remat": False},
    {"time_limit_s": 5.0}, {"search": False}, {"hardware": "tpu-v5e"},
    {"mesh": jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("data", "model"))},
    {"mesh": as_auto_mesh({"data": 4, "model": 2})},
])
def test_the_key_covers_what_the_plan_was_solved_under(change):
    assert _key() == _key()
    assert _key(**change) != _key()


def _factory(scale):
    def step(w, x):
        return w * scale, x @ w
    return step


def test_the_key_covers_what_the_function_closes_over():
    """Two closures of one source (a factory's train step made with two configs) key apart,
    so each keeps its own entry; made alike, they share it. Arrays key by shape and dtype
    (nothing is read from them), and a set by its members, whatever the hash seed."""
    def key(fn):
        return PlanCache.key(PlanCache.__new__(PlanCache), fn, as_auto_mesh(MESH), "h100",
                             "signature", (), {})
    assert key(_factory(1.0)) == key(_factory(1.0)) != key(_factory(2.0))
    assert key(_factory(jnp.ones((4, 4)))) == key(_factory(jnp.zeros((4, 4))))
    assert key(_factory(jnp.ones((4, 4)))) != key(_factory(jnp.ones((4, 2))))
    from autopar._cache import _captured
    assert "array(4, 4):float32" in _captured(_factory(jnp.ones((4, 4))))
    assert _captured(_factory({"b", "a", "c"})) == _captured(_factory({"c", "b", "a"}))
    said = _captured(_factory({"c", "b", "a"}))   # its members in sorted order
    assert said.index("a") < said.index("b") < said.index("c")
