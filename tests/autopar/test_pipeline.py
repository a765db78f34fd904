"""autopar.value_and_grad / grad / Pipeline: jax's outside a pipeline; inside a pipelining
context, the scanned GPT's train step pipelined with GPipe and 1F1B computes what the
single-device step computes, runs the schedule's tick count, and 1F1B holds less memory."""

import dataclasses
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import autopar
from autopar._pipeline import pipelining
from autopar._stage_plan import post_planner
from autopar.passes.strategies import _body_constraints
from autopar.errors import ArgumentError, PipelineError
from autopar.models import common, gpt, llama_nnx
from autopar.passes.stages import search
from autopar.passes.stages.prepare import Inner
from autopar.passes.stages.schedules import Schedule, tick_loops

CONFIG = gpt.Config(scan_layers=True, layers=4)   # gpt.TINY_SCAN with one layer per stage


def _mesh(axes):
    return jax.make_mesh(tuple(axes.values()), tuple(axes),
                         axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def _close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(
        np.asarray(x), np.asarray(y), rtol=2e-3, atol=2e-5), a, b)


def _step(value_and_grad, loss_fn, tx):
    def train_step(params, opt_state, batch):
        loss, grads = value_and_grad(loss_fn)(params, batch)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt_state, loss, grads
    return train_step


def _pipelined(step, settings, mesh, schedule=None):
    """Jit ``step`` traced inside the pipelining context; check the schedule it chose."""
    def run(*args):
        with pipelining(settings, mesh) as context:
            compiled = jax.jit(step).lower(*args).compile()
        assert context.calls == 1 and len(context.chosen) == 1
        if schedule is not None:
            assert context.chosen[0].schedule.value == schedule
        return compiled
    return run


def _gpt_case(config):
    """(loss_fn, tx, args, the single-device step's results) of the GPT of ``config``."""
    tx = common.make_optimizer()
    _, args = gpt.make_train_step(config, tx=tx)
    loss_fn = gpt._loss_fn(config)
    expected = jax.jit(_step(jax.value_and_grad, loss_fn, tx))(*args)
    return loss_fn, tx, args, expected


@pytest.fixture(scope="module")
def gpt_case():
    return _gpt_case(CONFIG)


# ----------------------------------------------------------------------------- outside


def _loss(w, x, scale):
    y = jnp.tanh(x @ w["a"]) @ w["b"] * scale
    return jnp.mean(y ** 2), {"y_sum": y.sum()}


def test_outside_a_pipeline_value_and_grad_is_jax_s():
    w = {"a": jnp.full((4, 3), 0.3), "b": jnp.full((3, 2), -0.2)}
    x = jnp.arange(32.0).reshape(8, 4) / 16
    for argnums in (0, (0, 2)):
        got = autopar.value_and_grad(_loss, argnums=argnums, has_aux=True)(w, x, 1.5)
        want = jax.value_and_grad(_loss, argnums=argnums, has_aux=True)(w, x, 1.5)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        _close(got, want)
    plain = lambda w, x: _loss(w, x, 2.0)[0]  # noqa: E731
    _close(autopar.value_and_grad(plain)(w, x), jax.value_and_grad(plain)(w, x))
    _close(autopar.grad(plain)(w, x), jax.grad(plain)(w, x))
    _close(autopar.grad(_loss, has_aux=True)(w, x, 1.0), jax.grad(_loss, has_aux=True)(w, x, 1.0))


@pytest.mark.parametrize("kwargs, match", [
    (dict(schedule="pipedream"), "schedule='pipedream'.*1f1b"),
    (dict(microbatches=0), "microbatches=0.*positive integer"),
    (dict(stages=True), "stages=True"),
    (dict(axis=""), "mesh axis name"),
    (dict(schedule="1f1b", virtual_stages=2), "interleaved"),
    (dict(batch_argnums=-1), "batch_argnums=-1.*non-negative"),
    (dict(batch_argnums=()), "batch_argnums=\\(\\)"),
    (dict(batch_argnums="x"), "batch_argnums='x'"),
])
def test_pipeline_settings_are_validated(kwargs, match):
    with pytest.raises(ArgumentError, match=match):
        autopar.Pipeline(**kwargs)


def test_a_step_traced_outside_is_traced_again_inside_and_records_its_choice(gpt_case):
    loss_fn, _, (params, _, batch), _ = gpt_case
    step = jax.jit(autopar.value_and_grad(loss_fn))
    assert "shard_map" not in str(jax.make_jaxpr(step)(params, batch))
    with pipelining(autopar.Pipeline(), _mesh({"stage": 4, "data": 2})) as context:
        inside = str(jax.make_jaxpr(step)(params, batch))
    assert "shard_map" in inside and context.calls == 1
    (choice,) = context.chosen
    assert choice.schedule.value == "1f1b" and choice.microbatches == 4
    assert choice.layer_ranges == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert choice.ticks == 10 and choice.bubble_fraction == pytest.approx(3 / 7)


def test_pipeline_is_frozen_and_exported():
    settings = autopar.Pipeline(schedule="gpipe", microbatches=4)
    with pytest.raises(AttributeError):
        settings.microbatches = 8
    assert autopar.PipelineError is PipelineError and issubclass(PipelineError, ArgumentError)


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("axes", [{"stage": 4, "data": 2}, {"stage": 2, "data": 2, "model": 2}])
@pytest.mark.parametrize("schedule, microbatches", [("gpipe", 4), ("1f1b", None),
                                                   ("zb-h1", None)])
