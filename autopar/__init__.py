"""autopar: automatic data, operator and pipeline parallelism for JAX train steps."""

from autopar.api import ParallelizedStep, parallelize
from autopar.compiler.plan import Plan, ShardingSpec, StagePlan
from autopar.errors import (
    AutoparError,
    BatchSizeError,
    InvalidOptionError,
    MeshError,
    PlanError,
    TraceError,
)
from autopar.methods import DataParallel, ShardParallel

__version__ = "0.1.0"

__all__ = [
    "AutoparError",
    "BatchSizeError",
    "DataParallel",
    "InvalidOptionError",
    "MeshError",
    "ParallelizedStep",
    "Plan",
    "PlanError",
    "ShardParallel",
    "ShardingSpec",
    "StagePlan",
    "TraceError",
    "__version__",
    "parallelize",
]
