"""Collective overlap (``passes.overlap``): each collective-matmul decomposition computes the
dot it replaces, forward and gradients, on a 2-D mesh (manual over ``model``, ``data``
automatic); plans with the rewrites (collective matmul, FSDP prefetch) match one device; the
compiled program of a realistic-width plan holds the ring loops."""

import dataclasses
import functools
import itertools
import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import autopar
from autopar.cost_model.hardware import get_profile
from autopar.cost_model.hlo import CollectiveKind
from autopar.cost_model.hlo_ir import array_dims, parse_module
from autopar.cost_model.spec import Spec
from autopar.cost_model.timeline import simulate
from autopar.errors import ShardingConflictWarning, SolverFallbackWarning
from autopar.models import bert, mlp
from autopar.passes import estimate
from autopar.passes.cluster import cluster
from autopar.passes.ilp import IlpBuilder
from autopar.passes.overlap import regions, with_collective_matmuls
from autopar.passes.solve import solve
from autopar.passes.overlap.collective_matmul import CollectiveMatmul, Mode, forced
from autopar.passes.strategies import RewriteKind
from tests.autopar.test_random_programs import MESHES as RANDOM_MESHES
from autopar.cost_model.hlo_async import as_async
from tests.autopar.test_random_programs import make_case, random_hints
from tests.passes.test_propagate import _setup

M, R, D = ("model",), ("data",), ()
MATMUL = (((1,), (0,)), ((), ()))            # (B, K) @ (K, F)
SEQ_MATMUL = (((2,), (0,)), ((), ()))        # (B, S, K) @ (K, F)

#: name -> (dimension numbers, lhs shape, rhs shape, CollectiveMatmul fields but bidirectional)
CASES = {
    # sequence-parallel activations gathered into a column-split weight's matmul
    "gather lhs free": (SEQ_MATMUL, (4, 16, 8), (8, 16), dict(
        mode=Mode.GATHER_FREE, in_specs=(Spec((R, M, D)), Spec((D, M))),
        out_spec=Spec((R, D, M)), operand=0, dim=1, out_dim=1)),
    # a column-split weight gathered beside row-split activations
    "gather rhs free": (MATMUL, (16, 8), (8, 16), dict(
        mode=Mode.GATHER_FREE, in_specs=(Spec((M, D)), Spec((D, M))),
        out_spec=Spec((M, D)), operand=1, dim=1, out_dim=1)),
    # an FSDP weight (split on its contracting dim) gathered beside row-split activations
    "gather rhs contracting": (MATMUL, (16, 16), (16, 8), dict(
        mode=Mode.GATHER_CONTRACTING, in_specs=(Spec((M, D)), Spec((M, D))),
        out_spec=Spec((M, D)), operand=1, dim=0, other_dim=1)),
    # a row-split weight's partial sums scattered into the sequence
    "scatter lhs free": (SEQ_MATMUL, (4, 16, 8), (8, 16), dict(
        mode=Mode.SCATTER, in_specs=(Spec((R, D, M)), Spec((M, D))),
        out_spec=Spec((R, M, D)), out_dim=1, slices=((0, 1),))),
    # partial sums scattered into the columns
    "scatter rhs free": (MATMUL, (8, 16), (16, 16), dict(
        mode=Mode.SCATTER, in_specs=(Spec((D, M)), Spec((M, D))),
        out_spec=Spec((D, M)), out_dim=1, slices=((1, 1),))),
}


def _placed(mesh, spec: Spec, x):
    return jax.device_put(x, NamedSharding(mesh, spec.to_partition_spec()))


