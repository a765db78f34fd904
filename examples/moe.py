"""A mixture-of-experts decoder (flax linen) with GShard/Switch-style top-2 routing:
per-expert capacity, one-hot dispatch and combine einsums, a load-balancing loss. autopar
decides whether to split the experts (expert parallelism), the batch, or the hidden dims.

    python examples/moe.py --mesh data=2,model=4 --steps 5 --hardware h100
"""

import os
import sys


def build(size: str, abstract: bool = False):
    from autopar.models import moe
    return moe.make_train_step(moe.TINY if size == "tiny" else moe.REALISTIC, abstract=abstract)

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from examples import _run
    sys.exit(_run.main(build, __doc__))
