"""A multilayer perceptron (flax linen, Adam, MSE loss), planned and trained by autopar.

    python examples/mlp.py --mesh data=2,model=4 --steps 5 --hardware h100
"""

import os
import sys


def build(size: str, abstract: bool = False):
    from autopar.models import mlp
    return mlp.make_train_step(mlp.TINY if size == "tiny" else mlp.TP_FRIENDLY_WIDE,
                               abstract=abstract)

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from examples import _run
    sys.exit(_run.main(build, __doc__))
