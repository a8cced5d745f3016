"""autopar: automatic data, operator and pipeline parallelism for JAX train steps."""

from autopar import stages
from autopar.api import ParallelizedStep, parallelize
from autopar.checkpoints import restore_target
from autopar.errors import (
    AutoparError,
    BatchSizeError,
    DistributedError,
    InvalidOptionError,
    MeshError,
    PlanError,
    TraceError,
)
from autopar.frontend.plan_cache import PlanCacheWarning
from autopar.ir.loss_markers import grad, mark_pipeline_boundary, value_and_grad
from autopar.method_builders import pinned
from autopar.methods import (
    AutoParallel,
    DataParallel,
    ManualStages,
    PipeshardParallel,
    ShardParallel,
    Zero2Parallel,
    Zero3Parallel,
)
from autopar.plan import Plan, ShardingSpec, StagePlan
from autopar.runtime import distributed
from autopar.version import __version__

__all__ = [
    "AutoParallel",
    "AutoparError",
    "BatchSizeError",
    "DataParallel",
    "DistributedError",
    "InvalidOptionError",
    "ManualStages",
    "MeshError",
    "ParallelizedStep",
    "PipeshardParallel",
    "Plan",
    "PlanCacheWarning",
    "PlanError",
    "ShardParallel",
    "ShardingSpec",
    "StagePlan",
    "TraceError",
    "Zero2Parallel",
    "Zero3Parallel",
    "__version__",
    "distributed",
    "grad",
    "mark_pipeline_boundary",
    "parallelize",
    "pinned",
    "restore_target",
    "stages",
    "value_and_grad",
]