def test_pipelined_train_step_matches_one_device(gpt_case, axes, schedule, microbatches):
    loss_fn, tx, args, expected = gpt_case
    step = _step(autopar.value_and_grad, loss_fn, tx)
    settings = autopar.Pipeline(schedule=schedule, microbatches=microbatches)
    got = _pipelined(step, settings, _mesh(axes), schedule)(*args)(*args)
    _close(got, expected)


@pytest.mark.parametrize("axes, virtual", [({"stage": 4, "data": 2}, 2),
                                           ({"stage": 2, "data": 2, "model": 2}, 4)])
def test_interleaved_train_step_matches_one_device(axes, virtual):
    config = gpt.Config(scan_layers=True, layers=8)
    tx = common.make_optimizer()
    _, args = gpt.make_train_step(config, tx=tx)
    loss_fn = gpt._loss_fn(config)
    expected = jax.jit(_step(jax.value_and_grad, loss_fn, tx))(*args)
    step = _step(autopar.value_and_grad, loss_fn, tx)
    settings = autopar.Pipeline(schedule="interleaved", virtual_stages=virtual, microbatches=4)
    with pipelining(settings, _mesh(axes)) as context:
        compiled = jax.jit(step).lower(*args).compile()
    chosen = context.chosen[0]
    assert chosen.virtual_stages == virtual and len(chosen.layer_ranges) == 8
    _close(compiled(*args), expected)


@pytest.mark.parametrize("axes", [{"stage": 4, "data": 2}, {"stage": 2, "data": 2, "model": 2}])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_scanned_nnx_llama_pipelines_match_one_device(axes, schedule):
    config = llama_nnx.Config(scan_layers=True, layers=8, seq=8, batch=8)
    tx = common.make_optimizer()
    graphdef, state = llama_nnx._split(config, abstract=False)
    args = (state, jax.jit(tx.init)(state), llama_nnx._batch(config, abstract=False))
    loss_fn = llama_nnx._loss_fn(graphdef)
    expected = jax.jit(_step(jax.value_and_grad, loss_fn, tx))(*args)
    step = _step(autopar.value_and_grad, loss_fn, tx)
    settings = autopar.Pipeline(schedule=schedule, microbatches=4)
    got = _pipelined(step, settings, _mesh(axes), schedule)(*args)(*args)
    _close(got, expected)


@pytest.mark.parametrize("schedule, axes, virtual, ranges", [
    # 6 layers on 4 stages: 2, 2, 1, 1 (each stage stacks 2; the pads pass their carry through)
    ("gpipe", {"stage": 4, "data": 2}, None, ((0, 2), (2, 4), (4, 5), (5, 6))),
    ("1f1b", {"stage": 4, "data": 2}, None, ((0, 2), (2, 4), (4, 5), (5, 6))),
    ("zb-h1", {"stage": 4, "data": 2}, None, ((0, 2), (2, 4), (4, 5), (5, 6))),
    ("1f1b", {"stage": 2, "data": 2, "model": 2}, None, ((0, 3), (3, 5))),
    # 2 stages x 2 virtual: 4 chunks of 2, 2, 1, 1
    ("interleaved", {"stage": 2, "data": 2, "model": 2}, 2, ((0, 2), (2, 4), (4, 5), (5, 6))),
])
def test_stages_the_layers_do_not_divide_are_balanced(schedule, axes, virtual, ranges):
    config = gpt.Config(scan_layers=True, layers=ranges[-1][1])
    tx = common.make_optimizer()
    _, args = gpt.make_train_step(config, tx=tx)
    loss_fn = gpt._loss_fn(config)
    expected = jax.jit(_step(jax.value_and_grad, loss_fn, tx))(*args)
    step = _step(autopar.value_and_grad, loss_fn, tx)
    settings = autopar.Pipeline(schedule=schedule, microbatches=4, virtual_stages=virtual)
    with pipelining(settings, _mesh(axes)) as context:
        compiled = jax.jit(step).lower(*args).compile()
    assert context.chosen[0].layer_ranges == ranges
    _close(compiled(*args), expected)


