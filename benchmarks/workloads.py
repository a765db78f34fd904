"""The benchmark's workloads: every example model at realistic widths, two layers.

Shapes follow docs/benchmarks.md's table (hidden 1024, sequence 512, batch 16, bf16 compute) where a
model has them; quality per layer does not depend on depth, so two layers keep compiling
fast. Arguments are ShapeDtypeStructs: the programs are compiled, never run.
"""

from __future__ import annotations

import dataclasses

from autopar.models import convnet, llama_nnx
from autopar.models.workloads import WORKLOADS as SHARED

#: name -> (model module, config); gpt, bert, moe and mlp are the tests' realistic workloads.
WORKLOADS = {
    **SHARED,
    "llama": (llama_nnx, dataclasses.replace(
        llama_nnx.REALISTIC, vocab=16384, seq=512, hidden=1024, heads=16, kv_heads=4,
        ffn=2816, layers=2, batch=16)),
    "resnet": (convnet, convnet.REALISTIC),
}


def abstract_train_step(name: str):
    """(train_step, ShapeDtypeStruct args) of workload ``name``."""
    module, config = WORKLOADS[name]
    return module.make_train_step(config, abstract=True)
