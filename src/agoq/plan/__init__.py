"""The memory planner: bytes per pipeline rank of a real configuration, baseline vs AGoQ (``agoq plan``).

Names are imported on first use (PEP 562), so ``agoq plan --help`` does not import torch.
"""

from agoq import _lazy_exports

_HOMES = {
    **{
        name: "agoq.plan.config"
        for name in (
            "DEFAULT_SETUPS",
            "PlanConfig",
            "PlanError",
            "Setup",
            "format_size",
            "from_train_config",
            "make_plan_config",
            "parse_setup",
            "parse_size",
        )
    },
    **{name: "agoq.plan.result" for name in ("SCHEMA", "Plan", "RankMemory", "SetupPlan")},
    "PlanAccounting": "agoq.plan.accounting",
    "plan_memory": "agoq.plan.memory",
    "markdown": "agoq.plan.report",
    "to_json": "agoq.plan.report",
}

__all__ = sorted(_HOMES)
__getattr__ = _lazy_exports(__name__, _HOMES)
