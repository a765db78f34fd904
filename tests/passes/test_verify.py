"""The Graph IR's invariants (passes.verify): a broken graph fails verification, naming the
pass after which it broke; the tiny GPT train step passes it after every pass of the
pipeline when AUTOPAR_DEBUG=1."""

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar.errors import InvalidIRError
from autopar.models import gpt
from autopar.passes import pipeline
from autopar.passes.ir import NodeKind, Value
from autopar.passes.trace import trace
from autopar.passes.verify import problems, verify


def _loop(x, w):
    """A scan (its carries read a value made later: a back-edge) around a matmul."""
    def body(c, _):
        return jnp.tanh(c @ w), c.sum()
    c, ys = jax.lax.scan(body, x, None, length=3)
    return c + 1.0, ys


def _graph():
    return trace(_loop, (jnp.ones((4, 4)), jnp.ones((4, 4)))).graph


def _first(graph, kind):
    return next(n for n in graph.nodes if n.kind is kind)


def _read_missing(g):
    op = _first(g, NodeKind.OP)
    op.ins = (len(g.values) + 7,) + op.ins[1:]


def _made_twice(g):
    a, b = [n for n in g.nodes if n.kind is NodeKind.OP][:2]
    b.outs = a.outs


def _used_before_made(g):
    out = _first(g, NodeKind.OUTPUT)
    op = _first(g, NodeKind.OP)
    op.ins = (out.ins[0],) + op.ins[1:]  # the first op reads the program's result


def _output_index(g):
    g.output_nodes[0] = g.input_nodes[0]


def _negative_shape(g):
    g.values[0] = Value(0, (4, -1), g.values[0].dtype)


def _float_shape(g):
    g.values[0] = Value(0, (4.0, 4), g.values[0].dtype)


def _no_producer(g):
    g.values.append(Value(len(g.values), (2,), g.values[0].dtype))


def _carry_arity(g):
    carry = _first(g, NodeKind.CARRY)
    carry.ins, carry.in_avals = carry.ins[:1], carry.in_avals[:1]


def _aval_mismatch(g):
    op = _first(g, NodeKind.OP)
    op.in_avals = (((9, 9), op.in_avals[0][1]),) + op.in_avals[1:]


BREAKAGES = [  # (how the graph is broken, what the error says)
    (_read_missing, "which does not exist"),
    (_made_twice, "is made by 2 nodes"),
    (_used_before_made, "before node"),
    (_output_index, "output_nodes"),
    (_negative_shape, "not a tuple of non-negative ints"),
    (_float_shape, "not a tuple of non-negative ints"),
    (_no_producer, "is made by no node"),
    (_carry_arity, "has 1 operands, not 2"),
    (_aval_mismatch, "aval shape (9, 9)"),
]


def test_a_traced_program_with_a_loop_back_edge_is_valid():
    assert problems(_graph()) == []


@pytest.mark.parametrize("break_it,says", BREAKAGES, ids=[b.__name__ for b, _ in BREAKAGES])
def test_a_broken_graph_fails_verification_naming_the_pass(break_it, says):
    graph = _graph()
    break_it(graph)
    with pytest.raises(InvalidIRError, match=r"after the `cluster` pass") as info:
        verify(graph, after="cluster")
    assert says in str(info.value)
    assert isinstance(info.value, AssertionError)


def _spy_verify(monkeypatch) -> list[str]:
    """The passes after which the pipeline verifies the IR, in order."""
    seen = []

    def spy(graph, after):
        seen.append(after)
        verify(graph, after)
    monkeypatch.setattr(pipeline, "verify", spy)
    return seen


def test_the_tiny_gpt_step_is_valid_after_every_pass_in_debug_mode(monkeypatch):
    fn, args = gpt.make_train_step(gpt.TINY)
    seen = _spy_verify(monkeypatch)
    monkeypatch.setenv("AUTOPAR_DEBUG", "1")
    plan = autopar.plan(fn, *args, mesh={"data": 2, "model": 4})
    assert seen == ["trace", "remat", "annotate", "strategies", "propagate", "candidates",
                    "cluster", "solve", "emit", "total"]
    # the timings the report and the benchmarks read
    assert list(plan.stats["timings_s"]) == ["trace", "strategies", "propagate", "cluster",
                                             "solve", "total"]
    seen.clear()
    autopar.plan(fn, *args, mesh={"data": 8}, remat="dots_saveable", search=False)
    assert seen[:2] == ["trace", "remat"] and len(seen) == 10
    seen.clear()
    monkeypatch.setenv("AUTOPAR_DEBUG", "0")
    autopar.plan(fn, *args, mesh={"data": 8}, search=False)
    assert seen == []


def test_a_pass_that_breaks_the_graph_is_named(monkeypatch):
    """A strategies pass that leaves an operand reading a missing value fails right after it
    in debug mode, with the pass named."""
    build_strategies = pipeline.build_strategies

    def breaking(graph, *rest):
        strategies = build_strategies(graph, *rest)
        op = _first(graph, NodeKind.OP)
        op.ins = (len(graph.values),) + op.ins[1:]
        return strategies

    monkeypatch.setattr(pipeline, "build_strategies", breaking)
    monkeypatch.setenv("AUTOPAR_DEBUG", "1")
    x = jnp.ones((8, 4))
    with pytest.raises(InvalidIRError, match=r"after the `strategies` pass: node \d+ .* reads"):
        autopar.plan(lambda x: jnp.tanh(x) * 2.0, x, mesh={"data": 8}, search=False)
