"""Sequence-parallel attention (passes.attention, passes.sequence_parallel): each strategy,
forced or chosen, computes what one device computes, forward and gradients; bad requests are
AutoparErrors; the memory budget finds a sequence-parallel plan where nothing else fits."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.models import common
from autopar.passes import attention as attn
from autopar.passes import attention_match, sequence_parallel
from autopar.passes.strategies import Rewrite, RewriteKind

HEAD_DIM = 16


def _qkv(batch, seq, heads, kv_heads, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (batch, seq, heads, HEAD_DIM))
    k = jax.random.normal(ks[1], (batch, seq, kv_heads, HEAD_DIM))
    v = jax.random.normal(ks[2], (batch, seq, kv_heads, HEAD_DIM))
    w = jax.random.normal(ks[3], (batch, seq, heads, HEAD_DIM))
    return q, k, v, w


def _padding(batch, seq):
    """Key masks with the last 3/8 of every other sequence padded."""
    lengths = np.where(np.arange(batch) % 2, seq - 3 * seq // 8, seq)
    return jnp.asarray(np.arange(seq)[None, :] < lengths[:, None])


def _close(got, want, rtol=2e-3):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = float(jnp.abs(b).max()) + 1e-6
        assert float(jnp.abs(a - b).max()) <= rtol * scale


def _collectives(plan, *args) -> set[str]:
    """The shard_map regions' collectives in the lowered program (no second compile)."""
    return set(re.findall(r"stablehlo\.(all_to_all|collective_permute)",
                          plan.jit().lower(*args).as_text()))


def _value_and_grads(attend, mask, w):
    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, mask) * w)
    return lambda q, k, v: jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("causal,groups,padded", [(True, 2, True), (False, 1, False)])
def test_kernels_equal_plain_attention(causal, groups, padded, monkeypatch):
    monkeypatch.setattr(attn, "BLOCK_K", 16)  # several key blocks
    q, k, v, w = _qkv(2, 64, 2 * groups, 2)
    mask = _padding(2, 64) if padded else None
    got = jax.jit(_value_and_grads(
        lambda q, k, v, m: attn.attention(q, k, v, m, causal=causal), mask, w))(q, k, v)
    want = jax.jit(_value_and_grads(
        lambda q, k, v, m: attn.reference(q, k, v, m, causal=causal), mask, w))(q, k, v)
    _close(got, want)


@pytest.mark.parametrize("strategy,causal,groups,padded,collective", [
    ("ulysses", True, 2, True, "all_to_all"),
    ("ring", True, 1, True, "collective_permute"),
])
def test_forced_strategy_on_8_devices(strategy, causal, groups, padded, collective,
                                      monkeypatch):
    monkeypatch.setattr(attn, "BLOCK_K", 16)  # several key blocks per device
    q, k, v, w = _qkv(2, 256, 8 * groups, 8)
    mask = _padding(2, 256) if padded else jnp.ones((2, 256), bool)
    step = _value_and_grads(
        lambda q, k, v, m: autopar.attention(q, k, v, m, causal=causal, strategy=strategy),
        mask, w)
    plan = autopar.plan(step, q, k, v, mesh={"x": 8}, pipeline=None)
    assert all(label.endswith(f"{strategy}(x)") for label in plan.stats["attention"])
    assert f"attention backward: {strategy}(x)" in plan.report()   # the per-layer table
    want = jax.jit(_value_and_grads(
        lambda q, k, v, m: attn.reference(q, k, v, m, causal=causal), mask, w))(q, k, v)
    _close(plan.jit()(q, k, v), want)
    assert collective in _collectives(plan, q, k, v)


