"""A GPT-2 style decoder (flax linen: learned positions, pre-LayerNorm blocks, tied
embeddings) trained with AdamW, planned and trained by autopar.

    python examples/gpt2.py --mesh data=2,model=4 --steps 5 --hardware h100
"""

import dataclasses
import os
import sys

WEIGHT_DECAY = 0.1


def build(size: str, abstract: bool = False):
    from autopar.models import common, gpt
    # Realistic widths, two layers: the plan of each layer is the same, and two plan faster.
    config = gpt.TINY if size == "tiny" else dataclasses.replace(gpt.REALISTIC, layers=2)
    return gpt.make_train_step(config, abstract=abstract,
                               tx=common.make_optimizer(weight_decay=WEIGHT_DECAY))

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from examples import _run
    sys.exit(_run.main(build, __doc__))
