"""autopar: a compiler-based auto-parallelizer for JAX.

``autopar.plan(fn, *args, mesh=...)`` decides how every tensor of ``fn`` is sharded on the mesh
and returns a :class:`Plan`; ``autopar.parallelize`` does it on the first call of a function.
"""

from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _version

from autopar import baselines as baselines
from autopar._api import parallelize as parallelize
from autopar._api import plan as plan
from autopar._plan import Plan as Plan
from autopar._compare import compare as compare
from autopar._grad import grad as grad
from autopar.passes.attention import attention as attention
from autopar._mesh import simulate_cpu_devices as simulate_cpu_devices
from autopar._grad import value_and_grad as value_and_grad
from autopar._pipeline import Pipeline as Pipeline
from autopar.cost_model.profiler import profile as profile
from autopar.errors import ArgumentError as ArgumentError
from autopar.errors import AutoparError as AutoparError
from autopar.errors import AttentionWarning as AttentionWarning
from autopar.errors import AutoparWarning as AutoparWarning
from autopar.errors import CLIError as CLIError
from autopar.errors import HardwareWarning as HardwareWarning
from autopar.errors import InfeasiblePlanError as InfeasiblePlanError
from autopar.errors import MemoryBudgetWarning as MemoryBudgetWarning
from autopar.errors import PlanCacheWarning as PlanCacheWarning
from autopar.errors import MeshError as MeshError
from autopar.errors import OtherProcessError as OtherProcessError
from autopar.errors import PlanFormatError as PlanFormatError
from autopar.errors import PipelineError as PipelineError
from autopar.errors import ProfileError as ProfileError
from autopar.errors import RematWarning as RematWarning
from autopar.errors import ReplanWarning as ReplanWarning
from autopar.errors import ShardingConflictWarning as ShardingConflictWarning
from autopar.errors import ShardingHintError as ShardingHintError
from autopar.errors import SolverFallbackWarning as SolverFallbackWarning
from autopar.errors import StalePlanCacheWarning as StalePlanCacheWarning
from autopar.errors import TracingError as TracingError
from autopar.errors import UnknownHardwareError as UnknownHardwareError
from autopar.errors import UnsupportedPrimitiveWarning as UnsupportedPrimitiveWarning
from autopar.errors import UnusableCacheDirWarning as UnusableCacheDirWarning
from autopar.errors import UnusedAnnotationWarning as UnusedAnnotationWarning

try:
    __version__ = _version("autopar")
except _NotInstalled:  # run from a source tree that was never installed
    __version__ = "0+unknown"
