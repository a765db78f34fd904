"""Example workloads for autopar: test and benchmark models.

Every module (``mlp``, ``gpt``, ``bert``, ``moe``, ``llama_nnx``, ``convnet``) exposes a frozen
``Config`` dataclass, ``TINY`` and ``REALISTIC`` configs, and
``make_train_step(config, *, abstract=False) -> (train_step, (params, opt_state, batch))``
plus ``make_forward(config, *, abstract=False) -> (loss_fn, (params, batch))``.
"""

MODEL_NAMES = ("mlp", "gpt", "bert", "moe", "llama_nnx", "convnet")
