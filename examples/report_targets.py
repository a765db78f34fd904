"""Targets for `autopar report`: zero-argument functions returning (fn, example_args).

    autopar report examples/report_targets.py:gpt_realistic --mesh data=2,model=4 --hardware h100

Write your own file like this one: each target builds a step and its example arguments
(arrays, or `jax.ShapeDtypeStruct`s to plan at sizes that need not fit this machine).
"""

from autopar.models.targets import gpt_pipelined, gpt_realistic, gpt_tiny, mlp_wide

__all__ = ["gpt_pipelined", "gpt_realistic", "gpt_tiny", "mlp_wide"]
