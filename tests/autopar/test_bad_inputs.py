"""A few hundred malformed inputs, generated from tables, over the Python API (``plan``,
``parallelize``, ``Plan.load``) and the CLI (``autopar.cli.main``, in-process). Each is an
``AutoparError`` subclass (or one line and a non-zero exit) whose message names the argument.
Nearly all fail at the door, before anything is traced or planned."""

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar import cli
from autopar.models import mlp
from autopar.errors import (ArgumentError, AutoparError, CLIError, MeshError, PlanFormatError,
                            ShardingHintError, TracingError)


def fn(w, x):
    return jnp.tanh(x @ w).sum()


ARGS = (jnp.ones((16, 16)), jnp.ones((8, 16)))
MESH = {"data": 2, "model": 4}
DEVICES = jax.devices()


def _id(value, width=40):
    """A test id from a value's repr, without memory addresses (stable across processes)."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))[:width]


class Opaque:
    def __repr__(self):
        return "Opaque()"


#: option -> bad values; each must raise ArgumentError naming the option.
BAD_OPTIONS = {
    "memory_budget": [-1, 0, 0.5, -1e9, "abc", "12x", "-5GiB", "1e-3", "", "GiB", math.nan,
                      math.inf, True, False, [1], {}, b"1GiB", Opaque(), np.array([1, 2]),
                      1j],
    "time_limit_s": ["5", "", -1, 0, -0.5, math.nan, True, None, [5], {}, Opaque(), 1j,
                     np.array([1.0, 2.0])],
    "search": [None, 1, 0, "yes", "False", 0.0, [], Opaque()],
    "tie_state": [None, 1, "no", [], Opaque()],
    "baseline_seeds": [None, 1, "yes", {}, Opaque()],
    "check_memory": [1, "yes", [], 0.5, Opaque()],
    "verbose": [1, 2, "loud", [], Opaque()],
    "remat": ["dots", "everything", "", 1, None, [], 0.5, Opaque(), "DOTS_SAVEABLE"],
    "pipeline": ["manual", "", 1, True, {}, [], Opaque()],
    "overlap": ["no", 1, None, [], Opaque()],
    "batch_axes": [3, "batch", [], ["data", 3], Opaque()],
    "logical_axis_rules": ["batch", 5, [("batch",)], [1, 2], {"a": "b"}, [(1, "data")],
                           [("batch", "data", "x")], Opaque()],
    "axis_level_overrides": [["data"], "data", 5, {"nope": "dcn"}, {1: "dcn"}, Opaque()],
}

#: mesh -> each must raise MeshError naming the mesh.
BAD_MESHES = [
    {}, {"data": 0}, {"data": -1}, {"data": 2.0}, {"data": True}, {"data": "8"},
    {"data": None}, {1: 8}, {None: 8}, {("data",): 8}, {"データ": 8}, {"da ta": 8}, {"": 8},
    {"1data": 8}, {"data\n": 8}, {"d\x00": 8}, [8], [2, 4], 8, None, 2.5, Opaque(),
    "data=2,model", "data=two", "=8", "data=0", "data=8,data=8", "データ=8", "", "data=3",
    {"data": 16}, {"data": 3}, {"data": 2, "model": 2}, {"data": 64},
    Mesh(np.array([DEVICES[0]] * 8), ("data",)),
    Mesh(np.array([DEVICES[0], DEVICES[0], DEVICES[1], DEVICES[2]]).reshape(2, 2), ("a", "b")),
    Mesh(np.array([], dtype=object).reshape(0), ("data",)),
    Mesh(np.array(DEVICES), ("データ",)),
    Mesh(np.array(DEVICES), ("da ta",)),
]

_OTHER = Mesh(np.array(DEVICES).reshape(4, 2), ("data", "model"))
_REVERSED = Mesh(np.array(DEVICES[::-1]).reshape(2, 4), ("data", "model"))
_SUB = Mesh(np.array(DEVICES[:4]).reshape(2, 2), ("data", "model"))

#: in_shardings -> each must raise ShardingHintError naming in_shardings.
BAD_HINTS = [
    (P(1), None), (P(P.UNCONSTRAINED), None), (P(None, P.UNCONSTRAINED), None),
    (P(("data", 1)), None), (P(("data", P.UNCONSTRAINED)), None), (P(1.5), None),
    (P(None, None, "data"), None), ("data", None), (5, None), ([], None), (Opaque(), None),
    (P("nope"), None), (P("data", "data"), None), (P(("model", "data")), None),
    (None, None, None), [None], {"w": None}, (None, (None, None)),
    (NamedSharding(_OTHER, P("data")), None), (NamedSharding(_REVERSED, P("data")), None),
    (NamedSharding(_SUB, P("data")), None), (NamedSharding(_OTHER, P(None, "model")), None),
]


def _plan(**kw):
    return autopar.plan(fn, *ARGS, **{"mesh": MESH, "hardware": "h100", **kw})


@pytest.mark.parametrize("name, value", [(n, v) for n, vs in BAD_OPTIONS.items() for v in vs],
                         ids=lambda x: _id(x, 24))
def test_bad_option(name, value):
    with pytest.raises(ArgumentError) as info:
        _plan(**{name: value})
    assert f"`{name}`" in str(info.value)


@pytest.mark.parametrize("name, value", [(n, v) for n, vs in BAD_OPTIONS.items()
                                         for v in vs[:2]], ids=lambda x: _id(x, 24))
def test_bad_option_of_parallelize_is_refused_when_wrapping(name, value):
    with pytest.raises(ArgumentError) as info:
        autopar.parallelize(fn, mesh=MESH, **{name: value})
    assert f"`{name}`" in str(info.value)


@pytest.mark.parametrize("mesh", BAD_MESHES, ids=lambda x: _id(x, 30))
def test_bad_mesh(mesh):
    with pytest.raises(MeshError) as info:
        _plan(mesh=mesh)
    assert "mesh" in str(info.value)


@pytest.mark.parametrize("hints", BAD_HINTS, ids=lambda x: _id(x, 40))
def test_bad_hint(hints):
    with pytest.raises(ShardingHintError) as info:
        _plan(in_shardings=hints, out_shardings=None)
    assert "in_shardings" in str(info.value)


@pytest.mark.parametrize("hints", [P(1), P(P.UNCONSTRAINED), "x", NamedSharding(_OTHER, P("data"))],
                         ids=_id)
def test_bad_out_hint(hints):
    with pytest.raises(ShardingHintError) as info:
        _plan(out_shardings=hints)
    assert "out_shardings" in str(info.value)


@pytest.mark.parametrize("hardware", [3, b"x", Opaque(), "h999", "", "/nonexistent/p.json",
                                      [], 1.5])
def test_bad_hardware(hardware):
    with pytest.raises(AutoparError) as info:
        _plan(hardware=hardware)
    assert "hardware" in str(info.value)


@pytest.mark.parametrize("target", [None, 3, "fn", Opaque(), [fn]], ids=_id)
def test_not_a_function(target):
    with pytest.raises(ArgumentError, match="`fn`"):
        autopar.plan(target, *ARGS, mesh=MESH)


@pytest.mark.parametrize("args", [(), ({},), ([],), ((), {}), (None,)], ids=_id)
def test_no_array_arguments(args):
    with pytest.raises(ArgumentError, match="`example_args`"):
        autopar.plan(lambda *a: jnp.zeros(()), *args, mesh=MESH)


#: parallelize's own arguments -> bad values, each an ArgumentError naming the argument.
BAD_WRAPPING = {
    "static_argnums": ["a", -1, 2, 5, 1.0, [0, "b"], True, [None], Opaque()],
    "donate_argnums": ["a", -1, 2, 9, 0.5, [1, None], False, Opaque()],
    "static_argnames": [1, [1], "nope", ["w", "nope"], Opaque()],
    "cache_dir": [3, 1.5, Opaque(), [], b"/tmp"],
}


@pytest.mark.parametrize("name, value", [(n, v) for n, vs in BAD_WRAPPING.items()
                                         for v in vs], ids=lambda x: _id(x, 24))
def test_bad_parallelize_argument(name, value):
    with pytest.raises(ArgumentError) as info:
        autopar.parallelize(fn, mesh=MESH, **{name: value})
    assert f"`{name}`" in str(info.value)


def test_unknown_option_of_parallelize():
    with pytest.raises(ArgumentError, match="`time_limit`"):
        autopar.parallelize(fn, mesh=MESH, time_limit=5)


@pytest.mark.parametrize("value, bytes_", [(np.int64(10**9), 10**9), ("1e9", 10**9),
                                           (np.float32(2**20), 2**20), ("1.5GiB", 3 * 2**29),
                                           (1, 1), ("1 B", 1)])
def test_valid_budgets_are_taken(value, bytes_):
    from autopar._inputs import memory_budget_bytes
    assert memory_budget_bytes(value) == bytes_


def test_a_one_byte_budget_prints_bytes_not_zero_mib():
    with pytest.raises(autopar.InfeasiblePlanError) as info:
        _plan(memory_budget=1, remat=False)
    assert "`memory_budget` = 1 B" in str(info.value) and "0.0 MiB" not in str(info.value)


def test_a_named_sharding_on_an_equal_mesh_is_translated():
    same = Mesh(np.array(DEVICES).reshape(2, 4), ("data", "model"),
                axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    plan = _plan(in_shardings=(NamedSharding(same, P(None, "model")), None))
    assert plan.in_shardings[0].spec == P(None, "model")


# ----- Plan.load of any file


@pytest.fixture(scope="module")
def saved():
    """A valid plan's JSON, as a dict."""
    plan = autopar.plan(fn, *ARGS, mesh=MESH, hardware="cpu", in_shardings=(P("data"), None))
    return json.loads(plan.to_json())