def _sharded_layer(micro):
    """A stage plan (as ``autopar._stage_plan`` makes them) with every layer matrix split on
    its last dim over ``model`` and the microbatch's rows over ``data``."""
    n = micro.num_consts
    xs = [v.aval.shape[1:] for v in micro.eqn.invars[n + 1:]]
    inner = Inner(consts=(None,) * n, carry=P("data"),
                  xs=tuple(P(*[None] * (len(s) - 1), "model") if len(s) >= 2 else None
                           for s in xs))
    return search.LayerPlan(inner=inner, time_s=1.0, kept_bytes=1, carry_bytes=1, hop_s=0.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_split_over_the_other_axes_as_their_layer_plan_says(gpt_case, schedule):
    loss_fn, tx, args, expected = gpt_case
    step = _step(autopar.value_and_grad, loss_fn, tx)
    mesh = _mesh({"stage": 2, "data": 2, "model": 2})
    settings = autopar.Pipeline(schedule=schedule, microbatches=4)
    with pipelining(settings, mesh, plan_layer=_sharded_layer) as context:
        compiled = jax.jit(step).lower(*args).compile()
    assert context.chosen[0].inner.carry == P("data")
    _close(compiled(*args), expected)
    # the stage's matmuls run on a quarter of the work: rows over data, columns over model
    hidden, rows = CONFIG.hidden, CONFIG.batch // 4 * CONFIG.seq
    local = [m.groups() for m in re.finditer(r"= \w+\[(\d+),(\d+)\]\{[^}]*\} dot\(",
                                             compiled.as_text())]
    assert (str(rows // 2), str(3 * hidden // 2)) in local   # the qkv matmul


def _regions(jaxpr) -> list:
    """The ``shard_map`` equations in ``jaxpr``, nested ones included, in order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            found.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += _regions(sub)
    return found


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_an_autodiffed_region_s_backward_reads_the_stage_weights_as_the_stage_plan_splits_them(
        gpt_case, schedule):
    """GPipe's and the interleaved backward is jax's transpose of the forward region: a second
    region that reads the stage's weights again, holding them in the stage plan's specs only
    inside each tick's recompute. The outer plan reads a region's operand specs from its body
    (``strategies._body_constraints``), so it must find them there, or it feeds the backward
    the weights whole (on the 26B two-node GPT: an all-gather of 16 GiB at the boundary)."""
    loss_fn, tx, args, _ = gpt_case
    step = _step(autopar.value_and_grad, loss_fn, tx)
    settings = autopar.Pipeline(schedule=schedule, microbatches=4,
                                virtual_stages=2 if schedule == "interleaved" else None)
    with pipelining(settings, _mesh({"stage": 2, "data": 2, "model": 2}),
                    plan_layer=_sharded_layer):
        closed = jax.make_jaxpr(step)(*args)
    forward, backward = _regions(closed.jaxpr)

    def split_over_model(region):   # the layer matrices _sharded_layer splits: 4
        entry, _ = _body_constraints(region.params["jaxpr"])
        return sorted(i for i, spec in entry.items()
                      if spec is not None and tuple(spec)[-1:] == ("model",))

    assert len(split_over_model(forward)) == len(split_over_model(backward)) == 4


#: The GPT with a vocabulary no other dim matches, whole (160) or split in two (80).
HEAD_CONFIG = dataclasses.replace(CONFIG, vocab=160)


def _head_plan(calls: list):
    """``autopar.plan`` as ``autopar._stage_plan.post_planner`` calls it, choosing the tied
    embedding split over ``model`` on its vocabulary and, unless pinned, the rows (the stack's
    output and the targets) over ``data``: the plan XLA's partitioner aborts on inside the
    region, which the planner must plan again with the rows whole."""
    def plan(step, *args, mesh, in_shardings=None, **_):
        calls.append(in_shardings)
        leaves = jax.tree.leaves(args)
        pins = (jax.tree.leaves(in_shardings, is_leaf=lambda x: x is None)
                if in_shardings is not None else [None] * len(leaves))
        specs = [pin if pin is not None
                 else P("model") if tuple(a.shape) == (HEAD_CONFIG.vocab, HEAD_CONFIG.hidden)
                 else P("data") if a.shape and a.shape[0] == HEAD_CONFIG.batch // 4 else P()
                 for a, pin in zip(leaves, pins, strict=True)]
        return types.SimpleNamespace(
            in_shardings=[jax.sharding.NamedSharding(mesh, s) for s in specs],
            estimate=types.SimpleNamespace(step_time_s=1.0, flops=0.0, comm_bytes=0.0))
    return plan


@pytest.fixture(scope="module")
def head_case():
    loss_fn, tx, args, expected = _gpt_case(HEAD_CONFIG)
    return _step(autopar.value_and_grad, loss_fn, tx), args, expected


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_head_splits_over_the_other_axes_as_its_plan_says(head_case, schedule):
    """1F1B and ZB-H1 run the head and loss inside the region, held in their plan's specs:
    the embedding split on its vocabulary, the rows whole (planned again: split with them,
    XLA's partitioner aborts), beside a stage plan that splits the activation's rows. The
    head's matmuls read half the vocabulary, and the step is the single device's."""
    step, args, expected = head_case
    mesh = _mesh({"stage": 2, "data": 2, "model": 2})
    calls = []
    plan_post = post_planner(mesh, "stage", "h100", None, _head_plan(calls))
    settings = autopar.Pipeline(schedule=schedule, microbatches=4)
    with pipelining(settings, mesh, plan_layer=_sharded_layer, plan_post=plan_post) as context:
        compiled = jax.jit(step).lower(*args).compile()
    post = context.chosen[0].post
    assert len(calls) == 2 and calls[1] is not None        # planned again, the rows pinned
    assert post.y == P() and sum(s == P("model") for s in post.ins) == 1
    assert P("data") not in post.ins
    _close(compiled(*args), expected)
    dims = [d.split(",") for d in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} dot\(",
                                             compiled.as_text())]
    assert [d for d in dims if "80" in d] and not [d for d in dims if "160" in d]


# ----------------------------------------------------------------------------- compiled


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            current = comps.setdefault(head.group(1), [])
        elif current is not None:
            current.append(line)
    return comps


def _permutes_in(comps, name: str, seen=None) -> bool:
    """Whether computation ``name`` holds a collective-permute, outside nested loops (in it,
    or in a conditional branch it calls)."""
    seen = set() if seen is None else seen
    seen.add(name)
    for line in comps.get(name, ()):
        if "collective-permute" in line:
            return True
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        if branches and any(_permutes_in(comps, b.strip().lstrip("%"), seen)
                            for b in branches.group(1).split(",")
                            if b.strip().lstrip("%") not in seen):
            return True
    return False


def _loops_with_permutes(hlo: str) -> list[int]:
    """Trip counts of the while loops whose body holds a collective-permute (0 when XLA does
    not know it)."""
    comps = _computations(hlo)
    found = []
    for line in hlo.splitlines():
        loop = re.search(r"while\(.*body=%?([\w.\-]+)", line)
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        if loop and _permutes_in(comps, loop.group(1)):
            found.append(int(trips.group(1)) if trips else 0)
    return found


ACTIVATIONS = gpt.Config(scan_layers=True, layers=4, seq=64, hidden=32, heads=2, batch=32,
                         vocab=64)


@functools.cache
def _compiled(schedule):
    """The value-and-grad of ACTIVATIONS's loss at 8 microbatches on (stage=4, data=2)."""
    _, (params, _, batch) = gpt.make_train_step(ACTIVATIONS)
    step = autopar.value_and_grad(gpt._loss_fn(ACTIVATIONS))
    settings = autopar.Pipeline(schedule=schedule, microbatches=8,
                                virtual_stages=1 if schedule == "interleaved" else None)
    return _pipelined(step, settings, _mesh({"stage": 4, "data": 2}))(params, batch)


@pytest.mark.parametrize("schedule, loops", [("gpipe", [11, 11]), ("1f1b", [3, 3, 8]),
                                             ("interleaved", [11, 11]), ("zb-h1", [29])])
def test_compiled_loop_runs_the_schedule_s_ticks(schedule, loops):
    # GPipe: forward and backward loops of M + S - 1 ticks; 1F1B: M + 2(S - 1) ticks in three
    # loops (S - 1 warmup, M steady, S - 1 cooldown); ZB-H1: 3M + S - 1 slots of F, B or W and
    # two more here; interleaved with v = 1 (4 layers on 4 stages) runs GPipe's ticks,
    # v M + S - 1 in general
    hlo = _compiled(schedule).as_text()
    assert sorted(_loops_with_permutes(hlo)) == loops
    assert loops == tick_loops(Schedule(schedule), 4, 8, 1)


def test_two_stage_1f1b_keeps_its_one_tick_phases_as_loops():
    # warmup and cooldown are one tick each: XLA would inline a loop of one trip, so the
    # emitter hides their bounds, and the steady loop runs M ticks, none of them masked
    _, (params, _, batch) = gpt.make_train_step(ACTIVATIONS)
    step = autopar.value_and_grad(gpt._loss_fn(ACTIVATIONS))
    settings = autopar.Pipeline(schedule="1f1b", microbatches=4)
    hlo = _pipelined(step, settings, _mesh({"stage": 2, "data": 4}))(params, batch).as_text()
    assert sorted(_loops_with_permutes(hlo)) == [0, 0, 4] == tick_loops(Schedule.ONE_F_ONE_B, 2, 4)


def test_interleaved_loop_runs_v_m_plus_s_minus_1_ticks():
    config = dataclasses.replace(ACTIVATIONS, layers=8)
    _, (params, _, batch) = gpt.make_train_step(config)
    step = autopar.value_and_grad(gpt._loss_fn(config))
    settings = autopar.Pipeline(schedule="interleaved", virtual_stages=2, microbatches=8)
    hlo = _pipelined(step, settings, _mesh({"stage": 4, "data": 2}))(params, batch).as_text()
    assert sorted(_loops_with_permutes(hlo)) == [19, 19]   # 2 * 8 + 4 - 1


def test_gpipe_keeps_its_ticks_inputs_and_zb_h1_its_residuals_at_eight_microbatches():
    """GPipe's autodiff keeps each tick's stage input (M + S - 1 = 11) and runs the stage
    again in the backward (it kept every tick's residuals, over twice 1F1B's memory); 1F1B
    stashes 2S - 1 stage inputs and recomputes; ZB-H1 stores S = 4 microbatches' residuals."""
    temp = {s: _compiled(s).memory_analysis().temp_size_in_bytes
            for s in ("gpipe", "1f1b", "zb-h1")}
    assert temp["1f1b"] < temp["gpipe"] < 1.5 * temp["1f1b"], temp
    assert temp["zb-h1"] > 2 * temp["gpipe"], temp


# ----------------------------------------------------------------------------- bad input


def _trace(config, settings, axes=None, loss_fn=None, has_aux=False):
    _, (params, _, batch) = gpt.make_train_step(config)
    loss_fn = loss_fn or gpt._loss_fn(config)
    with pipelining(settings, _mesh(axes or {"stage": 4, "data": 2})):
        jax.jit(lambda p, b: autopar.value_and_grad(loss_fn, has_aux=has_aux)(p, b)).lower(
            params, batch)


@pytest.mark.parametrize("config, settings, axes, match", [
    (CONFIG, autopar.Pipeline(microbatches=3), None, "microbatches=3.*does not divide"),
    (gpt.TINY_SCAN, autopar.Pipeline(), None, "2 layers, fewer than the 4 stages"),
    (CONFIG, autopar.Pipeline(schedule="interleaved", virtual_stages=2), None,
     r"8 chunks, more than there are layers; interleaving needs at least 8 layers.*1f1b"),
    (CONFIG, autopar.Pipeline(schedule="interleaved"), None,
     r"8 chunks, more than there are layers \(`virtual_stages` defaults to 2"),
    (CONFIG, autopar.Pipeline(schedule="interleaved", virtual_stages=3), {"stage": 2, "data": 4},
     "^(?!.*defaults).*6 chunks, more than there are layers; choose `virtual_stages` of at "
     "most 2"),
    (CONFIG, autopar.Pipeline(axis="pipe"), None, "axis the mesh lacks"),
    (CONFIG, autopar.Pipeline(stages=2), None, "stages=2"),
    (gpt.TINY, autopar.Pipeline(), None, "nn.scan"),
])
def test_bad_pipelines_raise(config, settings, axes, match):
    with pytest.raises(PipelineError, match=match):
        _trace(config, settings, axes)


def _weighted_loss(config):
    """Cross entropy normalized by a count computed from the batch."""
    model = gpt.GPT(config)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])
        weights = (batch["targets"] > 3).astype(jnp.float32)
        return common.cross_entropy(logits, batch["targets"], weights)

    return loss_fn


def test_a_loss_normalized_by_a_batch_count_is_refused_by_1f1b():
    with pytest.raises(PipelineError, match="`max` acts on a sum over the batch's examples"):
        _trace(CONFIG, autopar.Pipeline(schedule="1f1b"), loss_fn=_weighted_loss(CONFIG))


def _dropout_loss(where):
    """A plain-jax stack with dropout from the step's one key, in the layers or after them."""
    def loss_fn(params, x, y, key):
        def body(h, w):
            h = jnp.tanh(h @ w)
            if where == "layers":
                h = jnp.where(jax.random.bernoulli(key, 0.8, h.shape), h / 0.8, 0.0)
            return h, None
        h, _ = jax.lax.scan(body, x, params["layers"])
        if where == "loss":
            h = jnp.where(jax.random.bernoulli(key, 0.8, h.shape), h / 0.8, 0.0)
        return jnp.mean((h @ params["head"] - y) ** 2)
    return loss_fn


@pytest.mark.parametrize("where, schedule", [("layers", "gpipe"), ("layers", "1f1b"),
                                             ("loss", "1f1b"), ("loss", None)])
def test_dropout_from_one_key_is_refused_where_microbatches_would_draw_other_numbers(
        where, schedule):
    """A microbatch draws other random numbers than the whole batch: dropout in the layers is
    refused under every schedule, in the loss under 1F1B; with ``schedule=None`` a loss with
    dropout runs GPipe (the loss on the whole batch) and matches one device."""
    rng = np.random.default_rng(0)
    params = {"layers": jnp.asarray(rng.normal(0, 0.2, (4, 16, 16)), jnp.float32),
              "head": jnp.asarray(rng.normal(0, 0.1, (16, 4)), jnp.float32)}
    args = (params, jnp.asarray(rng.normal(size=(16, 16)), jnp.float32), jnp.zeros((16, 4)),
            jax.random.key(42))
    loss_fn = _dropout_loss(where)
    settings = autopar.Pipeline(schedule=schedule, microbatches=4)
    run = _pipelined(autopar.value_and_grad(loss_fn), settings, _mesh({"stage": 4, "data": 2}),
                     "gpipe" if schedule is None else schedule)
    if schedule is None:
        _close(run(*args)(*args), jax.value_and_grad(loss_fn)(*args))
        return
    with pytest.raises(PipelineError, match=f"random numbers are drawn in the "
                                            f"{'scanned layers' if where == 'layers' else 'loss'}"
                                            ".*per-example keys"):
        run(*args)


def _per_example_dropout_loss(params, x, y, keys):
    """Dropout from one key per example (a batch argument), in the layers and after them."""
    def drop(key, h):
        return jnp.where(jax.random.bernoulli(key, 0.8, h.shape), h / 0.8, 0.0)

    def body(h, w):
        return jax.vmap(drop)(jax.vmap(lambda k: jax.random.fold_in(k, 3))(keys),
                              jnp.tanh(h @ w)), None
    h, _ = jax.lax.scan(body, x, params["layers"])
    return jnp.mean((jax.vmap(drop)(keys, h) @ params["head"] - y) ** 2)


@pytest.mark.parametrize("schedule, legacy", [("gpipe", False), ("1f1b", True),
                                              ("1f1b", False), ("interleaved", False)])
def test_dropout_from_per_example_keys_pipelines_and_matches_one_device(schedule, legacy):
    """Each example's numbers come from its own key whatever the microbatch, so dropout
    drawn from per-example keys (typed or raw uint32) pipelines under every schedule that
    takes values made from the batch."""
    rng = np.random.default_rng(0)
    key = jax.random.PRNGKey(42) if legacy else jax.random.key(42)
    args = ({"layers": jnp.asarray(rng.normal(0, 0.2, (8, 16, 16)), jnp.float32),
             "head": jnp.asarray(rng.normal(0, 0.1, (16, 4)), jnp.float32)},
            jnp.asarray(rng.normal(size=(16, 16)), jnp.float32), jnp.zeros((16, 4)),
            jax.random.split(key, 16))
    run = _pipelined(autopar.value_and_grad(_per_example_dropout_loss),
                     autopar.Pipeline(schedule=schedule, microbatches=4),
                     _mesh({"stage": 4, "data": 2}), schedule)
    _close(run(*args)(*args), jax.value_and_grad(_per_example_dropout_loss)(*args))


def test_a_per_layer_operand_the_layers_never_read_runs_1f1b():
    """A stacked operand scanned with the layers but never read by them (per-layer keys a
    configuration leaves unused) is no obstacle to 1F1B's per-stage converts."""
    def loss_fn(params, x, y):
        unused = jnp.zeros((4, 3))
        h, _ = jax.lax.scan(lambda h, wk: (jnp.tanh(h @ wk[0]), None), x,
                            (params["layers"], unused))
        return jnp.mean((h @ params["head"] - y) ** 2)

    rng = np.random.default_rng(0)
    args = ({"layers": jnp.asarray(rng.normal(0, 0.2, (4, 16, 16)), jnp.float32),
             "head": jnp.asarray(rng.normal(0, 0.1, (16, 4)), jnp.float32)},
            jnp.asarray(rng.normal(size=(16, 16)), jnp.float32), jnp.zeros((16, 4)))
    run = _pipelined(autopar.value_and_grad(loss_fn),
                     autopar.Pipeline(schedule="1f1b", microbatches=4),
                     _mesh({"stage": 4, "data": 2}), "1f1b")
    _close(run(*args)(*args), jax.value_and_grad(loss_fn)(*args))


def _table_loss(params, x, y, table):
    """A plain-jax stack that reads row 0 of a table shared by every example."""
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w + table[:1]), None), x, params["layers"])
    return jnp.mean((h @ params["head"] - y) ** 2)


