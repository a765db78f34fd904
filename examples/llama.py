"""A Llama-style decoder in flax NNX (RMSNorm, rotary position embeddings, SwiGLU,
grouped-query attention, untied LM head), planned and trained by autopar.

The train step takes the ``nnx.State`` from ``nnx.split(model)`` and merges it inside, so
autopar plans the NNX model like any pytree of arrays.

    python examples/llama.py --mesh data=2,model=4 --steps 5 --hardware h100
"""

import dataclasses
import os
import sys


def build(size: str, abstract: bool = False):
    from autopar.models import llama_nnx
    # Realistic widths, two layers: the plan of each layer is the same, and two plan faster.
    config = (llama_nnx.TINY if size == "tiny"
              else dataclasses.replace(llama_nnx.REALISTIC, layers=2))
    return llama_nnx.make_train_step(config, abstract=abstract)

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from examples import _run
    sys.exit(_run.main(build, __doc__))