BAD_FILES = [b"null", b"[]", b"3", b"-1.5", b'"plan"', b"true", b"", b"{", b"\xff\xfe\x00\x81",
             b"{}", b'{"format_version": 1}', b'{"format_version": 2}',
             b'{"format_version": "1"}', b"[" * 100_000, b"\x00" * 64, "{\"é\": 1}".encode()]
BAD_VALUES = [None, "x", 3, -1, [], {}, [None], {"a": 1}, True, [[1, 2]]]
#: field -> the values a plan file may hold there (not errors).
VALID = {"pipeline": [None], "hardware": ["x"], "stats": [{}, {"a": 1}],
         "fallbacks": [{}, {"a": 1}], "donate_argnums": [[]], "in_shardings": [[]],
         "out_shardings": [[]]}
FIELDS = ["mesh", "hardware", "estimate", "in_shardings", "out_shardings", "donate_argnums",
          "fallbacks", "stats", "pipeline", "explained"]
#: Deeper edits: a path into the JSON and a bad value there.
DEEP = [(("mesh", "axis_names"), v)
        for v in ([1], ["データ"], [], ["a", "b"], "data", [None])] + [
    (("mesh", "axis_sizes"), v) for v in ([0], [-8], [8.0], [True], [4], "8", [2, 2, 2])] + [
    (("mesh", "device_ids"), v) for v in ([0] * 8, [99] * 8, list(range(4)), "0", [0.0] * 8)
] + [
    (("estimate", "step_time_s"), v) for v in (None, "1", [], True)] + [
    (("estimate", "nope"), 1.0)] + [
    (("in_shardings", 0, "spec"), v) for v in ("data", 3, [1], ["nope"], ["data", "data"],
                                               [["data", 1]], None, {"a": 1})] + [
    (("in_shardings", 0, "path"), v) for v in (None, 3, [])] + [
    (("stats", "timings_s"), v) for v in ("x", 3, [1])] + [
    (("stats", "compiler_options"), v) for v in ("x", [1], [{"a": 1}])] + [
    (("stats", "remat"), v) for v in ("x", [1], {"layers": 3})] + [
    (("explained", "in_words"), v) for v in ("x", [1], None)] + [
    (("explained", "axis_words"), v) for v in ([], {"data": 1})] + [
    (("explained", "layer_inputs"), v) for v in ("x", [None])] + [
    (("explained", "layers", 0, "compute_s"), v) for v in (-1.0, "1", None, True)] + [
    (("explained", "layers", 0, "params"), v)
    for v in ("x", [{"path": "not an input", "shape": [1], "local_shape": [1]}])] + [
    (("explained", "layers", 0, "rewrites"), v) for v in ([], {"a": -1})] + [
    (("explained", "collectives", 0, "count"), v) for v in (-1, 1.5, None)] + [
    (("explained", "collectives", 0, "kind"), v) for v in (1, None)] + [
    (("explained", "memory", "phases"), v) for v in ([["nope", 1]], [["forward"]], [])] + [
    (("explained", "memory", "peak_at"), v) for v in (10**9, -1, None)] + [
    (("explained", "memory", "live"), v) for v in ("x", [1.5], [True])] + [
    (("explained", "memory", "buffers"), v) for v in ([[1, 2]], [[1, 2, 3]], "x")]