def test_regions_match_the_dot(mesh_2d):
    """Every case, one- and bidirectional, gathers also keeping their operand, in one program
    (one compile): forward, the kept operand, gradients through the custom VJP, and no
    all-gather, reduce-scatter or all-reduce compiled."""
    regs, dots, args, refs, cms = [], [], [], [], []
    keys = iter(jax.random.split(jax.random.key(0), 8 * len(CASES)))
    for dn, lhs_shape, rhs_shape, fields in CASES.values():
        dot = functools.partial(lax.dot_general, dimension_numbers=dn,
                                precision=lax.Precision.HIGHEST)
        for bidirectional, keep in itertools.product(
                (False, True), (False,) if fields["mode"] is Mode.SCATTER else (False, True)):
            cm = CollectiveMatmul(axis="model", bidirectional=bidirectional, keep=keep, **fields)
            regs.append(regions.region(cm, dot, mesh_2d, regions._auto(cm.out_spec, "model")))
            dots.append(dot)
            cms.append(cm)
            a, b = (jax.random.normal(next(keys), lhs_shape),
                    jax.random.normal(next(keys), rhs_shape))
            refs.append((a, b))
            args.append(tuple(_placed(mesh_2d, sp, x) for sp, x in zip(cm.in_specs, (a, b))))

    def run(fs, args):
        return [f(a, b) for f, (a, b) in zip(fs, args)]

    def loss(fs, args):
        return sum(jnp.sum(jnp.sin(y[0] if isinstance(y, tuple) else y)) * (i + 1)
                   for i, y in enumerate(run(fs, args)))

    forward = jax.jit(functools.partial(run, regs)).lower(args).compile()
    for got, dot, (a, b), cm in zip(forward(args), dots, refs, cms):
        if cm.keep:
            got, kept = got
            np.testing.assert_array_equal(kept, (a, b)[cm.operand])
            assert kept.sharding.spec == cm.gathered_spec().to_partition_spec()
        np.testing.assert_allclose(got, dot(a, b), rtol=1e-5, atol=1e-5)
    text = forward.as_text()
    assert "collective-permute" in text
    assert not re.search(r"\b(all-gather|reduce-scatter|all-reduce)(-start)?\(", text)
    grads = jax.jit(jax.grad(functools.partial(loss, regs)))(args)
    expected = jax.grad(functools.partial(loss, dots))(refs)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _matches_one_device(fn, args, mesh, **kw):
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverFallbackWarning)
        warnings.simplefilter("ignore", ShardingConflictWarning)
        with forced():
            plan = autopar.plan(fn, *args, mesh=mesh, hardware="h100", **kw)
    got = jax.tree_util.tree_leaves(plan.jit()(*args))
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)
    return plan


@pytest.mark.parametrize("name, mesh", [
    ("bert", {"data": 2, "model": 4}), ("mlp", {"data": 2, "model": 2, "expert": 2})])
def test_models_with_every_rewrite_match_one_device(name, mesh):
    """Train steps whose every dot that can be a collective matmul is one (forced); the 1-D
    mesh is among the random programs' (and the realistic BERT's below)."""
    module = {"bert": bert, "mlp": mlp}[name]
    fn, args = module.make_train_step(module.TINY)
    plan = _matches_one_device(fn, args, mesh, time_limit_s=20)
    assert plan.stats["overlap"] is True
    assert sum(plan.stats["rewrites"].values()) >= 4, plan.stats["rewrites"]


def test_random_programs_with_rewrites_match_one_device():
    taken = 0
    for seed in (0, 1, 5, 9):
        fn, args = make_case(seed)
        mesh = RANDOM_MESHES[seed % len(RANDOM_MESHES)]
        plan = _matches_one_device(fn, args, mesh,
                                   in_shardings=tuple(random_hints(args, mesh, seed)))
        taken += sum(plan.stats["rewrites"].values())
    assert taken >= 3


def _gather_then_cumsum(x, w):
    """A dot whose split operand another op reads later, whole (its cumulative sum)."""
    return jnp.tanh(x @ w), jnp.cumsum(x, axis=0)


def test_a_gathered_operand_is_kept_for_its_later_reader():
    """The all-gather matmul returns the operand it gathers, and the later reader that wants it
    gathered takes it: the ILP credits that move, the estimate charges none, and XLA compiles
    no all-gather. Realistic shapes plan it on their own; tiny ones (forced) match one
    device."""
    shardings = dict(in_shardings=(PartitionSpec("model", None), PartitionSpec(None, "model")),
                     out_shardings=(PartitionSpec(None, "model"), PartitionSpec()))
    big = [jax.ShapeDtypeStruct((8192, 8192), jnp.float32)] * 2
    plan = autopar.plan(_gather_then_cumsum, *big, mesh={"model": 8}, hardware="h100",
                        verbose=False, **shardings)
    graph, strats, choice, comms = plan._details
    dot = next(n for n in graph.nodes if n.primitive is lax.dot_general_p)
    rewrite = strats[dot.id][choice[dot.id]].rewrite
    assert rewrite is not None and rewrite.keeps == ((0, Spec((D, D))),)
    x = dot.ins[0]
    cumsum = next(w for w, _ in graph.consumers()[x] if w != dot.id)
    assert strats[cumsum][choice[cumsum]].in_specs[0] == Spec((D, D))
    assert not [c for c in comms if c.reason == "reshard" and c.value == x]
    text = plan.compile().as_text()
    assert "collective-permute" in text
    assert not re.search(r"\ball-gather(-start)?\(", text)
    small = tuple(jax.random.normal(k, (16, 16)) for k in jax.random.split(jax.random.key(3)))
    plan = _matches_one_device(_gather_then_cumsum, small, {"model": 8}, **shardings)
    graph, strats, choice, _ = plan._details
    assert any(s.rewrite is not None and s.rewrite.keeps
               for s in (strats[n][choice[n]] for n in range(len(graph.nodes))))


