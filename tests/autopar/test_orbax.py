"""plan.in_shardings restores an orbax checkpoint sharded as the plan wants it."""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from examples.checkpoint_orbax import save_and_restore


def test_restore_with_plan_shardings(tmp_path):
    # Pin one parameter so the checkpoint holds a sharded array whatever the planner picks
    # for these tiny shapes; the rest are left to autopar.
    pinned = "['block_0']['mlp_in']['kernel']"
    plan, saved, restored = save_and_restore(str(tmp_path), {pinned: P(None, "model")})
    want = jax.tree_util.tree_leaves(plan.in_shardings[0])
    got = jax.tree_util.tree_leaves(restored)
    assert len(got) == len(want) == len(jax.tree_util.tree_leaves(saved))
    sharded = 0
    for leaf, sharding, original in zip(got, want, jax.tree_util.tree_leaves(saved)):
        sharded += not sharding.is_fully_replicated
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(original))
    assert sharded >= 1  # the restore did place shards
    assert restored["block_0"]["mlp_in"]["kernel"].sharding.spec == P(None, "model")
