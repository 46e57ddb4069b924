"""The layout planner: a memory model per role and rank, an analytical step-time model, and a search over
layouts that picks, explains and checks one (docs/planner.md)."""

from hf_verl.planner.architectures import (
           REFERENCE_ARCHITECTURES,
           Architecture,
           resolve_architecture,
)
from hf_verl.planner.memory import Layout, MemoryEstimate, Workload, memory_breakdown

__all__ = ["REFERENCE_ARCHITECTURES", "Architecture", "Layout", "MemoryEstimate", "Workload", "memory_breakdown",
           "resolve_architecture"]
from hf_verl.planner.plan import Plan, PlanError, RolePlan, plan  # noqa: E402
from hf_verl.planner.steptime import H100, Hardware, StepTime, step_time  # noqa: E402

__all__ += ["H100", "Hardware", "Plan", "PlanError", "RolePlan", "StepTime", "plan", "step_time"]
from hf_verl.planner.estimate import estimate_memory  # noqa: E402

__all__ += ["estimate_memory"]
