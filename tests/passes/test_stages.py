"""The pipeline-stage pass: schedule figures, the layer-stack split, and the batch-axis
analysis that proves microbatching exact (or names the op that breaks it)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from autopar.errors import PipelineError
from autopar.passes.stages import batch_axes, search, split
from autopar.passes.stages.batch_axes import BatchSum, Mode
from autopar.passes.stages.prepare import Post
from autopar.passes.stages.schedules import (TABLED, Op, Schedule, bubble_fraction, in_flight,
                                             slots, stash_slots, table, table_bubble, ticks)
from autopar.passes.stages.tabled import _Leaf, _Residuals

G, F, I, Z = Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED, Schedule.ZB_H1


@pytest.mark.parametrize("schedule, s, m, v, n_ticks, bubble", [
    (G, 4, 8, 1, 11, 3 / 11),
    (G, 1, 8, 1, 8, 0.0),
    (F, 4, 8, 1, 14, 3 / 11),
    (F, 2, 4, 1, 6, 1 / 5),
    (I, 4, 8, 2, 19, 3 / 19),
    (Z, 4, 8, 1, 3 * 8 + 3 + 2, 3 / 24),    # ideal 3M + S - 1, two slots more (memory cap)
    (Z, 2, 4, 1, 3 * 4 + 1, 1 / 12),
    (Z, 4, 4, 1, 3 * 4 + 3, 3 / 12),
    (Z, 8, 16, 1, 3 * 16 + 7 + 2, 7 / 48),
])
def test_schedule_figures(schedule, s, m, v, n_ticks, bubble):
    assert ticks(schedule, s, m, v) == n_ticks
    assert bubble_fraction(schedule, s, m, v) == pytest.approx(bubble)


@pytest.mark.parametrize("schedule, expected", [
    (G, [8, 8, 8, 8]), (F, [4, 3, 2, 1]), (Z, [4, 4, 4, 4]), (I, [8, 8, 8, 8])])
def test_in_flight_per_stage(schedule, expected):
    assert [in_flight(schedule, 4, 8, s) for s in range(4)] == expected
    assert stash_slots(4) == 7


@pytest.mark.parametrize("schedule", sorted(TABLED, key=lambda s: s.value))
@pytest.mark.parametrize("s, m", [(1, 3), (2, 2), (2, 4), (4, 4), (4, 8), (8, 16), (3, 7)])
def test_tables_run_every_microbatch_in_dependency_order(schedule, s, m):
    """Each stage runs F, B and W of every microbatch once, in microbatch order; F waits for
    the previous stage's F, B for the next stage's B (the last stage's for its own F), W for
    B, each from an earlier slot; stage s holds at most S - s microbatches between F and B."""
    tab = table(schedule, s, m)
    at = {}
    for stage, (ops, micro) in enumerate(zip(tab.ops, tab.micro)):
        for t, (op, i) in enumerate(zip(ops, micro)):
            if op is not Op.IDLE:
                assert (stage, op, i) not in at
                at[(stage, op, i)] = t
        for op in (Op.F, Op.B, Op.W):
            assert [i for o, i in zip(ops, micro) if o is op] == list(range(m))
        assert max(sum((o is Op.F) - (o is Op.B) for o in ops[:t + 1])
                   for t in range(tab.slots)) <= s - stage
    for (stage, op, i), t in at.items():
        if op is Op.F and stage > 0:
            assert at[(stage - 1, Op.F, i)] < t
        if op is Op.B:
            assert at[(stage + 1, Op.B, i) if stage < s - 1 else (stage, Op.F, i)] < t
        if op is Op.W:
            assert at[(stage, Op.B, i)] < t
    assert 0 <= table_bubble(schedule, s, m) < 1


def _body_with(op):
    """A per-layer function of an activation [B, D] using ``op``."""
    def body(x):
        return op(x)
    return jax.make_jaxpr(body)(jnp.ones((8, 4)))


@pytest.mark.parametrize("op", [
    lambda x: jnp.tanh(x) * 2.0 + x.T.T,
    lambda x: x @ jnp.ones((4, 4)),
    lambda x: x - x.mean(axis=1, keepdims=True),
    lambda x: jnp.cumsum(x, axis=1),
    lambda x: jax.nn.gelu(x).reshape(8, 2, 2).reshape(8, 4),
])
def test_per_example_bodies_pass(op):
    result = batch_axes.analyze(_body_with(op), [0], Mode.BODY, "the layers")
    assert result.outputs == [0]


@pytest.mark.parametrize("op, name", [
    (lambda x: x - x.mean(axis=0, keepdims=True), "reduce_sum"),       # batch norm statistics
    (lambda x: jnp.cumsum(x, axis=0), "cumsum"),
    (lambda x: x @ (x.T @ x), "dot_general"),
    (lambda x: x[::-1], "rev"),
    (lambda x: x.reshape(4, 8).reshape(8, 4), "reshape"),
])
def test_mixing_bodies_name_the_op(op, name):
    with pytest.raises(PipelineError, match=f"`{name}` mixes examples") as info:
        batch_axes.analyze(_body_with(op), [0], Mode.BODY, "the layers")
    # no schedule microbatches such layers: the fix is no pipeline, not another schedule
    assert "pipeline=None" in str(info.value) and "gpipe" not in str(info.value)


def _tokens_body(op):
    """A per-layer function of an activation [B, S, D] using ``op``."""
    return jax.make_jaxpr(op)(jnp.ones((8, 3, 4)))


@pytest.mark.parametrize("op", [
    lambda x: (x.reshape(24, 4) @ jnp.ones((4, 4))).reshape(8, 3, 4),    # tokens as rows
    lambda x: jnp.tanh(x.reshape(24, 4)).reshape(8, 12).reshape(8, 3, 4),
    lambda x: x.reshape(96).reshape(8, 12).reshape(8, 3, 4),      # all merged, then back
])
def test_a_batch_merged_with_the_axes_after_it_keeps_examples_apart(op):
    assert batch_axes.analyze(_tokens_body(op), [0], Mode.BODY, "the layers").outputs == [0]


@pytest.mark.parametrize("op, name", [
    (lambda x: x - x.reshape(24, 4).mean(axis=0)[None, None], "reduce_sum"),   # over the rows
    (lambda x: x.reshape(12, 8).reshape(8, 3, 4), "reshape"),        # cuts into the batch
    (lambda x: x.reshape(24, 4)[::-1].reshape(8, 3, 4), "rev"),
])
def test_a_merged_batch_axis_mixes_where_its_examples_meet(op, name):
    with pytest.raises(PipelineError, match=f"`{name}` mixes examples"):
        batch_axes.analyze(_tokens_body(op), [0], Mode.BODY, "the layers")


def test_a_merged_batch_stays_merged_to_the_body_s_output():
    body = _tokens_body(lambda x: jnp.tanh(x.reshape(24, 4)))
    assert batch_axes.analyze(body, [0], Mode.BODY, "the layers").outputs == [
        batch_axes.Merged(0, 3)]


def _loss_states(loss):
    jaxpr = jax.make_jaxpr(loss)(jnp.ones((8, 4)), jnp.ones((8, 4)))
    return batch_axes.analyze(jaxpr, [0, 0], Mode.LOSS, "the loss").outputs[0]


@pytest.mark.parametrize("loss", [
    lambda y, t: jnp.mean((y - t) ** 2),
    lambda y, t: jnp.mean((y.reshape(-1) - t.reshape(-1)) ** 2),   # flattened first
])
def test_mean_loss_is_one_batch_sum_scaled_by_the_count(loss):
    state = _loss_states(loss)
    assert isinstance(state, BatchSum) and len(state.scales) == 1
    assert state.scales[0][1] == pytest.approx(1 / 32)


@pytest.mark.parametrize("loss", [
    lambda y, t: jnp.sum(y * t) / jnp.sum(t),               # normalized by a batch count
    lambda y, t: jnp.log(jnp.sum(y ** 2)),                  # not linear in the sum
    lambda y, t: jnp.mean(y) + 1.0,                         # a batch-independent term
    lambda y, t: jnp.mean((y - y.mean(axis=0, keepdims=True)) ** 2),       # batch statistics
])
def test_losses_that_are_not_sums_over_examples_raise(loss):
    with pytest.raises(PipelineError, match="(mixes examples|acts on a sum over the batch's "
                                            "examples).*gpipe"):
        _loss_states(loss)


def test_pre_mode_lets_examples_mix():
    jaxpr = jax.make_jaxpr(lambda x: x - x.mean(axis=0, keepdims=True))(jnp.ones((8, 4)))
    assert batch_axes.analyze(jaxpr, [0], Mode.PRE, "pre").outputs == [0]


def _stacked_loss(w, x):
    def layer(h, wi):
        return jnp.tanh(h @ wi), None

    h, _ = jax.lax.scan(layer, x @ w["embed"], w["layers"])
    return jnp.mean(h ** 2)


def test_split_finds_the_scan_over_parameters_and_replays_it():
    w = {"embed": jnp.full((4, 6), 0.1), "layers": jnp.full((4, 6, 6), 0.05)}
    x = jnp.arange(48.0).reshape(8, 6)[:, :4] / 10
    flat, tree = jax.tree.flatten((w, x))
    fun = lambda *leaves: [_stacked_loss(*jax.tree.unflatten(tree, leaves))]  # noqa: E731
    closed = jax.make_jaxpr(fun)(*flat)
    stack = split.find_stack(closed, [True, True, False])
    assert stack.layers == 4 and stack.carry_shape == (8, 6)
    ops = split.pre_fn(stack)(*flat)
    out = split.stage_fn(stack)([], [ops[0]], ops[1:])
    assert jnp.allclose(split.post_fn(stack)(flat, out)[0], _stacked_loss(w, x))


def test_operands_read_only_narrowed_are_found():
    """A stacked operand whose one use is a convert to a narrower float is narrowed; one also
    read at its own width, or widened, is not."""
    def loss(w, x):
        def layer(h, p):
            h = h @ p["narrow"].astype(jnp.bfloat16).astype(jnp.float32)
            h = h * p["both"].astype(jnp.bfloat16).astype(jnp.float32)[None] + p["both"][None]
            return h * p["wide"].astype(jnp.float32)[None] + p["kept"][None], None
        return [jnp.sum(jax.lax.scan(layer, x, w)[0])]

    w = {"narrow": jnp.ones((3, 4, 4)), "both": jnp.ones((3, 4)),
         "wide": jnp.ones((3, 4), jnp.bfloat16), "kept": jnp.ones((3, 4))}
    flat, tree = jax.tree.flatten((w, jnp.ones((8, 4))))
    closed = jax.make_jaxpr(lambda *f: loss(*jax.tree.unflatten(tree, f)))(*flat)
    stack = split.find_stack(closed, [True] * 4 + [False])
    narrowed = dict(zip(sorted(w), split.narrowed_xs(stack), strict=True))
    assert narrowed == {"both": None, "kept": None, "narrow": jnp.bfloat16, "wide": None}


def test_split_without_a_stack_says_to_scan_layers():
    closed = jax.make_jaxpr(lambda w, x: [jnp.sum(x @ w)])(jnp.ones((4, 4)), jnp.ones((8, 4)))
    with pytest.raises(PipelineError, match="nn.scan"):
        split.find_stack(closed, [True, False])


@pytest.mark.parametrize("op", [
    lambda x: jax.lax.dynamic_update_slice(x, jnp.zeros((1, 4)), (2, 0)),   # overwrites example 2
    lambda x: jax.lax.dynamic_slice(x, (1, 0), (8, 4)) * 0 + jax.lax.dynamic_slice(
        x, (0, 0), (1, 4)),                                                  # reads example 0
    lambda x: x.at[3].add(1.0),
])
def test_indexing_along_the_batch_axis_mixes(op):
    with pytest.raises(PipelineError, match="mixes examples"):
        batch_axes.analyze(_body_with(op), [0], Mode.BODY, "the layers")


def test_indexing_other_axes_keeps_examples_apart():
    def op(x):
        x = jax.lax.dynamic_update_slice(x, jnp.zeros((8, 1)), (0, 2))
        return jax.lax.dynamic_slice(x, (0, 1), (8, 3)).sum(axis=1, keepdims=True) + x
    assert batch_axes.analyze(_body_with(op), [0], Mode.BODY, "the layers").outputs == [0]


# ----------------------------------------------------------------------------- the search

LAYER = search.LayerPlan(inner=None, time_s=1.0, kept_bytes=100, carry_bytes=10, hop_s=0.5,
                         devices=2)


@pytest.mark.parametrize("schedule, s, m, l, time_s, held", [
    # gpipe: (M + S - 1) ticks of (l t (1 + 1/3) + 2 h), the backward running the forward
    # again; (M + S - 1) c + l a held (each tick's input, one stage's recompute)
    (G, 4, 8, 2, 11 * (2 * 4 / 3 + 1), 11 * 10 + 2 * 100),
    # 1f1b: S-1 warmup ticks of (l t / 3 + h), M steady ticks of (l t (1 + 1/3) + 2 h), S-1
    # cooldown ticks of (l t + h); (2S - 1) c + l a held
    (F, 4, 8, 2, 3 * (2 / 3 + 0.5) + 8 * (2 * 4 / 3 + 1) + 3 * (2 + 0.5), 7 * 10 + 2 * 100),
    (F, 2, 4, 1, 1 * (1 / 3 + 0.5) + 4 * (4 / 3 + 1) + 1 * (1 + 0.5), 3 * 10 + 100),
    # zb-h1: T slots, each as long as its longest op (l t / 3 for F and B, 2 l t / 3 for W)
    # and 2 h: 21 of the 29 slots run a W somewhere; R l a + P l c + (Q_f + Q_b) c held
    (Z, 4, 8, 2, 21 * 2 * 2 / 3 + 8 * 2 / 3 + 29 * 1, None),
])
def test_search_prices_each_schedule_by_its_emitted_loop(schedule, s, m, l, time_s, held):
    priced = search.price(schedule, s, m, l, LAYER)
    if schedule is Z:
        tab = table(schedule, s, m)
        assert sum(any(ops[t] is Op.W for ops in tab.ops) for t in range(tab.slots)) == 21
    assert priced.time_s == pytest.approx(time_s)
    if held is None:
        tab = table(schedule, s, m)
        held = l * (tab.held * 100 + tab.pending_w * 10) + (tab.waiting_f + tab.waiting_b) * 10
    assert priced.activation_bytes == held


@pytest.mark.parametrize("schedule", [G, F, Z])
def test_search_counts_the_layers_collectives_and_sends_as_the_loops_run_them(schedule):
    """A layer's own collectives by kind and its carry as sent (wider than held, as XLA:CPU
    carries bf16) scale with the layer passes the emitted loops run, as its wire bytes do."""
    layer = dataclasses.replace(LAYER, comm_bytes=96.0, send_bytes=20,
                                comm_by_kind=(("all-reduce", 3, 64.0), ("all-gather", 1, 32.0)))
    priced = search.price(schedule, 4, 8, 2, layer)
    passes = (priced.comm_bytes - priced.sends * 20) / 96.0
    assert priced.send_bytes == priced.sends * 20
    assert dict((k, (n, b)) for k, n, b in priced.layer_collectives) == {
        "all-reduce": (round(3 * passes), pytest.approx(64.0 * passes)),
        "all-gather": (round(passes), pytest.approx(32.0 * passes))}


@pytest.mark.parametrize("schedule, forwards, wholes", [
    (G, 11 * 2, 11 * 2),                  # every tick a forward and a backward, l = 2
    (F, (3 + 8) * 2, (8 + 3) * 2),        # warmup and steady forwards, steady and cooldown
    (Z, 8 * 2, 8 * 2 * (1 / 3 + 2 / 3)),  # a microbatch's F, and its B and W
])
def test_search_prices_a_planned_forward_as_the_forward_ticks_run_it(schedule, forwards, wholes):
    """A layer's forward planned alone prices each forward the loops run (its collectives,
    flops and time), where a third of the whole layer would miss a Megatron layer's two
    forward sums (two of its four, with the backward's)."""
    forward = search.Forward(time_s=0.5, flops=40.0, comm_bytes=64.0,
                             comm_by_kind=(("all-reduce", 2, 64.0),))
    layer = dataclasses.replace(LAYER, flops=90.0, comm_bytes=128.0,
                                comm_by_kind=(("all-reduce", 4, 128.0),), forward=forward)
    priced = search.price(schedule, 4, 8, 2, layer)
    assert dict((k, (n, b)) for k, n, b in priced.layer_collectives) == {
        "all-reduce": (round(2 * forwards + 4 * wholes),
                       pytest.approx(64.0 * forwards + 128.0 * wholes))}
    assert priced.flops == pytest.approx(40.0 * forwards + 90.0 * wholes)
    assert priced.comm_bytes == pytest.approx(64.0 * forwards + 128.0 * wholes
                                              + priced.sends * 10)
    # the forward's time replaces a third of the layer's: 0.5 - 1/3 longer a layer forward
    # in every tick that runs one (a ZB-H1 slot lasts its longest op, the W)
    thirds = search.price(schedule, 4, 8, 2, dataclasses.replace(layer, forward=None))
    if schedule is not Z:
        assert priced.time_s - thirds.time_s == pytest.approx(forwards * (0.5 - 1 / 3))


@pytest.mark.parametrize("schedule", [F, Z])
def test_search_prices_the_head_on_the_last_stage_once_a_microbatch(schedule):
    """1F1B and ZB-H1 run the head and loss in the region: each of 1F1B's M steady ticks, and
    each ZB-H1 slot whose last stage runs an F (one a microbatch), lasts the head longer
    (a head that dwarfs the layers, in the slots); its flops and bytes count M times."""
    def head(time_s):
        return Post(ins=(), y=None, time_s=time_s, flops=7.0, comm_bytes=3.0)
    base = search.price(schedule, 4, 8, 2, LAYER)
    long, longer = (search.price(schedule, 4, 8, 2, LAYER, post=head(t)) for t in (10.0, 20.0))
    assert longer.time_s - long.time_s == pytest.approx(8 * 10.0)
    if schedule is F:
        assert long.time_s == pytest.approx(base.time_s + 8 * 10.0)
    assert (long.flops, long.comm_bytes) == pytest.approx(
        (base.flops + 8 * 7.0, base.comm_bytes + 8 * 3.0))


def test_search_keeps_the_fastest_that_fits_else_the_smallest():
    small = search.price(F, 4, 8, 2, LAYER)
    fast = dataclasses.replace(search.price(G, 4, 8, 2, LAYER), time_s=small.time_s / 2,
                               activation_bytes=5000)
    options = [fast, small]
    assert search.best(options, None) is fast
    assert search.best(options, 1000) is small                # only it fits
    assert search.best(options, 10) is small                  # none fits: the smallest


@pytest.mark.parametrize("schedule, s, m, v", [(G, 4, 8, 1), (F, 4, 8, 1), (F, 2, 3, 1),
                                               (Z, 4, 8, 1), (I, 2, 4, 2), (I, 4, 8, 2)])
def test_chart_slots_run_every_microbatch_once_in_the_schedule_s_ticks(schedule, s, m, v):
    rows = slots(schedule, s, m, v)
    n = ticks(schedule, s, m, v)
    tabled = schedule in TABLED
    one_loop = tabled or schedule is F
    assert len(rows) == s and all(len(r) == (n if one_loop else 2 * n) for r in rows)
    for row in rows:
        work = [w for cell in row for w in cell.split()]
        forward = sorted(w for w in work if w.startswith("F"))
        backward = sorted(w for w in work if w.startswith("B"))
        assert len(forward) == len(backward) == m * v
        assert [w[1:] for w in forward] == [w[1:] for w in backward]
        assert len([w for w in work if w.startswith("W")]) == (m if tabled else 0)
    if schedule is F:   # the last stage runs a microbatch's backward in its forward's tick
        assert rows[-1][s - 1] == "F0 B0"
    if schedule is F:
        return
    idle = sum(cell == "" for row in rows for cell in row) / (len(rows) * len(rows[0]))
    assert idle == pytest.approx(table_bubble(schedule, s, m, v))


# ----------------------------------------------------------------------------- uneven stages

@pytest.mark.parametrize("layers, chunks, ranges", [
    (8, 4, ((0, 2), (2, 4), (4, 6), (6, 8))),
    (6, 4, ((0, 2), (2, 4), (4, 5), (5, 6))),
    (7, 3, ((0, 3), (3, 5), (5, 7))),
])
def test_chunk_ranges_are_balanced_and_contiguous(layers, chunks, ranges):
    assert split.chunk_ranges(layers, chunks) == ranges


def test_a_padded_stack_passes_its_carry_through_the_pads():
    def loss(w, x):
        return jax.lax.scan(lambda h, w_l: (jnp.tanh(h * w_l), None), x, w)[0].sum()

    w, x = jnp.linspace(0.5, 1.5, 3), jnp.arange(4.0)
    stack = split.padded(split.find_stack(jax.make_jaxpr(loss)(w, x), [True, False]), 2)
    assert stack.positions == (0, 1, 2, -1) and stack.stacked == 4 and stack.layers == 3
    carry, stacked_w, live = split.pre_fn(stack)(w, x)     # no consts; the flags come last
    assert jnp.array_equal(live, jnp.array([1.0, 1.0, 1.0, 0.0]))
    out = split.stage_fn(stack)([], [carry], [stacked_w, live])[0]
    assert jnp.allclose(out, jnp.tanh(jnp.tanh(jnp.tanh(x * w[0]) * w[1]) * w[2]))
    assert split.padded(split.find_stack(jax.make_jaxpr(loss)(w, x), [True, False]), 3) \
        .positions is None


def test_zb_h1_makes_weight_casts_again_rather_than_storing_them():
    """F stores what a layer's pullback reads that depends on its activation; a weight cast to
    the compute type (bf16 compute, float32 weights) is made again by B and W, and the rebuilt
    pullback gives the layer's own cotangents."""
    def layer(consts, x, x_l):
        (scale,) = consts
        h = jnp.tanh(x @ x_l["w1"].astype(jnp.bfloat16))
        return (h @ x_l["w2"].astype(jnp.bfloat16)) * scale.astype(jnp.bfloat16)

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    consts = [jnp.float32(0.5)]
    x = jax.random.normal(k1, (4, 8), jnp.bfloat16)
    x_l = {"w1": jax.random.normal(k2, (8, 16)), "w2": jax.random.normal(k3, (16, 8))}
    res = _Residuals(layer)
    y, stored = res.forward(consts, x, x_l)
    kinds = [kind for kind, _ in res.recipe]
    # the two bf16 weights (and the bf16 scale) are made again; the activation-dependent
    # values are stored; none of the stored is weight-shaped
    assert kinds.count(_Leaf.AGAIN) >= 2 and _Leaf.STORED in kinds, kinds
    assert not any(s.shape in ((8, 16), (16, 8)) for s in stored), [s.shape for s in stored]
    dy = jax.random.normal(jax.random.key(1), y.shape, y.dtype)
    got = res.pullback(consts, x_l, stored)(dy)
    want = jax.vjp(layer, consts, x, x_l)[1](dy)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and jnp.array_equal(a, b)