def _write(tmp_path, data) -> str:
    path = tmp_path / "plan.json"
    path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    return str(path)


@pytest.mark.parametrize("data", BAD_FILES, ids=lambda x: _id(x, 20))
def test_load_of_a_file_that_is_no_plan(tmp_path, data):
    with pytest.raises(PlanFormatError, match="plan"):
        autopar.Plan.load(_write(tmp_path, data))


@pytest.mark.parametrize("field, value", [(f, v) for f in FIELDS for v in BAD_VALUES
                                          if v not in VALID.get(f, [])],
                         ids=lambda x: _id(x, 20))
def test_load_of_a_broken_field(tmp_path, saved, field, value):
    with pytest.raises(PlanFormatError) as info:
        autopar.Plan.load(_write(tmp_path, {**saved, field: value}))
    assert "plan" in str(info.value) or field in str(info.value)


@pytest.mark.parametrize("where, value", DEEP, ids=lambda x: _id(x, 24))
def test_load_of_a_broken_inner_field(tmp_path, saved, where, value):
    doc = json.loads(json.dumps(saved))
    inner = doc
    for key in where[:-1]:
        inner = inner[key]
    inner[where[-1]] = value
    with pytest.raises(AutoparError) as info:
        autopar.Plan.load(_write(tmp_path, doc))
    assert isinstance(info.value, (PlanFormatError, MeshError))


