"""A ResNet-style convnet (flax linen: 3x3 convolutions, BatchNorm, residual blocks, average
pooling) on NHWC images, planned and trained by autopar. BatchNorm's running statistics are
part of the train step's state, so they are sharded and updated like the parameters.

    python examples/resnet.py --mesh data=2,model=4 --steps 5 --hardware h100
"""

import os
import sys


def build(size: str, abstract: bool = False):
    from autopar.models import convnet
    return convnet.make_train_step(convnet.TINY if size == "tiny" else convnet.REALISTIC,
                                   abstract=abstract)

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from examples import _run
    sys.exit(_run.main(build, __doc__))
