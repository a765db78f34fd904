"""The propagate pass on small programs: GSPMD-style forward and backward propagation through
the strategy lists, complete mode (search=False) and forced mode (pins for the ILP), ties and
conflicts."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autopar._mesh import as_auto_mesh, axis_sizes
from autopar.errors import ShardingConflictWarning
from autopar.passes.estimate import value_specs
from autopar.cost_model.hardware import axis_levels, get_profile
from autopar.passes import conflicts
from autopar.passes.annotate import annotate
from autopar.passes.fixed import Splits
from autopar.passes.propagate import propagate
from autopar.cost_model.spec import Spec
from autopar.passes.strategies import MeshContext, build_strategies
from autopar.passes.trace import trace

MESH = {"data": 2, "model": 4}


def _setup(fn, args, in_pins=(), out_pins=(), mesh=MESH):
    jax_mesh = as_auto_mesh(mesh)
    sizes = axis_sizes(jax_mesh)
    ctx = MeshContext(tuple(jax_mesh.axis_names), sizes,
                      axis_levels(jax_mesh, get_profile("h100"), None), get_profile("h100"))
    traced = trace(fn, args)
    g = traced.graph

    def specs(pins, avals):
        pins = list(pins) + [None] * (len(avals) - len(pins))
        return [None if p is None else Spec.from_partition_spec(p, len(a.shape))
                for p, a in zip(pins, avals)]
    labels = annotate(g, specs(in_pins, traced.in_avals), specs(out_pins, traced.out_avals),
                      sizes, [f"in_shardings[{i}]" for i in range(len(traced.in_avals))],
                      [f"out_shardings[{i}]" for i in range(len(traced.out_avals))])
    strats, _ = build_strategies(g, ctx)
    return traced, g, strats, ctx, labels


def _complete(fn, args, in_pins=(), out_pins=(), ties=(), mesh=MESH):
    _traced, g, strats, ctx, labels = _setup(fn, args, in_pins, out_pins, mesh)
    prop = propagate(g, strats, ctx, labels, ties, complete=True)
    return g, value_specs(g, strats, prop.choice), strats, prop


def _spec_of_prim(g, specs, prim):
    return [str(specs[n.outs[0]]) for n in g.nodes if n.prim == prim]


D, M = "data", "model"
X = jnp.ones((8, 16))
W = jnp.ones((16, 32))
W2 = jnp.ones((32, 16))


def test_forward_through_elementwise_chain():
    g, specs, _, prop = _complete(lambda x: jnp.exp(x) * 2.0 + 1.0, (X,), [P("data")])
    assert {str(specs[v]) for v in range(len(g.values)) if g.values[v].shape == (8, 16)} == \
        {"S(data)R"}
    assert prop.choice is not None


def test_backward_from_an_output_hint_to_the_inputs():
    """Only the result is hinted: propagation runs backward through the tanh and the dot to
    both arguments, splitting the batch, with the weight kept whole."""
    _traced, g, strats, ctx, labels = _setup(lambda x, w: jnp.tanh(x @ w), (X, W),
                                            out_pins=[P("data")])
    prop = propagate(g, strats, ctx, labels, complete=True)
    specs = value_specs(g, strats, prop.choice)
    x_in, w_in = (g.nodes[n].outs[0] for n in g.input_nodes)
    assert (str(specs[x_in]), str(specs[w_in])) == ("S(data)R", "RR")


def test_column_parallel_weight_does_not_invent_a_batch_split():
    """A column-parallel weight fixes the dot's output columns; the batch stays whole (no new
    split), as GSPMD would leave it."""
    g, specs, _, _ = _complete(lambda x, w: jax.nn.gelu(x @ w), (X, W), [None, P(None, "model")])
    assert _spec_of_prim(g, specs, "dot_general") == ["RS(model)"]
    x_in = g.nodes[g.input_nodes[0]].outs[0]
    assert str(specs[x_in]) == "RR"


def test_row_parallel_finishes_with_an_all_reduce():
    """Megatron MLP: the second dot's partial sums end replicated (an all-reduce), not
    scattered into a split nobody asked for."""
    def mlp(x, w, w2):
        return jax.nn.relu(x @ w) @ w2
    g, specs, strats, prop = _complete(mlp, (X, W, W2), [None, P(None, "model"), P("model")])
    dots = [n for n in g.nodes if n.prim == "dot_general"]
    second = strats[dots[1].id][prop.choice[dots[1].id]]
    assert str(specs[dots[1].outs[0]]) == "RR"
    assert [c.kind.value for c in second.collectives] == ["all-reduce"]


def test_values_left_free_are_replicated():
    _g, specs, _, _ = _complete(lambda x, w: (x @ w).sum(), (X, W))
    assert all(not s.axes for s in specs.values())


def test_tied_state_output_takes_the_input_sharding():
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w_: jnp.tanh(x @ w_).sum())(w)
    _traced, g, strats, ctx, labels = _setup(step, (W, X), [P(None, "model"), P("data")])
    ties = [(g.output_nodes[0], g.input_nodes[0])]
    prop = propagate(g, strats, ctx, labels, ties, complete=True)
    out = g.nodes[g.output_nodes[0]]
    assert str(strats[out.id][prop.choice[out.id]].in_specs[0]) == "RS(model)"


def test_forced_mode_fixes_splits_along_one_tensor_and_leaves_other_axes_free():
    """search=True: a batch hint over `data` pins `data` on the batch dim of the elementwise
    chain that follows, while the `model` axis stays for the ILP to use; past the contraction
    nothing is forced."""
    _traced, g, strats, ctx, labels = _setup(lambda x, w: jnp.tanh(x * 2.0) @ w, (X, W),
                                            [P("data")])
    prop = propagate(g, strats, ctx, labels, complete=False)
    tanh = next(n for n in g.nodes if n.prim == "tanh")
    assert prop.specs[tanh.outs[0]] == Splits(frozenset({("data", 0)}))
    kept = {str(s.out_specs[0]) for s in strats[tanh.id]}
    assert kept == {"S(data)R", "S(data)S(model)", "S(data,model)R"}
    dot = next(n for n in g.nodes if n.prim == "dot_general")
    assert dot.outs[0] not in prop.specs
    assert prop.choice is None


def test_conflicting_annotations_warn_naming_both_and_reshard():
    """The hint on x and a with_sharding_constraint on x disagree: both are kept (the value is
    resharded between them) and the warning names both sources."""
    def fn(x):
        y = jax.lax.with_sharding_constraint(x, NamedSharding(as_auto_mesh(MESH),
                                                              P(None, "model")))
        return jnp.exp(y)
    with pytest.warns(ShardingConflictWarning,
                      match=r"in_shardings\[0\].*with_sharding_constraint|"
                            r"with_sharding_constraint.*in_shardings\[0\]"):
        g, specs, _, _ = _complete(fn, (X,), [P("data")])
    x_in = g.nodes[g.input_nodes[0]].outs[0]
    assert str(specs[x_in]) == "S(data)R"
    assert _spec_of_prim(g, specs, "exp") == ["RS(model)"]


def test_fsdp_weight_with_data_parallel_batch_is_no_conflict():
    """Different tensors meeting at a contraction is ordinary resharding (an all-gather of
    the weight), not two annotations of one tensor: no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingConflictWarning)
        _complete(lambda x, w: (x @ w).sum(), (X, W), [P("data"), P("data")])