def _projected_loss(batch, seq, kv_heads, groups, causal, mask, fill=-1e30):
    """A loss whose attention is written in jnp (as the example models do), GQA by repeat;
    masked scores take ``fill``."""
    heads = kv_heads * groups

    def loss(p, x):
        q = (x @ p["wq"]).reshape(batch, seq, heads, HEAD_DIM)
        k = (x @ p["wk"]).reshape(batch, seq, kv_heads, HEAD_DIM)
        v = (x @ p["wv"]).reshape(batch, seq, kv_heads, HEAD_DIM)
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD_DIM)
        valid = mask[:, None, None, :]
        if causal:
            valid = valid & common.causal_mask(seq)
        s = jnp.where(valid, s, fill)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return jnp.mean(jnp.tanh(o))

    ks = jax.random.split(jax.random.key(1), 4)
    params = {name: jax.random.normal(key, (32, n * HEAD_DIM)) * 0.3 for name, key, n in
              (("wq", ks[0], heads), ("wk", ks[1], kv_heads), ("wv", ks[2], kv_heads))}
    return loss, params, jax.random.normal(ks[3], (batch, seq, 32))


#: Every strategy, forced and the planner's own (None), on each mesh; over the three meshes
#: each strategy meets causal and not, MHA (1 group) and GQA, padded and not.
_VARIANTS = [(True, 2, True), (False, 1, False), (False, 2, True)]
_MESHES = [(8,), (2, 4), (2, 2, 2)]


@pytest.mark.parametrize("shape,attention,causal,groups,padded", [
    (shape, attention, *_VARIANTS[(i + j) % 3])
    for i, shape in enumerate(_MESHES) for j, attention in enumerate(["ulysses", "ring", None])])
def test_recognized_attention_equals_one_device(shape, attention, causal, groups, padded,
                                                monkeypatch):
    monkeypatch.setattr(attn, "BLOCK_K", 32)
    names = ("a", "b", "c")[:len(shape)]
    mask = _padding(2, 256) if padded else jnp.ones((2, 256), bool)
    kv_heads = 8 if shape == (8,) else 4   # Ulysses over 8 devices needs 8 kv heads
    loss, params, x = _projected_loss(2, 256, kv_heads, groups, causal, mask)

    def step(p, x):
        return autopar.value_and_grad(loss)(p, x)

    plan = autopar.plan(step, params, x, mesh=dict(zip(names, shape)), attention=attention,
                        pipeline=None)
    labels = plan.stats["attention"]
    assert [label.split(":")[0] for label in labels] == ["forward", "backward"]
    if attention is not None:
        assert all(f"{attention}(" in label for label in labels), labels
        want = "all_to_all" if attention == "ulysses" else "collective_permute"
        assert want in _collectives(plan, params, x)
    _close(plan.jit()(params, x), jax.jit(jax.value_and_grad(loss))(params, x))


@pytest.mark.parametrize("shape,ulysses,ring", [((2, 4), ("a", "b"), None),
                                                 ((2, 2, 2), ("a", "c"), "b")])
def test_a_ulysses_group_of_several_axes_equals_plain_attention(shape, ulysses, ring,
                                                                 monkeypatch):
    """Ulysses over several mesh axes as one group (all-to-alls over all of them at once),
    alone and around a ring on an axis between them: forward and backward regions."""
    monkeypatch.setattr(attn, "BLOCK_K", 32)
    names = ("a", "b", "c")[:len(shape)]
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
    kind = RewriteKind.RING_ATTENTION if ring else RewriteKind.ULYSSES_ATTENTION
    manual = tuple(a for a in names if a in ulysses or a == ring)
    reg = sequence_parallel.region(mesh, Rewrite(kind, manual, (("ulysses", ulysses),
                                                                ("ring", ring))),
                                   causal=True, scale=1 / np.sqrt(HEAD_DIM), seq=256)
    q, k, v, w = _qkv(2, 256, 16, 8)
    mask = _padding(2, 256)
    o, lse = jax.jit(sequence_parallel.forward_region(reg))(q, k, v, mask)
    want, vjp = jax.vjp(lambda q, k, v: attn.reference(q, k, v, mask, causal=True), q, k, v)
    _close(o, want)
    _close(jax.jit(sequence_parallel.backward_region(reg))(q, k, v, mask, o, lse, w), vjp(w))


