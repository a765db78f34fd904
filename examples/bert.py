"""A BERT-style encoder (flax linen, post-LayerNorm, bidirectional attention) trained on a
masked-language-model loss, planned and trained by autopar.

    python examples/bert.py --mesh data=2,model=4 --steps 5 --hardware h100
"""

import dataclasses
import os
import sys


def build(size: str, abstract: bool = False):
    from autopar.models import bert
    # Realistic widths, two layers: the plan of each layer is the same, and two plan faster.
    config = bert.TINY if size == "tiny" else dataclasses.replace(bert.REALISTIC, layers=2)
    return bert.make_train_step(config, abstract=abstract)

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from examples import _run
    sys.exit(_run.main(build, __doc__))
