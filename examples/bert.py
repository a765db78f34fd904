"""A BERT-style encoder (flax linen, post-LayerNorm, bidirectional attention) trained on a
masked-language-model loss, planned and trained by autopar.

    python examples/bert.py --mesh data=2,model=4 --steps 5 --hardware h100
"""

import os
import sys


def build(size: str):
    from autopar.models import bert
    return bert.make_train_step(bert.TINY if size == "tiny" else bert.REALISTIC)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from examples import _run
    sys.exit(_run.main(build, __doc__))