@pytest.mark.parametrize("attention, want", [
    ("ring(seq)", ["ring(seq)"]),
    ("ulysses(seq) + ring(data)", ["ulysses(seq)", "ring(data)"]),
    ("ring(data) + heads(seq)", ["ring(data)", "heads(seq)"]),
])
def test_attention_forced_over_named_axes_runs_there_and_equals_one_device(attention, want,
                                                                            monkeypatch):
    """``attention=`` in the report's spelling puts each kind on the axes it names (Ulysses
    inside a ring among them) and the step computes what one device computes."""
    monkeypatch.setattr(attn, "BLOCK_K", 32)
    loss, params, x = _projected_loss(2, 256, 4, 2, True, _padding(2, 256))

    def step(p, x):
        return autopar.value_and_grad(loss)(p, x)

    plan = autopar.plan(step, params, x, mesh={"data": 2, "seq": 4}, attention=attention,
                        pipeline=None)
    for label in plan.stats["attention"]:
        assert all(w in label for w in want), (label, want)
    if "ring(data)" in want:   # `data` carries the sequence, not the batch its name suggests
        assert "gives those axes other work" in plan.stats["axis_roles"]["note"]
    _close(plan.jit()(params, x), jax.jit(jax.value_and_grad(loss))(params, x))


@pytest.mark.parametrize("attention, match", [
    ("ring(data,seq)", "a ring runs over one mesh axis"),
    ("ring + replicated", "`replicated` takes no axes and no other kind"),
    ("ring(seq) + ulysses(seq)", "repeats a kind or an axis"),
    ("ring(", "`ring\\(` names no strategy"),
    ("ring()", "names an empty axis"),
    ("ring(cp)", "names mesh axis `cp`, which the mesh lacks"),
])
def test_attention_over_named_axes_that_cannot_be_is_refused(attention, match):
    step, args = _abstract_step(1024, heads=8, kv_heads=8)
    with pytest.raises(autopar.ArgumentError, match=match):
        autopar.plan(step, *args, mesh={"data": 2, "seq": 4}, attention=attention,
                     pipeline=None)


def test_an_axis_the_mesh_lacks_is_refused_where_no_attention_is_seen():
    """The strategy's axes are checked before planning: a step with no attention autopar
    recognizes is refused alike, not only warned about."""
    with pytest.raises(autopar.ArgumentError, match="names mesh axis `cp`, which the mesh lacks"):
        autopar.plan(lambda w, x: jnp.tanh(x @ w).sum(), jnp.ones((16, 16)), jnp.ones((8, 16)),
                     mesh={"data": 8}, attention="ring(cp)")
    with pytest.raises(autopar.ArgumentError, match="names mesh axis `cp`, which the mesh lacks"):
        autopar.parallelize(lambda w, x: x @ w, mesh={"data": 8}, attention="ring(cp)")


def test_the_long_context_llama_on_2x4_splits_attention_over_the_whole_mesh():
    """32k tokens, GQA 32/8, batch 2 on (2, 4) (the long-context suite's case, planned from
    shapes): Ulysses over ``model`` in both passes, and ``data`` splitting the attention too,
    in the Ulysses group or over the batch (which of the two the estimate prefers moved with
    the cost model's calibration; benchmarks/results/long_context.md compares the compiled
    program with the hand-written Ulysses over one flat axis)."""
    from benchmarks import long_context
    fn, args = long_context.train_step_and_args(32768, 2)
    plan = autopar.plan(fn, *args, mesh={"data": 2, "model": 4}, hardware="h100",
                        memory_budget="80GB", check_memory=False, pipeline=None,
                        verbose=False)
    attention = set(plan.stats["attention"])
    assert attention in ({"forward: ulysses(data,model)", "backward: ulysses(data,model)"},
                         {"forward: ulysses(model) + batch(data)",
                          "backward: ulysses(model) + batch(data)"}), attention


