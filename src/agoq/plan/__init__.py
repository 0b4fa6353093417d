"""The memory planner: bytes per pipeline rank of a real configuration, baseline vs AGoQ (``agoq plan``).

Names are imported on first use (PEP 562), so ``agoq plan --help`` does not import torch.
"""

from importlib import import_module
from typing import Any

_HOMES = {
    **{name: "agoq.plan.memory" for name in (
        "DEFAULT_SETUPS", "SCHEMA", "Plan", "PlanConfig", "PlanError", "RankMemory", "Setup", "SetupPlan", "format_size",
        "from_train_config", "make_plan_config", "parse_setup", "parse_size", "plan_memory",
    )},
    "markdown": "agoq.plan.report",
    "to_json": "agoq.plan.report",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'agoq.plan' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