def test_a_shared_table_with_the_batch_s_rows_is_named_by_batch_argnums():
    """A table as long as the batch is taken for a batch argument, and the refusal says so;
    ``batch_argnums`` names the batch and the step matches one device."""
    rng = np.random.default_rng(0)
    args = ({"layers": jnp.asarray(rng.normal(0, 0.2, (4, 16, 16)), jnp.float32),
             "head": jnp.asarray(rng.normal(0, 0.1, (16, 4)), jnp.float32)},
            jnp.asarray(rng.normal(size=(16, 16)), jnp.float32), jnp.zeros((16, 4)),
            jnp.asarray(rng.normal(size=(16, 16)), jnp.float32))
    mesh = _mesh({"stage": 4, "data": 2})
    step = autopar.value_and_grad(_table_loss)
    inferred = _pipelined(step, autopar.Pipeline(schedule="1f1b", microbatches=4), mesh)
    with pytest.raises(PipelineError, match=r"`slice` mixes examples.*split arguments 1, 2, 3 "
                                            r"of the loss.*batch_argnums"):
        inferred(*args)
    named = _pipelined(step, autopar.Pipeline(schedule="1f1b", microbatches=4,
                                              batch_argnums=(1, 2)), mesh, "1f1b")
    _close(named(*args)(*args), jax.value_and_grad(_table_loss)(*args))