@pytest.mark.parametrize("causal,fill", [(False, float(np.finfo(np.float32).min)),
                                         (True, -1e9), (False, -np.inf), (True, -10.0)])
def test_rows_with_every_key_masked_are_computed_as_the_jnp_code_does(causal, fill):
    """A padding-only example (and, causally, the left-padded rows of another) has rows
    whose every key is masked: the jnp code weighs all keys alike there (a finite fill) or
    gives NaN (-inf); the rewritten attention computes the same, forward and gradients. A
    fill too high to mask (-10) is not attention with a mask: it is left as written."""
    mask = np.ones((2, 64), bool)
    mask[0, :] = False
    mask[1, :24] = False
    loss, params, x = _projected_loss(2, 64, 2, 2, causal, jnp.asarray(mask), fill)
    forward = jax.make_jaxpr(loss)(params, x)
    assert attention_match.recognize(forward)[1] == (0 if fill > -1e4 else 1)

    def step(p, x):
        return autopar.value_and_grad(loss)(p, x)

    plan = autopar.plan(step, params, x, mesh={"a": 2, "b": 4}, pipeline=None)
    got, want = plan.jit()(params, x), jax.jit(jax.value_and_grad(loss))(params, x)
    if np.isinf(fill):
        assert np.isnan(float(got[0])) and np.isnan(float(want[0]))
    else:
        _close(got, want)


def test_recognition_needs_the_forward_pass():
    mask = jnp.ones((2, 64), bool)
    loss, params, x = _projected_loss(2, 64, 2, 2, True, mask)
    forward = jax.make_jaxpr(loss)(params, x)
    assert attention_match.recognize(forward)[1] == 1
    differentiated = jax.make_jaxpr(jax.grad(loss))(params, x)
    assert attention_match.recognize(differentiated)[1] == 0  # its backward reads the probs


