"""Targets for `autopar report`: zero-argument functions returning (fn, example_args).

    autopar report autopar.models.targets:gpt_realistic --mesh data=2,model=4 --hardware h100
"""

import dataclasses

from autopar._grad import value_and_grad
from autopar.models import gpt, mlp


def gpt_tiny():
    return gpt.make_train_step(gpt.TINY)


def gpt_realistic():
    """A 2-layer GPT at realistic widths, compiled from abstract arguments only."""
    cfg = dataclasses.replace(gpt.REALISTIC, vocab=16384, seq=512, hidden=1024, heads=16,
                              layers=2, batch=16)
    return gpt.make_train_step(cfg, abstract=True)


def gpt_pipelined():
    """The tiny GPT with its 4 layers scanned and its loss marked with
    ``autopar.value_and_grad``, for ``--pipeline`` (e.g. ``--mesh stage=4,data=2 --pipeline
    axis=stage,schedule=1f1b``)."""
    config = dataclasses.replace(gpt.TINY_SCAN, layers=4)
    return gpt.make_train_step(config, value_and_grad=value_and_grad)


def mlp_wide():
    return mlp.make_train_step(mlp.TP_FRIENDLY_WIDE, abstract=True)