def test_the_ilp_credits_the_kept_operand():
    """The ILP without a reference plan prices the plan with the kept gather at its serial
    time: the later reader's move into the gathered spec is paid by the ring, not again."""
    big = [jax.ShapeDtypeStruct((8192, 8192), jnp.float32)] * 2
    _, graph, strats, mesh, _ = _setup(
        _gather_then_cumsum, big, (PartitionSpec("model", None), PartitionSpec(None, "model")),
        (PartitionSpec(None, "model"), PartitionSpec()), mesh={"model": 8})
    strats = with_collective_matmuls(graph, strats, mesh)
    groups = cluster(graph, strats, mesh)
    choice = solve(graph, strats, groups, mesh).choice
    assert any(strats[n][choice[n]].rewrite is not None and strats[n][choice[n]].rewrite.keeps
               for n in range(len(graph.nodes)))
    comms = estimate.plan_collectives(graph, strats, choice, mesh)
    assert not [c for c in comms if c.reason == "reshard" and c.step.wire_bytes]
    serial = sum(strats[n.id][choice[n.id]].compute_s * n.trip_count for n in graph.nodes) + sum(
        c.time_s * c.trips for c in comms)
    ilp = IlpBuilder(graph, strats, groups, mesh).build()
    assert ilp.matrices()[0] @ ilp.point(choice) / 1e6 == pytest.approx(serial, rel=1e-6)


def _scatter_alone(x, w):
    return (x @ w,)


def _scatter_beside(x, w, a, b):
    """A dot whose partial sums are reduce-scattered, and a matmul that does not wait for it."""
    return x @ w, a @ b