def _abstract_step(seq, heads, kv_heads, batch=1, head_dim=64, dtype=jnp.bfloat16):
    shape = jax.ShapeDtypeStruct
    q = shape((batch, seq, heads, head_dim), dtype)
    kv = shape((batch, seq, kv_heads, head_dim), dtype)

    def step(q, k, v):
        return jax.grad(lambda q, k, v: jnp.sum(autopar.attention(q, k, v, causal=True)
                                                .astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
    return step, (q, kv, kv)


def test_bad_requests_name_the_problem_and_the_fix():
    step, args = _abstract_step(1024, heads=8, kv_heads=2)
    with pytest.raises(autopar.AutoparError, match=r"does not divide the 2 kv heads.*ring"):
        autopar.plan(step, *args, mesh={"x": 8}, attention="ulysses", pipeline=None)
    step, args = _abstract_step(1020, heads=8, kv_heads=8)
    with pytest.raises(autopar.AutoparError, match=r"1020 is not a multiple of mesh axis `x`"):
        autopar.plan(step, *args, mesh={"x": 8}, attention="ring", pipeline=None)
    with pytest.raises(autopar.AutoparError, match=r"1020 is not a multiple.*Fix: pad the seq"):
        autopar.plan(step, *args, mesh={"x": 8}, attention="ulysses", pipeline=None)
    step, args = _abstract_step(1024, heads=8, kv_heads=4)
    with pytest.raises(autopar.AutoparError, match=r"divide the 4 kv heads.*Fix: use a mesh "
                                                   r"axis that divides the kv heads"):
        autopar.plan(step, *args, mesh={"x": 8}, attention="heads", pipeline=None)
    with pytest.raises(autopar.AutoparError, match=r"divide the batch 1.*Fix: use a batch"):
        autopar.plan(step, *args, mesh={"x": 8}, attention="batch", pipeline=None)
    with pytest.raises(autopar.ArgumentError, match="`attention='rings'`"):
        autopar.plan(step, *args, mesh={"x": 8}, attention="rings", pipeline=None)
    q = jnp.zeros((1, 64, 6, 16))
    with pytest.raises(autopar.ArgumentError, match="kv_heads must divide"):
        autopar.attention(q, jnp.zeros((1, 64, 4, 16)), jnp.zeros((1, 64, 4, 16)))


def test_bad_attention_inputs_are_refused_with_the_fix():
    q, k = jnp.ones((2, 16, 4, 8)), jnp.ones((2, 16, 2, 8))
    additive = jnp.where(_padding(2, 16), 0.0, -1e9)  # a 0 / -1e9 mask: True would read 0
    with pytest.raises(autopar.ArgumentError, match=r"must be bool.*pass `mask == 0`"):
        autopar.attention(q, k, k, additive)
    with pytest.raises(autopar.ArgumentError, match=r"as many queries as keys, got 16 and 8"):
        autopar.attention(q, k[:, :8], k[:, :8], causal=True)
    with pytest.raises(autopar.ArgumentError, match="empty dimension"):
        autopar.attention(q[:, :0], k[:, :0], k[:, :0])
    with pytest.raises(autopar.ArgumentError, match="floating q, k, v"):
        autopar.attention(q.astype(jnp.int32), k.astype(jnp.int32), k.astype(jnp.int32))
    with pytest.raises(autopar.ArgumentError, match="`scale` must be a Python number"):
        jax.jit(lambda q, k, s: autopar.attention(q, k, k, scale=s))(q, k, 0.5)


def test_a_strategy_forced_on_the_call_is_named_in_its_fix():
    def loss(q, k):
        return jnp.sum(autopar.attention(q, k, k, causal=True, strategy="ulysses") ** 2)

    q, k = jnp.ones((2, 64, 8, 8)), jnp.ones((2, 64, 2, 8))
    with pytest.raises(autopar.ArgumentError, match=r'Fix: use `strategy="ring"`.*`strategy=None`'):
        autopar.plan(lambda q, k: autopar.value_and_grad(loss, argnums=(0, 1))(q, k), q, k,
                     mesh={"x": 8}, pipeline=None)


def test_attention_under_vmap_equals_plain_attention_and_plans():
    """``jax.vmap`` folds its axis into the batch: values and gradients are plain attention's,
    and a planned step with it still splits the attention over the sequence."""
    q, k, v, w = _qkv(4, 64, 4, 2)
    mask = _padding(4, 64)

    def per_example(attend):
        def one(q, k, v, m):
            return attend(q[None], k[None], v[None], m[None], causal=True)[0]
        return lambda q, k, v, m: jax.vmap(one, in_axes=(0, 0, 0, 0))(q, k, v, m)

    got = jax.jit(_value_and_grads(per_example(attn.attention), mask, w))(q, k, v)
    want = jax.jit(_value_and_grads(per_example(attn.reference), mask, w))(q, k, v)
    _close(got, want)
    step = _value_and_grads(per_example(autopar.attention), mask, w)
    plan = autopar.plan(step, q, k, v, mesh={"x": 8}, attention="ring", pipeline=None)
    assert plan.stats["attention"] and "collective_permute" in _collectives(plan, q, k, v)
    _close(plan.jit()(q, k, v), want)


def test_an_attention_strategy_asked_for_a_step_without_attention_warns():
    def step(x, w):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    with pytest.warns(autopar.AttentionWarning, match="no attention autopar recognizes"):
        autopar.plan(step, jnp.ones((16, 8)), jnp.ones((8, 8)), mesh={"x": 8},
                     attention="ring", pipeline=None)


@pytest.mark.parametrize("grad", ["autopar", "jax"])
def test_jnp_attention_in_a_checkpoint_is_planned_whole_or_not_at_all(grad):
    """jnp attention inside ``jax.checkpoint``: under ``autopar.value_and_grad`` it is
    recognized in the checkpointed body, so the backward's recomputation is the planned
    attention too (the ring compiles); under ``jax.value_and_grad`` only the forward would
    match (the backward recomputes it in jnp), so nothing is recognized, and asking for a
    ring warns. Both compute what one device does."""
    loss, params, x = _projected_loss(2, 64, 8, 1, True, jnp.ones((2, 64), bool))

    def checkpointed(p, x):
        return jax.checkpoint(loss)(p, x)

    value_and_grad = autopar.value_and_grad if grad == "autopar" else jax.value_and_grad

    def step(p, x):
        return value_and_grad(checkpointed)(p, x)

    if grad == "autopar":
        plan = autopar.plan(step, params, x, mesh={"x": 8}, attention="ring", pipeline=None)
        assert plan.stats["attention"] and all("ring(" in a for a in plan.stats["attention"])
        assert "collective_permute" in _collectives(plan, params, x)
    else:
        with pytest.warns(autopar.AttentionWarning):
            plan = autopar.plan(step, params, x, mesh={"x": 8}, attention="ring",
                                pipeline=None)
        assert plan.stats["attention"] == []
    _close(plan.jit()(params, x), jax.jit(jax.value_and_grad(loss))(params, x))


def test_memory_budget_finds_sequence_parallel_attention():
    # one kv head and a batch of one: neither heads nor batch split; only the sequence can
    step, args = _abstract_step(32768, heads=32, kv_heads=1, head_dim=128)
    plan = functools.partial(autopar.plan, step, *args, mesh={"x": 8}, hardware="h100",
                             pipeline=None)
    replicated, ring = plan(attention="replicated"), plan(attention="ring")
    assert ring.estimate.peak_memory_bytes < replicated.estimate.peak_memory_bytes
    budget = (ring.estimate.peak_memory_bytes + replicated.estimate.peak_memory_bytes) // 2
    fitted = plan(memory_budget=budget, check_memory=False)
    assert fitted.estimate.peak_memory_bytes <= budget
    assert all(label.endswith("ring(x)") for label in fitted.stats["attention"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_a_sequence_parallel_region_keeps_the_other_axes_splits(attention, dtype):
    """The region is manual over the batch and heads axes too: left automatic, XLA gathered
    the heads over them (a ring over `data` with heads over `model` compiled 4x the
    predicted wire bytes). In bf16 the prediction counts what XLA:CPU moves: float32."""
    step, args = _abstract_step(2048, heads=8, kv_heads=4, batch=2, dtype=dtype)
    plan = autopar.plan(step, *args, mesh={"data": 2, "model": 4}, attention=attention,
                        pipeline=None, hardware="h100")
    assert any("heads(" in label or "batch(" in label for label in plan.stats["attention"])
    predicted, compiled = plan.validate()["wire_bytes"]
    assert 0.8 * compiled <= predicted <= 1.5 * compiled, (predicted, compiled)


def test_the_context_parallel_baselines_compute_the_step_and_compare_takes_them():
    import dataclasses

    import optax

    from autopar import baselines
    from autopar.models import gpt
    config = dataclasses.replace(gpt.TINY, seq=64, batch=2, hidden=64, heads=8, layers=2)
    step, args = gpt.make_train_step(config, value_and_grad=autopar.value_and_grad,
                                     tx=optax.sgd(0.1))
    want = jax.jit(step)(*args)
    for kind in ("ulysses", "ring"):
        _close(baselines.compile_context_baseline(step, args, {"seq": 8}, kind)(*args), want)
    _, measured, _ = autopar.compare(step, args, {"seq": 8}, kinds=["ring"], pipeline=None)
    assert set(measured) == {"autopar", "ring"}
    with pytest.raises(autopar.ArgumentError, match=r"train step `fn\(params, opt_state, batch\)"):
        baselines.compile_context_baseline(lambda p, b: step(p, args[1], b)[2],
                                           (args[0], args[2]), {"seq": 8}, "ring")