@pytest.mark.parametrize("batch_argnums, error, match", [
    (4, ArgumentError, "names argument 4, but the loss is called with 4 positional"),
    ((0, 1), ArgumentError, "argument 0, which the loss is differentiated by"),
    (3, PipelineError, r"argument 3 of the loss, which holds an array of shape \(8, 16\)"),
])
def test_batch_argnums_that_name_no_batch_are_refused(batch_argnums, error, match):
    args = ({"layers": jnp.ones((4, 16, 16)) / 16, "head": jnp.ones((16, 4))},
            jnp.ones((16, 16)), jnp.zeros((16, 4)), jnp.ones((8, 16)))
    run = _pipelined(autopar.value_and_grad(_table_loss),
                     autopar.Pipeline(microbatches=4, batch_argnums=batch_argnums),
                     _mesh({"stage": 4, "data": 2}))
    with pytest.raises(error, match=match):
        run(*args)


def test_an_input_taken_a_gradient_of_is_named_as_why_no_batch_reaches_the_stack():
    def loss_fn(params, x, y):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params)
        return jnp.mean((h - y) ** 2)

    args = (jnp.ones((4, 16, 16)) / 8, jnp.ones((16, 16)), jnp.zeros((16, 16)))
    run = _pipelined(autopar.value_and_grad(loss_fn, argnums=(0, 1)),
                     autopar.Pipeline(schedule="1f1b", microbatches=4),
                     _mesh({"stage": 4, "data": 2}))
    with pytest.raises(PipelineError, match=r"computed from no batch argument.*`argnums`"):
        run(*args)


