"""plan.in_shardings restores an orbax checkpoint sharded as the plan wants it."""

import jax
import numpy as np

from examples.checkpoint_orbax import save_and_restore


def test_restore_with_plan_shardings(tmp_path):
    plan, saved, restored = save_and_restore(str(tmp_path))
    want = jax.tree_util.tree_leaves(plan.in_shardings[0])
    got = jax.tree_util.tree_leaves(restored)
    assert len(got) == len(want) == len(jax.tree_util.tree_leaves(saved))
    assert any(s.spec for s in want)  # the plan does shard some parameters
    for leaf, sharding, original in zip(got, want, jax.tree_util.tree_leaves(saved)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(original))
