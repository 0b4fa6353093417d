"""The memory planner: bytes per pipeline rank of a real configuration, baseline vs AGoQ (``agoq plan``).

Names are imported on first use (PEP 562), so ``agoq plan --help`` does not import torch. The
sizes, setups and accounting behind them stay in their modules (``config``, ``accounting``, ``result``).
"""

from agoq import _lazy_dir, _lazy_exports

_HOMES = {
    **{name: "agoq.plan.config" for name in ("PlanConfig", "PlanError", "make_plan_config")},
    # The PlanConfig of an `agoq train` configuration: read there, where the whole TrainConfig is read.
    "from_train_config": "agoq.launch.planning",
    "Plan": "agoq.plan.result",
    "plan_memory": "agoq.plan.memory",
    "markdown": "agoq.plan.report",
    "to_json": "agoq.plan.report",
}

__all__ = sorted(_HOMES)
__getattr__ = _lazy_exports(__name__, _HOMES)
__dir__ = _lazy_dir(globals(), _HOMES)
