"""The ILP prices an edge with too many spec pairs axis by axis
(``MeshContext.axis_reshard_time_s``). That sum is an approximation of the joint price, but
it must never call a move free that the joint price (what the estimate charges) does not."""

import itertools

import pytest

from autopar._mesh import as_auto_mesh, axis_sizes
from autopar.cost_model.hardware import axis_levels, get_profile
from autopar.passes.ir import Value
from autopar.cost_model.spec import Spec
from autopar.passes.strategies import MeshContext


def _mesh(shape: dict) -> MeshContext:
    jax_mesh = as_auto_mesh(shape)
    return MeshContext(tuple(jax_mesh.axis_names), axis_sizes(jax_mesh),
                       axis_levels(jax_mesh, get_profile("h100"), None), get_profile("h100"))


def _specs(rank: int, axes: tuple[str, ...]) -> list[Spec]:
    """Every spec of ``rank`` dims over ``axes`` (each axis splits one dim or none; the axes of
    a dim in mesh order)."""
    out = []
    for where in itertools.product([None, *range(rank)], repeat=len(axes)):
        out.append(Spec(tuple(tuple(a for a, d in zip(axes, where) if d == dim)
                              for dim in range(rank))))
    return out


@pytest.mark.parametrize("shape", [{"data": 4, "model": 2}, {"data": 2, "model": 2, "expert": 2}])
def test_a_move_the_joint_price_charges_is_never_free_axis_by_axis(shape):
    mesh = _mesh(shape)
    value = Value(0, (16, 16, 64), "float32")
    specs = _specs(value.rank, mesh.axis_names)
    free_but_moved = []
    for src, dst in itertools.product(specs, specs):
        joint = mesh.reshard_time_s(src, dst, value)
        by_axis = sum(mesh.axis_reshard_time_s(a, src.place_of(a), dst.place_of(a), value)
                      for a in mesh.axis_names)
        if joint > 0 and by_axis == 0:
            free_but_moved.append(f"{src} -> {dst}")
    assert not free_but_moved, free_but_moved[:5]


def test_an_axis_behind_another_in_its_dim_holds_other_blocks():
    """S(model) to S(data,model): the Llama's attention mask on (4, 2), which the ILP took
    as free and the estimate gathers."""
    mesh = _mesh({"data": 4, "model": 2})
    value = Value(0, (16, 16, 512, 512), "bool")
    src, dst = Spec((("model",), (), (), ())), Spec((("data", "model"), (), (), ()))
    assert src.place_of("model") == (0, ()) and dst.place_of("model") == (0, ("data",))
    assert mesh.reshard_time_s(src, dst, value) > 0
    assert mesh.axis_reshard_time_s("model", src.place_of("model"), dst.place_of("model"),
                                    value) > 0
    # After the same axes, the blocks agree: slicing is free both ways of pricing it.
    finer = Spec((("model",), ("data",), (), ()))
    assert mesh.reshard_time_s(src, finer, value) == 0
    assert sum(mesh.axis_reshard_time_s(a, src.place_of(a), finer.place_of(a), value)
               for a in mesh.axis_names) == 0