def test_a_batch_read_from_a_closure_is_named_as_why_no_batch_reaches_the_stack():
    def step(params, x, y):
        def loss_fn(params):   # the batch from the enclosing step, as flax examples write it
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params)
            return jnp.mean((h - y) ** 2)
        return autopar.value_and_grad(loss_fn)(params)

    args = (jnp.ones((4, 16, 16)) / 8, jnp.ones((16, 16)), jnp.zeros((16, 16)))
    run = _pipelined(step, autopar.Pipeline(schedule="1f1b", microbatches=4),
                     _mesh({"stage": 4, "data": 2}))
    with pytest.raises(PipelineError, match=r"reads from an enclosing function.*Pass the batch "
                                            r"to the loss as an argument"):
        run(*args)


def _loss_with_aux(params, x, y):
    """A plain-jax stack whose loss returns, besides its mean, a sum and a mean over
    examples, an integer count, a per-example array and a value that ignores the batch."""
    h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), x @ params["embed"],
                        params["layers"])
    per = jnp.mean((h @ params["head"] - y) ** 2, axis=-1)
    return jnp.mean(per), {"sum": per.sum(), "mean": jnp.mean(per * 2), "per": per,
                           "norm": jnp.sum(params["head"] ** 2), "count": jnp.sum(per > 0.05)}


def _aux_case(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype) / 4  # noqa: E731
    params = {"embed": normal(6, 16), "head": normal(16, 3), "layers": normal(8, 16, 16)}
    return params, normal(16, 6), normal(16, 3)


@pytest.mark.parametrize("schedule, dtype", [("1f1b", jnp.float32), (None, jnp.float32),
                                             ("1f1b", jnp.bfloat16)])