@pytest.mark.parametrize("edit, said", [
    (lambda e: e.pop("layers"), "`explained` (or an entry of it) lacks its 'layers'"),
    (lambda e: e["layers"].__setitem__(0, "x"), "`explained.layers[0]` is a str, not an object"),
    (lambda e: e.__setitem__("collectives", {}), "`explained.collectives` is a dict, not a list"),
])
def test_a_broken_explanation_is_named(tmp_path, saved, edit, said):
    doc = json.loads(json.dumps(saved))
    edit(doc["explained"])
    with pytest.raises(PlanFormatError, match=re.escape(said)):
        autopar.Plan.load(_write(tmp_path, doc))


def test_load_of_a_mesh_whose_sizes_disagree_with_its_devices_says_so(tmp_path, saved):
    doc = json.loads(json.dumps(saved))
    doc["mesh"]["axis_sizes"] = [4, 4]
    with pytest.raises(PlanFormatError, match=r"has 16 devices but names 8 device ids"):
        autopar.Plan.load(_write(tmp_path, doc))


def test_load_of_a_folder_or_a_missing_file(tmp_path):
    with pytest.raises(PlanFormatError, match="not a regular file|cannot read"):
        autopar.Plan.load(tmp_path)
    with pytest.raises(PlanFormatError, match="no plan file"):
        autopar.Plan.load(tmp_path / "missing.json")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(PlanFormatError, match="not a regular file"):
        autopar.Plan.load(tmp_path / "fifo")


def test_a_sub_mesh_plan_saves_and_loads(tmp_path):
    sub = Mesh(np.array(DEVICES[4:]).reshape(2, 2), ("data", "model"))
    plan = autopar.plan(fn, *ARGS, mesh=sub, hardware="cpu", in_shardings=(P("data"), None))
    plan.save(tmp_path / "sub.json")
    loaded = autopar.Plan.load(tmp_path / "sub.json")
    assert [d.id for d in loaded.mesh.devices.flat] == [4, 5, 6, 7]
    assert loaded.in_shardings[0].spec == P("data")
    assert loaded.to_json() == plan.to_json()