def test_a_zero_split_beside_its_parameter_is_no_conflict():
    """A parameter split over `data` and its optimizer state split further (ZeRO), meeting at
    the update's add: the state is a local slice of the parameter, and the update is gathered
    back, ordinary resharding: no warning. Split otherwise, they conflict."""
    def update(w, m):
        return w - 0.1 * m
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingConflictWarning)
        _complete(update, (W, W), [P("data"), P("data", "model")])
        _complete(update, (W, W), [P(), P("data", "model")])
    with pytest.warns(ShardingConflictWarning, match=r"in_shardings\[0\].*in_shardings\[1\]"):
        _complete(update, (W, W), [P("data"), P("model")])


@pytest.mark.parametrize("a, b, nested", [
    (((D,), ()), ((D,), (M,)), True), (((D, M), ()), ((D,), ()), True),
    (((D,), ()), ((), (D,)), False), (((D,), ()), ((M, D), ()), False),
    (((), ()), ((D,), (M,)), True), (((D,),), ((D,), ()), False)])
def test_nested_specs(a, b, nested):
    assert conflicts.nested(Spec(a), Spec(b)) is nested


def test_fsdp_weight_is_gathered_where_it_meets_the_batch():
    """FSDP: the batch split over `data` and a weight split over `data` on its contracting dim.
    As in XLA's propagation, the batch split crosses the dot first (along its batch dim); the
    weight's split would have to reach a contracting dim, which comes later and finds `data`
    taken: the activation's features stay whole and the weight is gathered."""
    g, specs, strats, prop = _complete(lambda x, w: jnp.tanh(x @ w), (X, W),
                                       [P("data"), P("data")])
    dot = next(n for n in g.nodes if n.prim == "dot_general")
    assert str(specs[dot.outs[0]]) == "S(data)R"
    assert [str(s) for s in strats[dot.id][prop.choice[dot.id]].in_specs] == ["S(data)R", "RR"]


def test_the_larger_tensor_wins_a_conflict():
    """Tied logits, `h @ table.T`: the batch is split over `model`, and so is the vocab of the
    table, which is larger. As in XLA's propagation, the logits take the larger tensor's split
    (the vocab) and the small activation is gathered."""
    h, table = jnp.ones((8, 16)), jnp.ones((64, 16))
    g, specs, strats, prop = _complete(lambda h, t: jnp.exp(h @ t.T), (h, table),
                                       [P("model"), P("model")])
    dot = next(n for n in g.nodes if n.prim == "dot_general")
    assert str(specs[dot.outs[0]]) == "RS(model)"
    assert str(strats[dot.id][prop.choice[dot.id]].in_specs[0]) == "RR"


def test_splits_of_two_operands_merge_and_grow_back_into_them():
    """The batch hinted over `data` and the features of the other operand over `model` meet at
    a multiply: the product takes both splits, and the propagated tanh results grow into it
    (checked against XLA's own propagation of the same jit: every value [2,4]), so each
    operand is sliced, not gathered."""
    def fn(x, y):
        return jnp.tanh(x) * jnp.tanh(y)
    g, specs, strats, prop = _complete(fn, (X, X), [P("data"), P(None, "model")])
    assert _spec_of_prim(g, specs, "tanh") == ["S(data)S(model)"] * 2
    mul = next(n for n in g.nodes if n.prim == "mul")
    chosen = strats[mul.id][prop.choice[mul.id]]
    assert str(chosen.out_specs[0]) == "S(data)S(model)"
    assert [str(s) for s in chosen.in_specs] == ["S(data)S(model)"] * 2