def test_has_aux_outputs_combine_across_1f1b_microbatches(schedule, dtype):
    """1F1B computes the loss per microbatch: its auxiliary outputs are summed (a sum or mean
    over examples, weighted as the loss is; a bf16 one in float32), concatenated (per
    example) or taken from one microbatch (independent of the batch), and come out as one
    device computes them."""
    args = _aux_case(dtype)
    expected = jax.value_and_grad(_loss_with_aux, has_aux=True)(*args)
    settings = autopar.Pipeline(schedule=schedule, microbatches=8)
    step = autopar.value_and_grad(_loss_with_aux, has_aux=True)
    compiled = _pipelined(step, settings, _mesh({"stage": 4, "data": 2}), "1f1b")(*args)
    got = compiled(*args)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    assert jax.tree.map(lambda a: a.dtype, got) == jax.tree.map(lambda a: a.dtype, expected)
    if dtype == jnp.float32:
        _close(got, expected)
    else:   # one device sums in bf16 too, rounding differently: to bf16 accuracy
        jax.tree.map(lambda x, y: np.testing.assert_allclose(
            np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=3e-2, atol=3e-2),
            got, expected)


def test_has_aux_that_mixes_examples_is_refused_by_1f1b_and_zb_h1():
    def mixed(params, x, y):
        value, aux = _loss_with_aux(params, x, y)
        return value, jnp.max(aux["per"])

    def batch_second(params, x, y):
        value, aux = _loss_with_aux(params, x, y)
        return value, aux["per"][:, None].T

    for loss, match in ((mixed, "`reduce_max` mixes examples"),
                        (batch_second, "auxiliary output 0 .* cannot combine")):
        with pipelining(autopar.Pipeline(schedule="1f1b", microbatches=8),
                        _mesh({"stage": 4, "data": 2})):
            with pytest.raises(PipelineError, match=match):
                jax.jit(autopar.value_and_grad(loss, has_aux=True)).lower(*_aux_case())
    with pipelining(autopar.Pipeline(schedule="zb-h1", microbatches=8),
                    _mesh({"stage": 4, "data": 2})):
        with pytest.raises(PipelineError, match="has_aux=True.*zb-h1.*schedule=\"1f1b\""):
            jax.jit(autopar.value_and_grad(_loss_with_aux, has_aux=True)).lower(*_aux_case())


def test_a_loss_normalized_by_a_batch_count_is_exact_under_the_chosen_schedule():
    """Left to autopar, the schedule falls back to GPipe (loss on the whole batch)."""
    loss_fn = _weighted_loss(CONFIG)
    tx = common.make_optimizer()
    _, args = gpt.make_train_step(CONFIG, tx=tx)
    expected = jax.jit(_step(jax.value_and_grad, loss_fn, tx))(*args)
    step = _step(autopar.value_and_grad, loss_fn, tx)
    got = _pipelined(step, autopar.Pipeline(), _mesh({"stage": 4, "data": 2}), "gpipe")(*args)(*args)
    _close(got, expected)


def _toy_loss(params, batch):
    """A plain-jax stack: embedding, 8 scanned layers sharing one matrix (a scan constant),
    and a float per-example target read after the stack."""
    def layer(h, w):
        return h + jnp.tanh(h @ w["kernel"] + w["bias"][None]) @ params["shared"], None

    h, _ = jax.lax.scan(layer, batch["x"] @ params["embed"], params["layers"])
    return jnp.mean((h @ params["head"] - batch["y"]) ** 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_plain_jax_stack_with_a_shared_weight(schedule):
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32) / 4  # noqa: E731
    params = {"embed": normal(6, 16), "shared": normal(16, 16), "head": normal(16, 3),
              "layers": {"kernel": normal(8, 16, 16), "bias": normal(8, 16)}}
    batch = {"x": normal(16, 6), "y": normal(16, 3)}
    expected = jax.value_and_grad(_toy_loss)(params, batch)
    step = autopar.value_and_grad(_toy_loss)
    settings = autopar.Pipeline(schedule=schedule, microbatches=8)
    compiled = _pipelined(step, settings, _mesh({"stage": 4, "data": 2}), schedule)(params, batch)
    _close(compiled(params, batch), expected)


def _rows_loss(params, batch):
    """A stack over tokens [B, S, D] whose layer runs its matmul on the tokens flattened to
    rows, and whose loss flattens the outputs too (each reshape merges the batch axis)."""
    def layer(h, w):
        b, s, d = h.shape
        return h + jnp.tanh(h.reshape(b * s, d) @ w).reshape(b, s, d), None

    h, _ = jax.lax.scan(layer, batch["x"] @ params["embed"], params["layers"])
    return jnp.mean(((h @ params["head"]).reshape(-1) - batch["y"].reshape(-1)) ** 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_layers_and_a_loss_that_flatten_the_tokens_pipeline(schedule):
    rng = np.random.default_rng(1)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32) / 4  # noqa: E731
    params = {"embed": normal(6, 16), "head": normal(16, 3), "layers": normal(8, 16, 16)}
    batch = {"x": normal(16, 3, 6), "y": normal(16, 3, 3)}
    expected = jax.value_and_grad(_rows_loss)(params, batch)
    settings = autopar.Pipeline(schedule=schedule, microbatches=8)
    compiled = _pipelined(autopar.value_and_grad(_rows_loss), settings,
                          _mesh({"stage": 4, "data": 2}), schedule)(params, batch)
    _close(compiled(params, batch), expected)


