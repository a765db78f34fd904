"""Every strategy a rule offers, compiled alone: the collectives XLA emits must be the ones
the strategy predicts (wire bytes from the compiled HLO equal the strategy's)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from autopar._mesh import axis_sizes
from autopar.cost_model.hardware import axis_levels, get_profile
from autopar.cost_model.hlo import analyze
from autopar.passes.ir import NodeKind
from autopar.passes.strategies import MeshContext, node_strategies
from autopar.passes.trace import trace

CASES = {
    "matmul": ("dot_general", lambda a, b: a @ b, ((16, 32), (32, 8))),
    "batched_matmul": ("dot_general", lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
                       ((4, 16, 32), (4, 32, 8))),
    "reduce_sum": ("reduce_sum", lambda a: a.sum(1), ((16, 32),)),
    "reduce_max": ("reduce_max", lambda a: a.max(0), ((16, 32),)),
    "broadcast": ("broadcast_in_dim", lambda a: jnp.broadcast_to(a[None], (8, 16)), ((16,),)),
    "reshape_merge": ("reshape", lambda a: a.reshape(32, 16), ((8, 4, 16),)),
    "reshape_split": ("reshape", lambda a: a.reshape(8, 4, 32), ((32, 32),)),
    "transpose": ("transpose", lambda a: a.T, ((16, 32),)),
    "elementwise": ("add", lambda a, b: a + b, ((16, 32), (16, 32))),
    "take_along_axis": ("gather", lambda l, i: jnp.take_along_axis(l, i[:, None], axis=-1),
                        ((16, 64), "i16")),
    "scatter_add": ("scatter-add", lambda u, i: jnp.zeros((64, 16)).at[i].add(u),
                    ((8, 16), "i8")),
    "scatter_add_3d": ("scatter-add", lambda u, i: jnp.ones((64, 16)).at[i].add(u),
                       ((8, 4, 16), (8, 4))),
    "take_along_axis_grad": ("scatter-add", lambda l, i: jax.grad(
        lambda a: jnp.take_along_axis(a, i[:, :, None], axis=-1).sum())(l),
        ((4, 8, 16), (4, 8))),
    "embedding": ("gather", lambda t, i: t[i], ((64, 16), (8, 4))),
    "bias_add": ("add", lambda a, b: a + b.reshape(1, 32), ((16, 32), (32,))),
    "select_n": ("select_n", lambda a, b: jnp.where(a > 0, a, b), ((16, 32), (16, 32))),
    "slice": ("slice", lambda a: a[:, 8:24], ((16, 32),)),
    "pad": ("pad", lambda a: jnp.pad(a, ((0, 0), (4, 4))), ((16, 24),)),
    "dynamic_slice": ("dynamic_slice", lambda a: jax.lax.dynamic_slice_in_dim(a, 3, 8, 1),
                      ((16, 32),)),
    "dynamic_update_slice": ("dynamic_update_slice",
                             lambda a, u: jax.lax.dynamic_update_slice_in_dim(a, u, 3, 1),
                             ((16, 32), (16, 8))),
    "rev": ("rev", lambda a: a[:, ::-1], ((16, 32),)),
    "squeeze": ("squeeze", lambda a: a[:, 0, :], ((16, 1, 32),)),
    "sort": ("sort", lambda a: jnp.sort(a, axis=1), ((16, 32),)),
    "conv": ("conv_general_dilated",
             lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                                       dimension_numbers=("NHWC", "HWIO", "NHWC")),
             ((8, 4, 4, 16), (3, 3, 16, 8))),
    "avg_pool": ("reduce_window_sum",
                 lambda x: jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1),
                                                 "VALID"), ((8, 4, 4, 16),)),
    "cumsum": ("cumsum", lambda a: jnp.cumsum(a, axis=1), ((16, 32),)),
    "concatenate": ("concatenate", lambda a, b: jnp.concatenate([a, b], 1), ((16, 8), (16, 8))),
    # jax 0.12 emits it for `k, v = kv`; 0.10 has the primitive but emits slices there.
    "unstack": ("unstack", lambda a: jax.lax.unstack_p.bind(a, axis=1), ((16, 2, 32),)),
}


def _arg(spec):
    if isinstance(spec, str):
        return jax.ShapeDtypeStruct((int(spec[1:]),), jnp.int32)
    return jax.ShapeDtypeStruct(spec, jnp.float32)


def _args(arg_specs):
    # In the embedding cases the second argument holds indices.
    args = [_arg(s) for s in arg_specs]
    if len(args) == 2 and arg_specs[1] in ((8, 4), (4, 8)):
        args[1] = jax.ShapeDtypeStruct(arg_specs[1], jnp.int32)
    return tuple(args)


@pytest.mark.parametrize("case", sorted(CASES))
def test_predicted_collectives_match_compiled(case, mesh_2d):
    prim, fn, arg_specs = CASES[case]
    args = _args(arg_specs)
    graph = trace(fn, args).graph
    node = [n for n in graph.nodes if n.kind is NodeKind.OP and n.prim == prim][-1]
    sizes = axis_sizes(mesh_2d)
    profile = get_profile("cpu")
    ctx = MeshContext(tuple(sizes), sizes, axis_levels(mesh_2d, profile), profile,
                      emulated_reduce_scatter=True)
    strategies, fallback = node_strategies(node, graph, ctx)
    assert not fallback and len(strategies) > 1
    wrong = []
    for s in strategies:
        def op(*xs):
            it = iter(xs)
            vals = [next(it) if vid is not None else jnp.zeros(shape, dtype)
                    for vid, (shape, dtype) in zip(node.ins, node.in_avals)]
            return node.primitive.bind(*vals, **node.params)
        ins = [jax.ShapeDtypeStruct(shape, dtype,
                                    sharding=NamedSharding(mesh_2d, sp.to_partition_spec()))
               for (shape, dtype), sp, vid in zip(node.in_avals, s.in_specs, node.ins)
               if vid is not None]
        outs = [NamedSharding(mesh_2d, sp.to_partition_spec()) for sp in s.out_specs]
        compiled = jax.jit(op, out_shardings=outs if len(outs) > 1 else outs[0]).lower(
            *ins).compile()
        hlo_bytes = analyze(compiled).wire_bytes
        if abs(hlo_bytes - s.comm_bytes) > 0.5:
            wrong.append(f"{s.label()}: predicted {s.comm_bytes}, compiled {hlo_bytes}")
    assert not wrong, "\n".join(wrong)
