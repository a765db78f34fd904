"""Compiles small programs on 16 simulated CPU devices and prints their HLO texts as one JSON
object (name -> text); run as ``python -m tests.cost_model.sixteen_devices`` in a process of
its own (the test session has 8 devices). Meshes: ``node=2 x gpu=8``, ``a=2 x b=2 x c=4``
and ``x=4 x y=4``, devices in id order."""

import json
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=16"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

GLOBAL = jax.ShapeDtypeStruct((256, 128), jnp.float32)


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _shard_map(mesh, body, in_spec, out_spec):
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False)
    return jax.jit(fn).lower(GLOBAL).compile().as_text()


def _jit(mesh, fn, in_spec, out_spec):
    return jax.jit(fn, in_shardings=NamedSharding(mesh, in_spec),
                   out_shardings=NamedSharding(mesh, out_spec)).lower(GLOBAL).compile().as_text()


def programs() -> dict[str, str]:
    nodes, cube, square = _mesh((2, 8), ("node", "gpu")), _mesh((2, 2, 4), ("a", "b", "c")), _mesh((4, 4), ("x", "y"))
    ring = [(i, (i + 1) % 8) for i in range(8)]
    return {
        "psum_node": _shard_map(nodes, lambda a: lax.psum(a, "node"), P("node"), P()),
        "psum_gpu": _shard_map(nodes, lambda a: lax.psum(a, "gpu"), P("gpu"), P()),
        "ppermute_node": _shard_map(nodes, lambda a: lax.ppermute(a, "node", [(0, 1), (1, 0)]),
                                    P("node"), P("node")),
        "ppermute_gpu": _shard_map(nodes, lambda a: lax.ppermute(a, "gpu", ring), P("gpu"), P("gpu")),
        "gather_node": _jit(nodes, lambda a: a * 2, P("node", None), P()),
        "gather_gpu": _jit(nodes, lambda a: a * 2, P("gpu", None), P()),
        "gather_ac": _jit(cube, lambda a: a * 2, P(("a", "c"), None), P()),
        "gather_ca": _jit(cube, lambda a: a * 2, P(("c", "a"), None), P()),
        # rows split 16 ways, summed in halves, the result split over 'y': an all-reduce, a
        # collective-permute and an all-gather with iota groups [8,2]<=[2,2,4]T(2,1,0)
        "halves_to_y": _jit(square, lambda a: a.reshape(2, 128, 128).sum(0), P(("x", "y")),
                            P("y")),
    }


if __name__ == "__main__":
    print(json.dumps(programs()))
