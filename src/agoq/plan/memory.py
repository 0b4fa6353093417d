"""The memory plan of one training configuration, per pipeline rank, for the baseline and AGoQ: for
each requested memory configuration, the stage bits and the recompute count that fit, on the byte
and time formulas of agoq.plan.accounting (:func:`plan_memory`).

The planner's public names are importable from here as before; they live in agoq.plan.config (the
configuration and sizes), agoq.plan.accounting (the formulas) and agoq.plan.result (the plan and
its JSON form).
"""

from __future__ import annotations

from dataclasses import replace

from agoq.activation.policy import ActivationPolicy
from agoq.parallel.dbca import BIT_CANDIDATES
from agoq.plan.accounting import PlanAccounting
from agoq.plan.config import (
    DEFAULT_SETUPS,
    DTYPES,
    PlanConfig,
    PlanError,
    Setup,
    format_size,
    make_plan_config,
    parse_setup,
    parse_size,
)
from agoq.plan.result import SCHEMA, Plan, RankMemory, SetupPlan

__all__ = [
    "DEFAULT_SETUPS",
    "DTYPES",
    "SCHEMA",
    "Plan",
    "PlanAccounting",
    "PlanConfig",
    "PlanError",
    "RankMemory",
    "Setup",
    "SetupPlan",
    "format_size",
    "make_plan_config",
    "parse_setup",
    "parse_size",
    "plan_memory",
]


def planned_setup(setup: Setup, dp: int) -> Setup:
    """The configuration whose bytes a row shows: at dp = 1 ZeRO-1 has one rank to shard over and
    shards nothing, so a +zero1 row is the configuration without it."""
    return replace(setup, zero1=False) if setup.zero1 and dp == 1 else setup


def _plan_setup(acc: PlanAccounting, named: Setup, budget_mode: bool) -> tuple[SetupPlan, list[float]]:
    """The plan of one configuration, and its per-rank times (for the relative time)."""
    setup = planned_setup(named, acc.cfg.dp)
    policy = acc.policy(setup)
    cap = acc.cfg.capacity
    base_bits = acc.shape.fmt.bits
    if not setup.activations:
        bits = [16] * acc.shape.num_stages
    elif budget_mode and cap is not None:
        bits = _budget_bits(acc, setup, policy, cap)
    else:
        bits = acc.activations.dbca_bits(policy)
    plain = [acc.rank_memory(r, setup, policy, bits, 0) for r in range(acc.cfg.pp)]
    k: int | None = 0
    if acc.cfg.recompute_layers:
        k = acc.cfg.recompute_layers
        ranks = [acc.rank_memory(r, setup, policy, bits, k) for r in range(acc.cfg.pp)]
    elif cap is not None and any(r.total > cap for r in plain):
        # Megatron's recompute_num_layers is one count for every (virtual) stage: take the
        # smallest that fits every rank, with 4-bit stages where bits were raised.
        if setup.activations and budget_mode:
            bits = [base_bits] * acc.shape.num_stages
        k = None
        for n in range(1, max(len(r) for r in acc.shape.ranges) + 1):
            ranks = [acc.rank_memory(r, setup, policy, bits, n) for r in range(acc.cfg.pp)]
            if all(r.total <= cap for r in ranks):
                k = n
                break
        if k is None:
            n = max(len(r) for r in acc.shape.ranges)
            ranks = [acc.rank_memory(r, setup, policy, bits, n) for r in range(acc.cfg.pp)]
    else:
        ranks = plain
    for r, p in zip(ranks, plain):
        r.total_without_recompute = p.total
    fits = None if cap is None else all(r.total <= cap for r in ranks)
    applied = k if k is not None else max(len(r) for r in acc.shape.ranges)
    times = [acc.rank_time(r, setup, applied, policy, bits) for r in range(acc.cfg.pp)]
    return SetupPlan(named, ranks, fits, k, 0.0), times


def _budget_bits(acc: PlanAccounting, setup: Setup, policy: ActivationPolicy, cap: int) -> list[int]:
    """Per stage, the highest bits (base..8, or 16) that keep its rank within the budget; base where none does."""
    base = acc.shape.fmt.bits
    candidates = [b for b in BIT_CANDIDATES if b >= base]
    bits = [base] * acc.shape.num_stages
    for rank in range(acc.cfg.pp):
        for b in reversed(candidates):
            trial = list(bits)
            for s in acc.shape.rank_stages[rank]:
                trial[s] = b
            if acc.rank_memory(rank, setup, policy, trial, 0).total <= cap or b == base:
                bits = trial
                break
    return bits


def plan_memory(cfg: PlanConfig) -> Plan:
    """Per pp rank bytes of every configuration in cfg.setups, with recompute to fit and time estimates."""
    planner = PlanAccounting(cfg)
    budget_mode = cfg.memory_budget is not None
    results, times = [], {}
    for name in cfg.setups:
        setup = parse_setup(name)
        sp, t = _plan_setup(planner, setup, budget_mode)
        results.append(sp)
        times[setup.name] = t
    reference = max(planner.rank_time(r, Setup(), 0, planner.policy(Setup())) for r in range(cfg.pp))
    for sp in results:
        # A pipeline runs at the pace of its slowest rank.
        sp.relative_time = max(times[sp.setup.name]) / reference
    return Plan(cfg, results, tuple(planner.shape.inflight), planner.activations.layer_units)