def test_a_plan_whose_devices_are_not_here_loads_to_be_read(tmp_path, saved):
    """Devices the process lacks (another host's ids): the plan loads on its axes without
    devices, says so, explains itself, and writes back the file it was read from."""
    doc = json.loads(json.dumps(saved))
    doc["mesh"]["device_ids"] = list(range(100, 108))
    path = _write(tmp_path, json.loads(json.dumps(doc)))
    with pytest.warns(autopar.HardwareWarning, match=r"runs on 8 devices, 8 of which \(ids 100, "
                      r"101, .*, 107\) are not in this process \(8 devices here\).*not to run\. "
                      r"To simulate 8 devices"):
        loaded = autopar.Plan.load(path)
    assert isinstance(loaded.mesh, jax.sharding.AbstractMesh)
    assert loaded.in_shardings[0].spec == P("data")
    assert "data=2 x model=4 (8 devices, not in this process)" in loaded.report()
    assert "Collectives chosen" in loaded.report()   # as saved: it has no program to trace
    page = loaded.to_html()
    assert "<h2>Per layer</h2>" in page and "input [0]" in page and "<h2>Mesh</h2>" in page
    # its memory chart as saved; and it points at no call it cannot make
    assert "<h2>Memory over the program</h2>" in page and "peak" in page
    assert "Not run before the plan was saved" in page and "plan.validate()" not in page
    assert json.loads(loaded.to_json()) == doc
    # its shardings are hints on a mesh of the same axes, and refused on another
    again = autopar.plan(fn, *ARGS, mesh=MESH, hardware="cpu",
                         in_shardings=(loaded.in_shardings[0], None))
    assert again.in_shardings[0].spec == P("data")
    with pytest.raises(ShardingHintError, match="on a mesh without devices"):
        autopar.plan(fn, *ARGS, mesh={"data": 8}, in_shardings=(loaded.in_shardings[0], None))


def test_a_plan_file_without_device_ids_loads_onto_the_first_devices(tmp_path, saved):
    doc = json.loads(json.dumps(saved))
    del doc["mesh"]["device_ids"]
    doc["mesh"]["axis_sizes"] = [2, 2]   # 4 of the 8 devices
    loaded = autopar.Plan.load(_write(tmp_path, doc))
    assert [d.id for d in loaded.mesh.devices.flat] == [0, 1, 2, 3]


def test_a_long_list_of_absent_device_ids_is_shortened():
    from autopar._plan import _ids
    assert _ids([4, 5]) == "ids 4, 5"
    assert _ids(list(range(1024))) == "ids 0, 1, 2, 3, 4, 5, 6, ... 1023 (1024 in all)"


_LOADS_ALONE = """
import sys
import autopar
plan = autopar.Plan.load(sys.argv[1])
print(repr(plan))
print(plan.report().splitlines()[0])
plan.to_python(sys.argv[2])
print(plan.to_json() == open(sys.argv[1]).read())
print(type(autopar.Plan.load(sys.argv[3]).mesh).__name__)
"""