def _masked_loss(params, x, ids, y):
    """Scanned layers reading two values made from the batch (a boolean mask from integer
    ids, a float gate from a parameter) and a dropout key shared by the layers."""
    keep = ids > 0
    gate = jnp.tanh(x @ params["gate"])

    def layer(h, w):
        drop = jax.random.bernoulli(jax.random.fold_in(jax.random.key(7), w["index"]), 0.9,
                                    (h.shape[-1],))
        new = h + jnp.tanh(h @ w["kernel"]) * gate * drop[None]
        return jnp.where(keep[:, None], new, h), None

    layers = {"kernel": params["layers"], "index": jnp.arange(params["layers"].shape[0])}
    h, _ = jax.lax.scan(layer, x @ params["embed"], layers)
    return jnp.mean((h @ params["head"] - y) ** 2)


def _masked_case():
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32) / 4  # noqa: E731
    params = {"embed": normal(6, 16), "gate": normal(6, 1), "head": normal(16, 3),
              "layers": normal(8, 16, 16)}
    args = (params, normal(16, 6), jnp.asarray(rng.integers(0, 3, 16), jnp.int32),
            normal(16, 3))
    return args, jax.value_and_grad(_masked_loss)(*args)


def _batch_values_split(micro):
    """A stage plan splitting the microbatch's rows, and the values made from the batch with
    them, over ``data``."""
    n = micro.num_consts
    consts = tuple(P("data") if v.aval.ndim and v.aval.shape[0] == micro.carry_shape[0]
                   else None for v in micro.eqn.invars[:n])
    xs = (None,) * (len(micro.eqn.invars) - n - 1)
    inner = Inner(consts=consts, carry=P("data"), xs=xs)
    return search.LayerPlan(inner=inner, time_s=1.0, kept_bytes=1, carry_bytes=1, hop_s=0.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", None])
def test_values_made_from_the_batch_enter_the_layers_one_microbatch_at_a_time(schedule):
    """A mask made from the batch reaches each microbatch's layers as that microbatch's rows
    (held over ``data`` as the stage plan splits them), and its gradient flows back the same
    way; integer and key operands take none. Left to autopar, the schedule is 1F1B."""
    args, expected = _masked_case()
    settings = autopar.Pipeline(schedule=schedule, microbatches=4,
                                virtual_stages=2 if schedule == "interleaved" else None)
    mesh = _mesh({"stage": 2, "data": 2, "model": 2})
    with pipelining(settings, mesh, plan_layer=_batch_values_split) as context:
        compiled = jax.jit(autopar.value_and_grad(_masked_loss)).lower(*args).compile()
    assert context.chosen[0].schedule.value == (schedule or "1f1b")
    assert P("data") in context.chosen[0].inner.consts
    _close(compiled(*args), expected)


def test_zb_h1_refuses_values_made_from_the_batch_and_integer_operands():
    args, _ = _masked_case()
    with pipelining(autopar.Pipeline(schedule="zb-h1", microbatches=4),
                    _mesh({"stage": 4, "data": 2})):
        with pytest.raises(PipelineError, match="integer operands.*zb-h1.*schedule=\"1f1b\""):
            jax.jit(autopar.value_and_grad(_masked_loss)).lower(*args)

    def gated(params, x, ids, y):   # the float gate alone
        gate = jnp.tanh(x @ params["gate"])
        h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w) * gate, None),
                            x @ params["embed"], params["layers"])
        return jnp.mean((h @ params["head"] - y) ** 2)

    with pipelining(autopar.Pipeline(schedule="zb-h1", microbatches=4),
                    _mesh({"stage": 4, "data": 2})):
        with pytest.raises(PipelineError, match="computed from the batch.*zb-h1"):
            jax.jit(autopar.value_and_grad(gated)).lower(*args)


def test_a_value_made_from_the_batch_and_stacked_per_layer_is_refused():
    def loss(params, x, ids, y):
        per_layer = jnp.broadcast_to(jnp.tanh(x @ params["gate"]), (8, *x.shape[:1], 1))
        h, _ = jax.lax.scan(lambda h, wm: (jnp.tanh(h @ wm[0]) * wm[1], None),
                            x @ params["embed"], (params["layers"], per_layer))
        return jnp.mean((h @ params["head"] - y) ** 2)

    args, _ = _masked_case()
    with pipelining(autopar.Pipeline(microbatches=4), _mesh({"stage": 4, "data": 2})):
        with pytest.raises(PipelineError, match="stacked per layer"):
            jax.jit(autopar.value_and_grad(loss)).lower(*args)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_bfloat16_compute_pipelines(schedule):
    """bf16 activations cross the region's all-reduces (summed in float32: a bf16 all-reduce
    in a partly manual shard_map crashes XLA:CPU); results agree to bf16 accuracy. (Under
    zb-h1, B and W make the layers' bf16 weight casts again.)"""
    config = gpt.Config(scan_layers=True, layers=4, dtype=jnp.bfloat16)
    _, (params, _, batch) = gpt.make_train_step(config)
    loss_fn = gpt._loss_fn(config)
    want_loss, want = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    settings = autopar.Pipeline(schedule=schedule, microbatches=4)
    compiled = _pipelined(autopar.value_and_grad(loss_fn), settings,
                          _mesh({"stage": 4, "data": 2}), schedule)(params, batch)
    loss, got = compiled(params, batch)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-3)
    norm = lambda t: float(optax.global_norm(t))  # noqa: E731
    assert norm(jax.tree.map(jnp.subtract, got, want)) < 0.02 * norm(want)
