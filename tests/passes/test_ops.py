"""The op-info registry (passes.rules): one OpInfo per jax Primitive, keyed by the object."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive
from jax.extend.core import primitives as P

from autopar import _compat
from autopar.models import bert, convnet, gpt, llama_nnx, mlp, moe
from autopar.passes import trace as trace_pass
from autopar.passes.ir import NodeKind
from autopar.passes.rules import (UNKNOWN, RuleContext, info_of, op_flops,
                                  op_info, registered)
from autopar.passes.rules.dot import matmul_dims

# flag -> (primitives that have it, primitives that do not)
FLAGS = {
    "elementwise": ((lax.add_p, lax.tanh_p, lax.select_n_p, lax.sharding_constraint_p),
                    (lax.reshape_p, lax.optimization_barrier_p, lax.dot_general_p)),
    "fusible": ((lax.mul_p, lax.broadcast_in_dim_p, lax.transpose_p, lax.iota_p),
                (lax.dot_general_p, lax.gather_p, lax.reduce_sum_p)),
    "expensive": ((lax.exp_p, lax.tanh_p, lax.rsqrt_p, lax.logistic_p),
                  (lax.add_p, lax.mul_p, lax.max_p)),
    "library": ((lax.dot_general_p, lax.reduce_sum_p, lax.reduce_max_p),
                (lax.conv_general_dilated_p, lax.argmax_p, lax.add_p)),
    "library_elementwise": ((lax.add_p, lax.exp_p, lax.convert_element_type_p, lax.reshape_p,
                             lax.broadcast_in_dim_p),
                            (lax.select_n_p, lax.eq_p, lax.transpose_p)),
    "in_place": ((lax.scatter_p, lax.scatter_add_p, lax.scatter_max_p,
                  lax.dynamic_update_slice_p),
                 (lax.gather_p, lax.dynamic_slice_p)),
    "aliasing": ((lax.optimization_barrier_p,), (lax.copy_p, lax.add_p)),
    "reducing": ((lax.dot_general_p, lax.conv_general_dilated_p, lax.reduce_sum_p,
                  lax.reduce_or_p, lax.scatter_add_p),
                 (lax.add_p, lax.reduce_window_sum_p, lax.gather_p)),
    "follower": ((lax.add_p, lax.convert_element_type_p, lax.reshape_p, lax.transpose_p,
                  lax.squeeze_p),
                 (lax.broadcast_in_dim_p, lax.dot_general_p, lax.optimization_barrier_p)),
    "same_tensor": ((lax.add_p, lax.reshape_p, lax.broadcast_in_dim_p, lax.copy_p),
                    (lax.dot_general_p, lax.slice_p, lax.iota_p)),
    "forward_only": ((lax.dynamic_slice_p, lax.dynamic_update_slice_p),
                     (lax.slice_p, lax.gather_p)),
    "free": ((lax.reshape_p, lax.copy_p, lax.gather_p, lax.scatter_add_p,
              lax.optimization_barrier_p),
             (lax.add_p, lax.convert_element_type_p, lax.dot_general_p, lax.reduce_sum_p,
              lax.scatter_mul_p)),
    "contraction": ((lax.dot_general_p, lax.conv_general_dilated_p),
                    (lax.reduce_sum_p, lax.mul_p)),
    "gather_scatter": ((lax.gather_p, lax.scatter_p, lax.scatter_add_p, lax.scatter_min_p),
                       (lax.dynamic_slice_p, lax.dynamic_update_slice_p)),
}

MODELS = {"mlp": mlp, "gpt": gpt, "bert": bert, "moe": moe, "llama_nnx": llama_nnx,
          "convnet": convnet}
#: What passes.trace walks into instead of planning as one node.
CONTROL = trace_pass.CALLS | {P.scan_p, P.while_p, P.cond_p}


def test_every_key_is_a_primitive_object():
    assert registered()
    assert all(isinstance(p, Primitive) for p in registered())


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_flag_members(flag):
    have, have_not = FLAGS[flag]
    assert [p.name for p in have if not getattr(info_of(p), flag)] == []
    assert [p.name for p in have_not if getattr(info_of(p), flag)] == []


def test_constraints_name_the_parameter_holding_their_sharding():
    assert info_of(lax.sharding_constraint_p).pin_param == "sharding"
    assert info_of(lax.add_p).pin_param is None


def test_in_place_ops_are_every_scatter_and_dynamic_update_slice():
    # jax names its scatters with a hyphen; keyed by object, every spelling is one entry.
    assert {p for p, info in registered().items() if info.in_place} == {
        lax.scatter_p, lax.scatter_add_p, lax.scatter_mul_p, lax.scatter_min_p,
        lax.scatter_max_p, lax.dynamic_update_slice_p}


def test_an_unregistered_primitive_has_no_rule_and_no_flags():
    assert info_of(lax.fft_p) is UNKNOWN
    assert UNKNOWN.rule is None and not UNKNOWN.free and not UNKNOWN.elementwise


def test_version_lookups_skip_what_this_jax_lacks():
    assert _compat.primitive("add_p") is lax.add_p
    assert _compat.primitive("no_such_primitive_p") is None
    assert _compat.primitives("no_such_primitive_p", "tanh_p") == (lax.tanh_p,)


def _primitives(jaxpr, found=None):
    found = set() if found is None else found
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    _primitives(sub.jaxpr, found)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    _primitives(sub, found)
    return found


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_primitive_of_the_example_train_steps_is_known(model):
    fn, args = MODELS[model].make_train_step(MODELS[model].TINY)
    prims = _primitives(jax.make_jaxpr(fn)(*args).jaxpr)
    unknown = sorted(p.name for p in prims if p not in registered() and p not in CONTROL)
    assert unknown == []


def _node(fn, *args, prim):
    graph = trace_pass.trace(fn, args).graph
    node = next(n for n in graph.nodes if n.kind is NodeKind.OP and n.primitive is prim)
    ctx = RuleContext(tuple(s for s, _ in node.in_avals),
                      tuple(graph.values[v].shape for v in node.outs))
    return graph, node, ctx


FLOPS = [  # (fn, argument shapes, primitive, flops as XLA's cost analysis counts them)
    (lambda a, b: a @ b, ((16, 32), (32, 8)), lax.dot_general_p, 2 * 16 * 8 * 32),
    (lambda a: a.sum(1), ((16, 32),), lax.reduce_sum_p, 16 * 32),
    (lambda a: jnp.tanh(a), ((16, 32),), lax.tanh_p, 16 * 32),
    (lambda a: a.T, ((16, 32),), lax.transpose_p, 0),
]


@pytest.mark.parametrize("fn,shapes,prim,flops", FLOPS, ids=lambda v: getattr(v, "name", ""))
def test_flops(fn, shapes, prim, flops):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    _, node, ctx = _node(fn, *args, prim=prim)
    assert op_flops(node, ctx) == flops


def test_boundary_nodes_by_kind():
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    scale = np.ones((4, 8), np.float32)  # captured: a constant node
    graph = trace_pass.trace(lambda a: jnp.sin(a) * scale, (x,)).graph
    kinds = {n.kind: op_info(n) for n in graph.nodes}
    assert kinds[NodeKind.OUTPUT].same_tensor and kinds[NodeKind.OUTPUT].free
    assert not kinds[NodeKind.INPUT].same_tensor and kinds[NodeKind.INPUT].rule is not None
    assert kinds[NodeKind.CONST].rule is None and kinds[NodeKind.CONST].free


def test_matmul_dims_of_a_batched_dot():
    params = {"dimension_numbers": (((2,), (1,)), ((0,), (0,)))}
    assert matmul_dims([(4, 96, 64), (4, 64, 200)], **params) == (96, 200, 64)
    assert info_of(lax.dot_general_p).matmul_dims is matmul_dims
    assert info_of(lax.add_p).matmul_dims is None
