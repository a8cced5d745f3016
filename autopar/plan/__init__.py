"""The typed contract between the compiler and the runtime: a :class:`Plan` of stages
(:class:`StagePlan`), each with its mesh, devices and :class:`ShardingSpec` s, a
:class:`PipelineLayout` for pipelined plans, and a strict, versioned JSON round trip.

May import: ``autopar.errors``, ``autopar.ir`` (the schedule names) and this package; every
other room reads it.
"""

from autopar.plan.planning_record import PlanningRecord
from autopar.plan.specs import CollectiveEstimate, CollectiveKind, ShardingSpec, collective_kind
from autopar.plan.stage import StagePlan
from autopar.plan.step import FORMAT_VERSION, InputSignature, MethodName, PipelineLayout, Plan

__all__ = [
    "FORMAT_VERSION",
    "CollectiveEstimate",
    "CollectiveKind",
    "InputSignature",
    "MethodName",
    "PipelineLayout",
    "Plan",
    "PlanningRecord",
    "ShardingSpec",
    "StagePlan",
    "collective_kind",
]
