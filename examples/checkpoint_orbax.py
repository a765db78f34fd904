"""Restore an orbax checkpoint straight into autopar's shardings.

``plan.in_shardings`` is a pytree of ``NamedSharding`` shaped like the arguments, so it is
exactly what orbax needs to restore each array already sharded as the plan wants it: no
host round trip, no resharding at the first step.

    python examples/checkpoint_orbax.py        # on 8 simulated CPU devices
"""

from __future__ import annotations

import os
import sys
import tempfile


def save_and_restore(directory: str, pins=None):
    """Plan a GPT train step, save its parameters, restore them sharded by the plan.

    ``pins``: optional ``{parameter path: PartitionSpec}`` (paths as ``jax.tree_util.keystr``
    writes them, e.g. ``"['block_0']['mlp_in']['kernel']"``) that the plan must keep; autopar
    decides the rest. Returns (plan, params saved, params restored)."""
    import jax
    import orbax.checkpoint as ocp

    import autopar
    from autopar.models import gpt

    step, (params, opt_state, batch) = gpt.make_train_step(gpt.TINY)
    hint = jax.tree_util.tree_map_with_path(
        lambda path, _: (pins or {}).get(jax.tree_util.keystr(path)), params)
    plan = autopar.plan(step, params, opt_state, batch, mesh={"data": 2, "model": 4},
                        in_shardings=(hint, None, None))

    path = os.path.join(os.path.abspath(directory), "params")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, params)
    # The restore target: shapes and dtypes of the parameters, with the plan's shardings.
    target = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        params, plan.in_shardings[0])
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(path, target)
    return plan, params, restored


def main() -> int:
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    with tempfile.TemporaryDirectory() as d:
        _, _, restored = save_and_restore(d)
    for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0][:4]:
        print(f"{jax.tree_util.keystr(path):<40} {leaf.sharding.spec}")
    print("... every parameter restored with the plan's sharding")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