@pytest.mark.parametrize("beside", [True, False])
def test_a_ring_is_taken_only_where_it_shortens_the_makespan(beside):
    """The serial ILP charges the reduce-scatter in full and the scatter ring only what its
    own pieces leave exposed, so it takes the ring. Beside an independent matmul that would
    hide the reduce-scatter, the plan with the ring charged in full is shorter and is taken;
    alone, the ring is kept."""
    f32 = jnp.float32
    args = [jax.ShapeDtypeStruct(shape, f32) for shape in
            ((8192, 8192),) * (4 if beside else 2)]
    pins = (PartitionSpec(None, "model"), PartitionSpec("model", None),
            PartitionSpec("model", None), PartitionSpec())
    fn = _scatter_beside if beside else _scatter_alone
    _, graph, strats, mesh, _ = _setup(fn, args, pins[:len(args)],
                                       (PartitionSpec("model", None),) * (len(args) // 2),
                                       mesh={"model": 8})
    strats = with_collective_matmuls(graph, strats, mesh)
    groups = cluster(graph, strats, mesh)
    messages = []
    solution = solve(graph, strats, groups, mesh, progress=messages.append)
    assert any("rings charged in full" in m for m in messages)   # the serial ILP took a ring
    dot = next(n for n in graph.nodes if n.primitive is lax.dot_general_p)
    taken = strats[dot.id][solution.choice[dot.id]]
    assert solution.rings_dropped is beside
    assert (taken.rewrite is None) is beside
    if beside:
        assert taken.collectives and taken.collectives[0].kind is CollectiveKind.REDUCE_SCATTER
        ring_plan = list(solution.choice)   # the same plan with the dot's ring
        ring_plan[dot.id] = next(i for i, s in enumerate(strats[dot.id]) if s.rewrite is not None
                                 and s.rewrite.kind is RewriteKind.MATMUL_REDUCE_SCATTER
                                 and s.out_specs == taken.out_specs)
        assert (estimate.plan_makespan(graph, strats, solution.choice, mesh)[0]
                < estimate.plan_makespan(graph, strats, ring_plan, mesh)[0])


def test_overlap_off_and_cpu_offer_no_rewrite():
    """``overlap=False`` turns every rewrite off, and the cpu profile (collectives in line)
    never offers one, even forced."""
    fn, args = mlp.make_train_step(mlp.TINY)
    mesh = {"data": 2, "model": 4}
    with forced():
        on = autopar.plan(fn, *args, mesh=mesh, hardware="h100")
        off = autopar.plan(fn, *args, mesh=mesh, hardware="h100", overlap=False)
        cpu = autopar.plan(fn, *args, mesh=mesh, hardware="cpu")
    assert on.stats["rewrites"] and on.stats["overlap"] is True
    assert off.stats["rewrites"] == {} and off.stats["overlap"] is False
    assert cpu.stats["rewrites"] == {}
    assert json.loads(on.to_json())["stats"]["rewrites"] == on.stats["rewrites"]
    assert "overlapped:" in on.report()


def _ring_loops(text: str) -> list[str]:
    """Bodies of while loops that run a collective-permute beside a dot (or a fusion
    calling one)."""
    module = parse_module(text)

    def has_dot(computation: str, seen: set) -> bool:
        for ins in module.computations.get(computation, ()):
            if ins.opcode == "dot":
                return True
            for callee in ins.called("calls") + ins.called("to_apply"):
                if callee not in seen and has_dot(callee, seen | {callee}):
                    return True
        return False

    loops = []
    for instructions in module.computations.values():
        for ins in instructions:
            if ins.opcode != "while":
                continue
            body = ins.called("body")[0]
            ops = {i.opcode for i in module.computations[body]}
            if {"collective-permute", "collective-permute-start"} & ops and has_dot(body, {body}):
                loops.append(body)
    return loops


def test_wide_bert_compiles_to_ring_loops():
    """At realistic width on an 8-way model axis (compiled from shapes, nothing runs), the
    plan's big dots are collective matmuls: the compiled program runs collective-permutes in
    loops beside its dots, and gathers or reduces no weight."""
    config = dataclasses.replace(bert.REALISTIC, vocab=8192, seq=512, hidden=4096, heads=32,
                                 layers=1, batch=8)
    fn, args = bert.make_train_step(config, abstract=True)
    plan = autopar.plan(fn, *args, mesh={"model": 8}, hardware="h100", verbose=False)
    rewritten = sum(plan.stats["rewrites"].values())
    assert rewritten >= 4, plan.stats["rewrites"]
    text = plan.compile().as_text()
    assert len(_ring_loops(text)) >= rewritten
    weights = {tuple(leaf.shape) for leaf in jax.tree.leaves(args[0]) if len(leaf.shape) == 2}
    module = parse_module(text)
    moved = [array_dims(ins.result_type)[1] for instructions in module.computations.values()
             for ins in instructions
             if ins.opcode in ("all-gather", "all-reduce", "all-gather-start", "all-reduce-start")
             and array_dims(ins.result_type)]
    assert not weights & set(moved), (weights & set(moved))


def _fsdp_step():
    """A train step over a scanned stack of weights (each layer ``tanh(h @ w)``)."""
    def loss(ws, x):
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.mean(h ** 2)

    def step(ws, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        return ws - 0.1 * grads, value
    ws = jax.random.normal(jax.random.key(0), (4, 64, 64)) / 8
    x = jax.random.normal(jax.random.key(1), (32, 64))
    return step, (ws, x)


def test_fsdp_prefetch_matches_one_device():
    """Weights FSDP-sharded over the stack's rows: the forward and backward scans take each
    layer's weight gathered one iteration ahead; the step, and the gradient of a user who
    differentiates the planned program, match one device."""
    step, (ws, x) = _fsdp_step()
    plan = _matches_one_device(step, (ws, x), {"data": 8},
                               in_shardings=(PartitionSpec(None, "data"), PartitionSpec("data")))
    assert plan.stats["rewrites"].get("prefetch", 0) >= 2, plan.stats["rewrites"]
    program = jax.jit(plan._flat_fn, in_shardings=jax.tree.leaves(plan.in_shardings))
    with jax.sharding.use_abstract_mesh(plan.mesh.abstract_mesh):
        got = jax.jit(jax.grad(lambda ws, x: program(ws, x)[1]))(ws, x)
    np.testing.assert_allclose(got, jax.grad(lambda ws, x: step(ws, x)[1])(ws, x),
                               rtol=2e-3, atol=2e-5)


def test_as_async_lets_a_collective_overlap_independent_compute(mesh_1d):
    """``cost_model.hlo_async.as_async`` reads XLA:CPU's synchronous collectives as a GPU's
    latency-hiding scheduler runs them: the same step, its all-reduce beside the dot that
    does not need it."""
    @jax.jit
    def f(x, w, y):
        return jnp.sum(x @ w, axis=0), y @ y
    spec = NamedSharding(mesh_1d, PartitionSpec("data"))
    args = [jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=spec),
            jax.ShapeDtypeStruct((512, 512), jnp.float32,
                                 sharding=NamedSharding(mesh_1d, PartitionSpec())),
            jax.ShapeDtypeStruct((2048, 2048), jnp.float32,
                                 sharding=NamedSharding(mesh_1d, PartitionSpec()))]
    text = f.lower(*args).compile().as_text()
    scheduled = as_async(text)
    assert "all-reduce-start(" in scheduled and "all-reduce-done(" in scheduled
    h100 = get_profile("h100")
    inline, overlapped = simulate(text, h100), simulate(scheduled, h100)
    assert overlapped.compute_busy_s == pytest.approx(inline.compute_busy_s)
    assert overlapped.exposed_comm_s < inline.exposed_comm_s