def test_a_plan_made_on_8_devices_loads_in_a_process_of_one(tmp_path):
    """A plan saved where it was made reads back (report, summary, module) on a machine
    with one device, such as a laptop reading a cluster's plan."""
    import subprocess
    import sys
    path, module = tmp_path / "plan.json", tmp_path / "plan_specs.py"
    autopar.plan(fn, *ARGS, mesh=MESH, hardware="h100").save(path)
    doc = json.loads(path.read_text())
    del doc["mesh"]["device_ids"]
    bare = tmp_path / "bare.json"   # a file naming no device ids
    bare.write_text(json.dumps(doc))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, "-c", _LOADS_ALONE, str(path), str(module), str(bare)],
                         capture_output=True, text=True, env=env, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert "are not in this process (1 device here)" in run.stderr
    assert "runs on 8 devices, and this process has 1 device:" in run.stderr   # no ids
    lines = run.stdout.splitlines()
    assert lines[0].startswith("Plan(mesh=(data=2 x model=4), hardware='h100'")
    assert "(8 devices, 7 of them not in this process)" in lines[1]   # device 0 is here
    assert lines[-2:] == ["True", "AbstractMesh"]
    assert "MESH = {'data': 2, 'model': 4}" in module.read_text()
    # where some of its devices are here, the report says how many are not
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    run = subprocess.run([sys.executable, "-c", _LOADS_ALONE, str(path), str(module), str(bare)],
                         capture_output=True, text=True, env=env, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert "(8 devices, 4 of them not in this process)" in run.stdout.splitlines()[1]


# ----- the CLI, in-process


TARGET = '''
import sys
import jax.numpy as jnp
def ok():
    return (lambda x: (x * 2).sum()), (jnp.ones((8, 8)),)
def raises():
    def f(x):
        raise ValueError("inside the step")
    return f, (jnp.ones(8),)
def needs_args(n, scale=2):
    return (lambda x: (x * scale).sum()), (jnp.ones(n),)
def returns_text():
    return (lambda x: "text"), (jnp.ones(8),)
def exits():
    sys.exit(3)
def exits_while_traced():
    def f(x):
        sys.exit(4)
    return f, (jnp.ones(8),)
def fails():
    raise KeyError("no data")
def not_a_tuple():
    return [1, 2]
def args_not_a_tuple():
    return (lambda x: x), [jnp.ones(8)]
not_callable = 3
'''


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    (folder / "targets.py").write_text(TARGET)
    (folder / "targets.txt").write_text(TARGET)
    (folder / "exits_on_import.py").write_text("import sys\nsys.exit(5)\n")
    (folder / "a_folder").mkdir()
    from autopar.cost_model.hardware import get_profile
    (folder / "profile.json").write_text(get_profile("h100").to_json())
    (folder / "plan.json").write_text(json.dumps({"format_version": 1, "in_shardings": []}))
    return folder


def _cli(argv, capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors: one line
        code = e.code
    err = capsys.readouterr().err
    return code, err


def _report(target, name, *rest):
    return ["report", f"{target}/targets.py:{name}", "--mesh", "data=8", "--no-baselines",
            "--quiet", *rest]


#: (argv given the target folder, words the message must hold)
CLI_CASES = [
    (lambda t: _report(t, "raises"), "raises()"),
    (lambda t: _report(t, "returns_text"), "returns_text()"),
    (lambda t: _report(t, "exits"), "sys.exit(3)"),
    (lambda t: _report(t, "exits_while_traced"), "sys.exit(4)"),
    (lambda t: _report(t, "fails"), "fails()"),
    (lambda t: _report(t, "not_a_tuple"), "not_a_tuple()"),
    (lambda t: _report(t, "args_not_a_tuple"), "args_not_a_tuple()"),
    (lambda t: _report(t, "not_callable"), "not_callable"),
    (lambda t: _report(t, "missing"), "missing"),
    (lambda t: ["report", f"{t}/targets.txt:ok", "--mesh", "data=8"], "targets.txt"),
    (lambda t: ["report", f"{t}/exits_on_import.py:ok", "--mesh", "data=8"], "sys.exit(5)"),
    (lambda t: ["report", f"{t}/nope.py:ok", "--mesh", "data=8"], "nope.py"),
    (lambda t: ["report", f"{t}/a_folder:ok", "--mesh", "data=8"], "a_folder"),
    (lambda t: ["report", "no_such_module_here:f", "--mesh", "data=8"], "no_such_module_here"),
    (lambda t: ["report", f"{t}/targets.py", "--mesh", "data=8"], "FILE.py:NAME"),
    (lambda t: ["report", ":ok", "--mesh", "data=8"], "FILE.py:NAME"),
    (lambda t: _report(t, "ok", "--json", f"{t}/missing/plan.json"), "--json"),
    (lambda t: _report(t, "ok", "--json", f"{t}/a_folder"), "--json"),
    (lambda t: _report(t, "ok", "--html", f"{t}/missing/plan.html"), "--html"),
    (lambda t: _report(t, "ok", "--html", f"{t}"), "--html"),
    (lambda t: _report(t, "ok", "--hardware", "h999"), "hardware"),
    (lambda t: _report(t, "ok", "--hardware", f"{t}/none.json"), "none.json"),
    (lambda t: _report(t, "ok", "--memory-budget", "12x"), "--memory-budget"),
    (lambda t: _report(t, "ok", "--memory-budget", "0"), "--memory-budget"),
    (lambda t: _report(t, "ok", "--memory-budget", "-1"), "--memory-budget"),
    (lambda t: _report(t, "ok", "--time-limit", "0"), "--time-limit"),
    (lambda t: _report(t, "ok", "--time-limit", "-3"), "--time-limit"),
    (lambda t: _report(t, "ok", "--time-limit", "soon"), "--time-limit"),
    (lambda t: _report(t, "ok", "--time-limit", "nan"), "--time-limit"),
    (lambda t: _report(t, "ok", "--simulate-devices", "-1"), "--simulate-devices"),
    (lambda t: _report(t, "ok", "--simulate-devices", "0"), "--simulate-devices"),
    (lambda t: _report(t, "ok", "--simulate-devices", "x"), "--simulate-devices"),
    (lambda t: _report(t, "ok", "--remat", "sometimes"), "--remat"),
    (lambda t: _report(t, "ok", "--frobnicate"), "--frobnicate"),
    (lambda t: ["report", f"{t}/targets.py:ok"], "--mesh"),
    (lambda t: ["frobnicate"], "frobnicate"),
    (lambda t: _report(t, "ok", "--hardware", f"{t}/plan.json"), "a saved plan, not a hardware"),
    (lambda t: ["show", f"{t}/profile.json"], "`--hardware PATH`"),
    (lambda t: ["show", f"{t}/none.json"], "no plan file"),
    (lambda t: ["show", f"{t}/plan.json", "--html", f"{t}/missing/plan.html"], "--html"),
    (lambda t: ["show"], "plan"),
    (lambda t: _report(t, "needs_args"), "takes `n`, but a target is called with no"),
] + [
    (lambda t, m=m: ["report", f"{t}/targets.py:ok", "--mesh", m, "--no-baselines"], "mesh")
    for m in ("data=2,model", "data=two", "=8", "data=0", "data=8,data=8", "データ=8",
              "da ta=8", "", "data=-8", "data=64", "data=3", "data=2,model=2", ",")
] + [
    (lambda t, a=a: ["profile", "--mesh", "data=8", "--out", f"{t}/p.json", *a], a[0])
    for a in (("--repeats", "0"), ("--repeats", "-1"), ("--repeats", "x"),
              ("--min-bytes", "0"), ("--max-bytes", "-4"), ("--min-bytes", "1k"),
              ("--simulate-devices", "-1"), ("--min-bytes", "4096", "--max-bytes", "1024"))
] + [
    (lambda t, out=out: ["profile", "--mesh", "data=8", "--out", out(t)], "--out")
    for out in (lambda t: f"{t}/missing/p.json", lambda t: f"{t}/a_folder", lambda t: str(t))
] + [
    (lambda t, m=m: ["profile", "--mesh", m, "--out", f"{t}/p.json"], "mesh")
    for m in ("data", "data=x", "データ=8")
]


@pytest.mark.parametrize("case", range(len(CLI_CASES)))
def test_cli_bad_input_is_one_line(target, capsys, case):
    make, words = CLI_CASES[case]
    code, err = _cli(make(target), capsys)
    assert code not in (0, None), err
    assert "Traceback" not in err
    assert words.lower() in err.lower(), err
    lines = [line for line in err.splitlines() if line.startswith("autopar")]
    assert len(lines) == 1, err  # one error line


@pytest.mark.parametrize("where", ["before", "after"])
def test_cli_debug_anywhere_shows_the_traceback(target, where):
    argv = _report(target, "raises")
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    with pytest.raises(CLIError, match="inside the step"):
        cli.main(argv)


def test_cli_output_paths_are_checked_before_planning(target, capsys, monkeypatch):
    planned = []
    monkeypatch.setattr(autopar, "plan", lambda *a, **k: planned.append(1))
    code, err = _cli(_report(target, "ok", "--json", f"{target}/missing/plan.json"), capsys)
    assert code == 2 and not planned and "does not exist" in err


def test_cli_a_full_disk_is_one_line(target, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(cli, "open", full, raising=False)
    code, err = _cli(_report(target, "ok", "--json", f"{target}/plan.json"), capsys)
    assert code == 2 and "No space left" in err and "--json" in err and "Traceback" not in err


def test_cli_an_unexpected_error_is_one_line(target, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("XLA said no")
    monkeypatch.setattr(autopar, "plan", broken)
    code, err = _cli(_report(target, "ok"), capsys)
    assert code == 1 and "RuntimeError: XLA said no" in err and "--debug" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("change", ["shape", "dtype", "tree"])
def test_plan_jit_names_an_argument_not_as_planned(change):
    fn, args = mlp.make_train_step(mlp.TINY)
    plan = autopar.plan(fn, *args, mesh={"data": 8})
    run = plan.jit()
    run(*args)
    batch = args[-1]
    other = {"shape": jax.tree_util.tree_map(lambda a: a[:4], batch),
             "dtype": jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), batch),
             "tree": (batch,)}[change]
    with pytest.raises(ArgumentError, match="(?i)plan again") as info:  # not a plan file's
        run(*args[:-1], other)
    if change != "tree":
        assert "[2]['x']" in str(info.value) and "float32[8,16]" in str(info.value)


@pytest.mark.parametrize("n", [2.5, 0, -1, "8", True, None])
def test_simulate_cpu_devices_refuses_what_xla_would_abort_on(n):
    with pytest.raises(ArgumentError, match="positive int"):
        autopar.simulate_cpu_devices(n)


def _returns_text(w, x):
    return "done"


@pytest.mark.parametrize("call, words", [
    (lambda: autopar.plan(_returns_text, *ARGS, mesh=MESH), "`_returns_text`.*str"),
    (lambda: autopar.plan(fn, ARGS[0], mesh=MESH), "`fn`.*missing 1 required"),
    (lambda: autopar.plan(fn, ARGS[0], jnp.ones((8, 15)), mesh=MESH), "`fn`.*dot_general"),
    (lambda: autopar.parallelize(_returns_text, mesh=MESH)(*ARGS),
     r"`_returns_text`.*_returns_text at .*test_bad_inputs\.py:\d+.*str"),
])
def test_a_function_that_fails_to_trace_is_named(call, words):
    """The user's own error comes out as a TracingError naming their function, with their
    exception as its cause."""
    with pytest.raises(TracingError, match=words) as info:
        call()
    assert isinstance(info.value.__cause__, Exception)


def test_a_failure_in_autopar_code_while_tracing_is_called_autopar_s(monkeypatch):
    """autopar's own code that runs while the function traces (the pipeline's, inside
    ``autopar.value_and_grad``) failing is reported as autopar's bug, not the function's."""
    from autopar.passes.stages import split
    narrowed = split.narrowed_xs
    monkeypatch.setattr(split, "narrowed_xs", lambda stack: narrowed(None))

    def loss_fn(p, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p)
        return jnp.mean(h ** 2)

    def step(p, x):
        return autopar.value_and_grad(loss_fn)(p, x)

    with pytest.raises(TracingError, match=r"`step` failed inside autopar \(split\.py:\d+\).*"
                                           r"a bug in autopar"):
        autopar.plan(step, jnp.ones((4, 8, 8)), jnp.ones((16, 8)), mesh={"stage": 4, "data": 2},
                     pipeline=autopar.Pipeline(schedule="1f1b", microbatches=4))


def test_a_python_int_out_of_int32_is_refused_not_wrapped():
    step = autopar.parallelize(lambda x, n: x * n, mesh=MESH)
    assert int(step(jnp.ones((8,), jnp.int32), 3)[0]) == 3
    with pytest.raises(ArgumentError, match="3000000000, does not fit int32"):
        step(jnp.ones((8,), jnp.int32), 3_000_000_000)


def test_an_unknown_axis_in_a_hint_is_named_before_the_rank():
    with pytest.raises(ShardingHintError, match="names mesh axis `foo`"):
        _plan(out_shardings=P("foo"))


def test_to_python_into_a_missing_folder_and_of_a_lambda(tmp_path):
    plan = _plan()
    with pytest.raises(ArgumentError, match="cannot write the module"):
        plan.to_python(tmp_path / "missing" / "specs.py")
    text = plan.to_python(tmp_path / "specs.py", fn=lambda w, x: fn(w, x))
    assert "jax.jit(step," in text and "<lambda>" not in text


def test_a_missing_default_pipeline_axis_says_it_was_the_default():
    with pytest.raises(AutoparError, match="the default axis; give `axis=`"):
        _plan(pipeline=autopar.Pipeline(schedule="gpipe"))


@pytest.mark.parametrize("argv", [["report"], ["report", "x.py:f", "--mesh", "data=8",
                                                   "--memory-budget", "40gigs"],
                                  ["report", "x.py:f", "--mesh", "data=8", "--remat", "bogus"]])
def test_cli_argument_errors_are_one_line(argv, capsys):
    code, err = _cli(argv, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("autopar: error: ") and "--help" in err, err


def _cuda_installed() -> bool:
    import importlib.util
    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


#: A platform jax does not know, and (where its plugin is absent) one it knows but cannot
#: start, which jax reports as a bare AssertionError.
_UNSTARTABLE = ["bogus"] + ([] if _cuda_installed() else ["cuda"])


@pytest.mark.parametrize("platform", _UNSTARTABLE)
def test_cli_names_a_platform_jax_cannot_start(platform):
    import subprocess
    import sys
    env = {**os.environ, "JAX_PLATFORMS": platform}
    done = subprocess.run([sys.executable, "-m", "autopar.cli", "demo"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"JAX_PLATFORMS={platform}" in lines[0], done.stderr
