"""The memory planner: bytes per pipeline rank of a real configuration, baseline vs AGoQ (``agoq plan``)."""

from agoq.plan.memory import (
    DEFAULT_SETUPS,
    SCHEMA,
    Plan,
    PlanConfig,
    PlanError,
    RankMemory,
    Setup,
    SetupPlan,
    format_size,
    from_train_config,
    make_plan_config,
    parse_setup,
    parse_size,
    plan_memory,
)
from agoq.plan.report import markdown, to_json

__all__ = [
    "DEFAULT_SETUPS",
    "SCHEMA",
    "Plan",
    "PlanConfig",
    "PlanError",
    "RankMemory",
    "Setup",
    "SetupPlan",
    "format_size",
    "from_train_config",
    "make_plan_config",
    "markdown",
    "parse_setup",
    "parse_size",
    "plan_memory",
    "to_json",
]
