"""The public surface: Plan fields, JSON round trip, and the parallelize decorator."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import autopar
from autopar.models import gpt, mlp


def _step():
    return gpt.make_train_step(gpt.TINY)


def test_plan_fields_and_json_round_trip(tmp_path):
    fn, args = _step()
    plan = autopar.plan(fn, *args, mesh={"data": 8})
    leaves = jax.tree_util.tree_leaves(plan.in_shardings)
    assert len(leaves) == len(jax.tree_util.tree_leaves(args))
    assert all(isinstance(s, NamedSharding) for s in leaves)
    e = plan.estimate
    # the step is the timeline's makespan: at least the compute, at most compute plus every
    # collective, the communication it does not hide being the exposed part
    assert e.compute_time_s <= e.step_time_s <= e.compute_time_s + e.comm_time_s * (1 + 1e-9)
    assert e.step_time_s == pytest.approx(e.compute_time_s + e.exposed_comm_s)
    assert e.flops > 0
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded.estimate == plan.estimate
    assert [s.spec for s in jax.tree_util.tree_leaves(loaded.in_shardings)] == \
        [s.spec for s in leaves]
    assert loaded.in_paths == plan.in_paths
    # Its shardings come back flat; rebuilt as its docstring says, plain jax.jit takes them.
    ins = jax.tree.unflatten(jax.tree.structure(args), loaded.in_shardings)
    outs = jax.tree.unflatten(jax.tree.structure(jax.eval_shape(fn, *args)),
                              loaded.out_shardings)
    lowered = jax.jit(fn, in_shardings=ins, out_shardings=outs).lower(*args)
    assert lowered.compile() is not None
    # Its report is the one it was saved with (the plan in words, the per-layer table, the
    # collectives), but for the planner's wall-clock times, which it leaves out whole, and
    # its first line, which no longer offers to plan for other hardware.
    text, made = loaded.report().splitlines(), plan.report().splitlines()
    assert "Per layer (per device; optimizer state follows its parameter):" in text
    assert text[0] == ("autopar plan on mesh data=8 (8 devices), hardware profile "
                       f"`{plan.hardware}` (the default of the backend it was planned on)")
    assert [s for s in text[1:] if not s.startswith("Planner")] == [
        s for s in made[1:] if not s.startswith("Planner")]
    (planner,) = [line for line in text if line.startswith("Planner")]
    (planned,) = [line for line in made if line.startswith("Planner")]
    assert "times" not in planner and planned.startswith(planner + "; times trace")
    assert loaded.summary() == plan.summary()
    # its HTML page's memory chart is pooled to at most 512 points (this step has more
    # operations), and keeps the peak and the buffers live there
    def memory(page):
        section = page.split("<h2>Memory over the program</h2>")[1].split("<h2>")[0]
        return section.split("</svg>")
    (made_chart, made_rest), (chart, rest) = memory(plan.to_html()), memory(loaded.to_html())
    assert rest == made_rest and "The largest buffers live at the predicted peak" in rest
    assert chart.count(",") < made_chart.count(",")
    peak = made_chart.split("peak ")[1].split("<")[0]
    assert f"peak {peak}<" in chart
    # A per-layer table whose shapes its specs do not give (a hand-edited file) is refused.
    doc = json.loads(path.read_text())
    param = next(p for r in doc["explained"]["layers"] for p in r["params"])
    param["local_shape"] = [0] * len(param["shape"])
    with pytest.raises(autopar.PlanFormatError, match=f"parameter {re.escape(repr(param['path']))}"
                       " of shape .* is not split by its spec"):
        autopar.Plan.from_json(json.dumps(doc))
    # A file that kept no explanation (saved before it was kept) gives the shardings alone:
    # every leaf, under headings that say so.
    doc = json.loads(path.read_text())
    del doc["explained"]
    bare = autopar.Plan.from_json(json.dumps(doc))
    assert "Input shardings (every leaf: a plan loaded from JSON" in bare.report()
    assert "Per layer" not in bare.report() and "<h2>Shardings</h2>" in bare.to_html()
    assert bare.to_json() == json.dumps(doc, indent=1)
    # A plan shows itself in one line, whether made or loaded (not its graph and strategies).
    for shown in (repr(plan), str(plan), repr(loaded)):
        assert "\n" not in shown and len(shown) < 200
        assert shown.startswith("Plan(mesh=(data=8)") and plan.hardware in shown


def test_parallelize_plans_once_per_signature_and_matches_single_device():
    fn, (params, opt_state, batch) = _step()
    hint = jax.tree_util.tree_map(lambda _: jax.sharding.PartitionSpec("data"), batch)
    step = autopar.parallelize(fn, mesh={"data": 2, "model": 4}, in_shardings=(None, None, hint))
    ref = (params, opt_state)
    losses = []
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, batch)
        r_params, r_opt, r_loss = jax.jit(fn)(*ref, batch)
        ref = (r_params, r_opt)
        np.testing.assert_allclose(float(loss), float(r_loss), rtol=2e-3)
        losses.append(float(loss))
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)
    assert losses[-1] < losses[0]
    assert step.plans_made == 1
    assert step.plan is not None


def test_parallelize_passes_every_plan_option_on():
    step = autopar.parallelize(lambda x: jnp.sin(x) * 2, mesh={"data": 2, "model": 4},
                               batch_axes="data", overlap=False, attention=None)
    x = jnp.ones((8, 4))
    np.testing.assert_allclose(np.asarray(step(x)), np.asarray(jnp.sin(x) * 2), rtol=1e-6)
    assert step.plan.stats["overlap"] is False
    with pytest.raises(autopar.ArgumentError, match="takes no `exportable`"):
        autopar.parallelize(lambda x: x, mesh={"data": 8}, exportable=True)
    with pytest.raises(autopar.ArgumentError, match="`overlap` must be True or False"):
        autopar.parallelize(lambda x: x, mesh={"data": 8}, overlap="no")


def test_parallelize_as_decorator_replans_for_a_new_shape():
    @autopar.parallelize(mesh={"data": 8})
    def f(x):
        return jnp.sin(x) * 2

    f(jnp.ones((8, 4)))
    f(jnp.ones((8, 4)))
    f(jnp.ones((16, 4)))
    assert f.plans_made == 2


def test_planning_is_deterministic():
    fn, args = gpt.make_train_step(gpt.TINY)
    hint = (None, None, jax.tree_util.tree_map(lambda _: jax.sharding.PartitionSpec("data"),
                                               args[2]))
    specs = []
    for _ in range(2):
        plan = autopar.plan(fn, *args, mesh={"data": 2, "model": 4}, in_shardings=hint)
        specs.append([s.spec for s in jax.tree_util.tree_leaves(plan.in_shardings)]
                     + [s.spec for s in jax.tree_util.tree_leaves(plan.out_shardings)])
    assert specs[0] == specs[1]


def test_validate_finds_no_unpredicted_collectives():
    fn, args = gpt.make_train_step(gpt.TINY)
    hint = (None, None, jax.tree_util.tree_map(lambda _: jax.sharding.PartitionSpec("data"),
                                               args[2]))
    plan = autopar.plan(fn, *args, mesh={"data": 2, "model": 4}, in_shardings=hint)
    v = plan.validate()
    assert v["unexpected_kinds"] == []
    predicted, compiled = v["wire_bytes"]
    assert compiled > 0 and abs(predicted - compiled) <= 0.1 * compiled


def test_with_sharding_constraint_in_the_function_is_kept(mesh_2d):
    sharding = NamedSharding(mesh_2d, jax.sharding.PartitionSpec(None, "model"))

    def f(w, x):
        h = jax.lax.with_sharding_constraint(x @ w, sharding)
        return jnp.tanh(h).sum()

    w, x = jnp.ones((16, 32)), jnp.ones((8, 16))
    plan = autopar.plan(f, w, x, mesh=mesh_2d)
    graph, strats, choice, _ = plan._details
    pinned = [n for n in graph.nodes if n.prim == "sharding_constraint"]
    assert pinned and all(str(strats[n.id][choice[n.id]].out_specs[0]) == "RS(model)"
                          for n in pinned)
    np.testing.assert_allclose(float(plan.jit()(w, x)), float(f(w, x)), rtol=2e-3)


def test_a_bare_partition_spec_constraint_names_the_plans_mesh():
    """A dict mesh leaves the user no Mesh to build a NamedSharding from: a bare
    PartitionSpec in with_sharding_constraint refers to the plan's mesh, as under
    jax.set_mesh, when planning, compiling, running and comparing with baselines."""
    def f(w, x):
        h = jax.lax.with_sharding_constraint(x @ w, jax.sharding.PartitionSpec(None, "model"))
        return jnp.tanh(h).sum()

    w, x = jnp.ones((16, 32)), jnp.ones((8, 16))
    mesh = {"data": 2, "model": 4}
    plan = autopar.plan(f, w, x, mesh=mesh)
    graph, strats, choice, _ = plan._details
    pinned = [n for n in graph.nodes if n.prim == "sharding_constraint"]
    assert pinned and all(str(strats[n.id][choice[n.id]].out_specs[0]) == "RS(model)"
                          for n in pinned)
    np.testing.assert_allclose(float(plan.jit()(w, x)), float(jnp.tanh(x @ w).sum()),
                               rtol=2e-3)
    assert plan.validate()["unexpected_kinds"] == []
    _, measured, _ = autopar.compare(f, (w, x), mesh, kinds=("dp",))
    assert set(measured) == {"autopar", "dp"}
    shown = repr(measured["dp"])   # its numbers, not the compiled program's collectives
    assert "makespan_s=" in shown and "summary" not in shown and len(shown) < 300
    # a plan compared on another mesh than its own is refused
    with pytest.raises(autopar.ArgumentError, match="pass the plan's mesh"):
        autopar.compare(f, (w, x), {"data": 8}, plan=plan, kinds=("dp",))
    # and so is one made for other arguments, and a kind that is none, before any compile
    with pytest.raises(autopar.ArgumentError, match=r"made for other arguments than `args` "
                       r"\(argument leaf \[1\] is float32\[8, 16\] in the plan and "
                       r"float32\[4, 16\] here\)"):
        autopar.compare(f, (w, x[:4]), mesh, plan=plan, kinds=("dp",))
    with pytest.raises(autopar.ArgumentError, match=r"`kinds` is the string 'dp'"):
        autopar.compare(f, (w, x), mesh, plan=plan, kinds="dp")
    with pytest.raises(autopar.ArgumentError, match=r"unknown baseline kind 'nope' .*'ring', "
                       r"'ulysses'"):
        autopar.compare(f, (w, x), mesh, plan=plan, kinds=("nope",))
    # a plan given is priced on the profile it was made for, and took no planning here
    h100 = autopar.plan(f, w, x, mesh=mesh, hardware="h100")
    _, priced, took = autopar.compare(f, (w, x), mesh, plan=h100, kinds=("dp",))
    _, asked, _ = autopar.compare(f, (w, x), mesh, plan=h100, kinds=("dp",), hardware="h100")
    assert took == 0.0 and priced["dp"].step_time_s == asked["dp"].step_time_s
    assert priced["dp"].step_time_s != measured["dp"].step_time_s   # default profile: cpu


def test_validate_flags_collectives_the_plan_did_not_predict(monkeypatch):
    from autopar import _validate
    from autopar.cost_model import hlo

    fn, args = mlp.make_train_step(mlp.TINY)
    plan = autopar.plan(fn, *args, mesh={"data": 8})
    real = hlo.analyze(plan.compile())
    extra = hlo.Collective(hlo.CollectiveKind.ALL_TO_ALL, 4096, 4096, 8, 1, "main", "injected")
    fake = dataclasses.replace(real, collectives=real.collectives + (extra,))
    monkeypatch.setattr(_validate, "analyze", lambda compiled: fake)
    assert plan.validate()["unexpected_kinds"] == ["all-to-all"]
    assert "did not predict" in _validate.validation_table(plan)


def test_default_progress_shows_only_once_planning_is_slow(monkeypatch, capsys):
    """verbose=None (the default) says nothing while planning is quick; from the first line
    after QUIET_S seconds it prints that line and the one before, then every line. False never
    prints, True always does."""
    from autopar import _api

    clock = [0.0]
    monkeypatch.setattr(_api.time, "perf_counter", lambda: clock[0])
    quiet, never, always = _api._progress(None), _api._progress(False), _api._progress(True)
    for t, msg in ((0.0, "tracing"), (3.0, "solving the ILP")):
        clock[0] = t
        quiet(msg)
        never(msg)
    assert capsys.readouterr().err == ""
    always("tracing")
    assert "tracing" in capsys.readouterr().err
    clock[0] = _api.QUIET_S + 2.0
    quiet("memory penalty")
    never("memory penalty")
    err = capsys.readouterr().err
    assert "taking a while" in err and "solving the ILP" in err and "memory penalty" in err
    assert "tracing" not in err and err.count("memory penalty") == 1
    quiet("comparing")
    assert "comparing" in capsys.readouterr().err


def test_progress_inside_one_command_counts_from_its_start(monkeypatch, capsys):
    """A CLI command's lines and its plans' (an exportable plan plans again inside) share the
    outermost clock, instead of each plan restarting at 0."""
    from autopar import _api, _progress
    clock = [100.0]
    monkeypatch.setattr(_progress.time, "perf_counter", lambda: clock[0])
    with _progress.progress_clock():
        clock[0] = 105.0
        _api._progress(True)("tracing")     # a plan that starts 5 s into the command
        with _progress.progress_clock():    # an inner plan keeps the command's clock
            clock[0] = 107.5
            _api._progress(True)("again")
            _progress.progress_line("compiling")
    err = capsys.readouterr().err.splitlines()
    assert err == ["[autopar    5.0s] tracing", "[autopar    7.5s] again",
                   "[autopar    7.5s] compiling"]


def test_planning_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    """The cyclic collector is off while a plan is made (autopar._gc) and as it was after,
    also when planning fails; a caller's disabled collector stays disabled."""
    import gc

    from autopar import _api
    from autopar.errors import AutoparError

    seen = []
    run_pipeline = _api.run_pipeline

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return run_pipeline(*args, **kwargs)

    monkeypatch.setattr(_api, "run_pipeline", spy)
    fn, args = _step()
    assert gc.isenabled()
    autopar.plan(fn, *args, mesh={"data": 8})
    assert seen == [False] and gc.isenabled()
    with pytest.raises(AutoparError):  # 3 devices of 8 do not divide the batch of 8
        autopar.plan(fn, *args, mesh={"data": 3})
    assert gc.isenabled()
    gc.disable()
    try:
        autopar.plan(fn, *args, mesh={"data": 8})
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_explicit_axis_mesh_and_arguments_placed_on_it_run_as_one_device_does():
    """A mesh with Explicit axes is planned on Auto axes over the same devices; arguments
    already placed on it (their sharding part of their type) trace as plain ones, are placed
    as planned when the program runs, also under the caller's ``jax.set_mesh``."""
    from jax.sharding import AxisType, PartitionSpec

    fn, args = mlp.make_train_step(mlp.TINY)
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    placed = jax.device_put(args, NamedSharding(mesh, PartitionSpec()))
    assert jax.typeof(jax.tree_util.tree_leaves(placed)[0]).sharding.mesh.axis_types[0] == \
        AxisType.Explicit
    plan = autopar.plan(fn, *placed, mesh=mesh)
    assert all(t == AxisType.Auto for t in plan.mesh.axis_types)
    run = plan.jit()
    with jax.set_mesh(mesh):
        under_context = run(*placed)
    for got in (run(*placed), run(*args), under_context):
        for g, w in zip(jax.tree_util.tree_leaves(got), want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_planned_and_parallelized_under_the_callers_explicit_mesh():
    """Planned (and ``parallelize``-d) inside the caller's ``jax.set_mesh`` of a mesh with
    Explicit axes (``jax.make_mesh``'s default), the program runs, there and outside, and
    computes what one device does: the trace does not record the Explicit mesh."""
    from jax.sharding import AxisType

    fn, args = mlp.make_train_step(mlp.TINY)
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        run = autopar.plan(fn, *args, mesh=mesh).jit()
        results = [run(*args), autopar.parallelize(fn, mesh=mesh)(*args)]
    results.append(run(*args))
    for got in results:
        for g, w in zip(jax.tree_util.tree_leaves(got), want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_arguments_committed_elsewhere_are_placed_as_planned():
    """Arguments committed to other devices or shardings (placed on one device, or another
    plan's results: a train step's parameters passed to a step planned apart), which
    ``jax.jit`` refuses, are copied into the planned shardings, and the step computes what
    one device does."""
    from jax.sharding import PartitionSpec as P

    fn, args = mlp.make_train_step(mlp.TINY)
    want = jax.jit(fn)(*args)

    def kernel_hint(spec):  # tiny shapes replicate everything unless told
        return ({"mlp_in_0": None, "mlp_in_1": None, "mlp_out_0": {"bias": None, "kernel": spec}},
                None, None)
    first = autopar.plan(fn, *args, mesh={"data": 2, "model": 4},
                         in_shardings=kernel_hint(P(None, "model")))
    second = autopar.plan(fn, *args, mesh={"model": 8}, in_shardings=kernel_hint(P("model")))
    stepped = first.jit()(*args)
    on_one = jax.device_put(args, jax.devices()[5])
    elsewhere = [x for x, s in zip(jax.tree_util.tree_leaves(stepped[:2]),
                                   jax.tree_util.tree_leaves(second.in_shardings[:2]))
                 if not x.sharding.is_equivalent_to(s, x.ndim)]
    assert elsewhere, "the first plan's results should be placed unlike the second's inputs"
    with pytest.raises(ValueError, match="does not match the sharding"):
        jax.jit(fn, in_shardings=second.in_shardings)(*on_one)
    want_next = jax.jit(fn)(*want[:2], args[2])
    for got, expected in ((second.jit()(*on_one), want),
                          (second.jit()(*stepped[:2], args[2]), want_next)):
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_host_arrays_and_the_step_s_own_results_share_one_compile(caplog):
    step, args = mlp.make_train_step(mlp.TINY)
    plan = autopar.plan(step, *args, mesh={"data": 2, "model": 4}, verbose=False)
    run = plan.jit()
    host = jax.tree.map(np.asarray, args)
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        out = run(*host)                       # numpy arrays, as the README's snippet passes
        out = run(*out[:2], host[2])           # the step's own results
        run(*out[:2], host[2])                 # and again: three calls, one compile
    compiles = [r for r in caplog.records if r.getMessage().startswith("Compiling jit(")]
    assert len(compiles) == 1, [r.getMessage()[:80] for r in compiles]
