"""autopar: a compiler-based auto-parallelizer for JAX.

``autopar.plan(fn, *args, mesh=...)`` decides how every tensor of ``fn`` is sharded on the mesh
and returns a :class:`Plan`; ``autopar.parallelize`` does it on the first call of a function.
"""

from autopar.errors import AutoparError as AutoparError
from autopar.errors import InfeasiblePlanError as InfeasiblePlanError
from autopar.errors import MeshError as MeshError
from autopar.errors import OtherProcessError as OtherProcessError
from autopar.errors import ShardingHintError as ShardingHintError

# The compiler (passes/, cost_model/) imports autopar.errors, so the API is loaded on first use
# rather than here, which keeps `import passes` and `import autopar` free of cycles.
_LAZY = {"plan": "autopar._api", "parallelize": "autopar._api", "Plan": "autopar._plan",
         "profile": "cost_model.profiler"}

__all__ = ["plan", "parallelize", "Plan", "profile", "AutoparError", "InfeasiblePlanError",
           "MeshError", "OtherProcessError", "ShardingHintError"]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
