"""Realistic-width, few-layer train steps, compiled from ShapeDtypeStruct arguments (never run),
shared by the quality, estimate and ranking tests. Quality per layer does not depend on depth,
so two layers (one for MoE) keep compiling fast; widths are those of real models."""

import dataclasses

from autopar.models import bert, gpt, mlp, moe

#: name -> (model module, config)
WORKLOADS = {
    "gpt": (gpt, dataclasses.replace(gpt.REALISTIC, vocab=16384, seq=512, hidden=1024,
                                     heads=16, layers=2, batch=16)),
    "bert": (bert, dataclasses.replace(bert.REALISTIC, vocab=16384, seq=512, hidden=1024,
                                       heads=16, layers=2, batch=16)),
    "moe": (moe, dataclasses.replace(moe.REALISTIC, vocab=8192, seq=512, hidden=1024,
                                     ffn=4096, heads=16, layers=1, experts=8, batch=16)),
    "mlp": (mlp, mlp.REALISTIC),
}


def abstract_train_step(name: str):
    """(train_step, ShapeDtypeStruct args) of workload ``name``."""
    mod, cfg = WORKLOADS[name]
    return mod.make_train_step(cfg, abstract=True)
