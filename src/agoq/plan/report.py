"""A plan as markdown tables (for people) or JSON (schema agoq.plan/1, documented in docs/plan.md)."""

from __future__ import annotations

import json

from agoq.parallel.pipeline import schedule_name
from agoq.models.config import parameter_count_text
from agoq.plan.config import format_size
from agoq.plan.result import Plan, SetupPlan

TIME_NOTE = (
    "Iteration times are estimates: per token, a layer's forward costs its GEMMs plus causal attention, backward "
    "twice that, a recomputed layer one more forward, AGoQ's quantization +2% forward / +3% backward (the paper's "
    "kernel measurements), the fused loss one more LM-head forward where it recomputes (GPipe); the slowest pp rank sets the pace; "
    "communication and pipeline bubbles are not modelled."
)

ZERO1_DP1_NOTE = (
    "At dp=1 ZeRO-1 has one rank to shard over and shards nothing: each +zero1 row is the configuration without it "
    "(set parallel.zero1=false to train it; ZeRO-1 saves memory from dp=2 on)."
)


def to_json(plan: Plan) -> str:
    """The plan as indented JSON (schema agoq.plan/1)."""
    return json.dumps(plan.to_dict(), indent=2)


def _bits(bits: tuple[int, ...] | None) -> str:
    if bits is None:
        return "bf16"
    return "/".join("bf16" if b >= 16 else str(b) for b in bits)


def verdict(sp: SetupPlan) -> str:
    """What a configuration's row means for the user, in words: fits as is, fits with recomputation, or does not fit."""
    k = sp.recompute_layers
    recomputed = f"{k} layer{'s' if k != 1 else ''} per stage recomputed" if k else ""
    if sp.fits is None:
        return f"{recomputed}; no memory limit given" if recomputed else "no memory limit given (--gpu-memory)"
    if sp.fits:
        return f"fits with {recomputed}" if recomputed else "fits as is"
    return "**does not fit**, even recomputing every layer" if k is None else f"**does not fit** with {recomputed or 'no recompute'}"


def _link_table(plan: Plan) -> list[str]:
    """Gradient bytes per rank and step by link class, per gradient mode (none at dp = 1)."""
    c = plan.config
    if c.dp == 1:
        return []
    links = plan.gradient_link_bytes()
    fp32 = links["fp32"]["inter_node"]
    lines = [
        "",
        f"Gradient bytes per rank and step by link, dp={c.dp} in nodes of {min(c.node_size, c.dp)} ranks (--node-size), "
        "averaged over the ranks (`precision.gradients` of agoq train):",
        "",
        "| gradients | within a node | between nodes | between nodes vs fp32 |",
        "|---|---|---|---|",
    ]
    for mode, b in links.items():
        ratio = f"{b['inter_node'] / fp32:.3f}x" if fp32 else "-"
        lines.append(f"| {mode} | {format_size(b['intra_node'])} | {format_size(b['inter_node'])} | {ratio} |")
    return lines


def markdown(plan: Plan) -> str:
    """Per-rank and summary tables of every configuration, with the assumptions that matter."""
    c = plan.config
    lines = [
        f"# agoq plan: {c.model_name} ({parameter_count_text(c.model.num_parameters())})",
        "",
        f"tp={c.tp}{' (sequence parallel)' if c.tp > 1 else ''}, pp={c.pp}, dp={c.dp}, schedule {schedule_name(c.schedule)}"
        f"{f' x {c.vstages} virtual stages' if c.vstages > 1 else ''}, seq {c.seq_len}, micro-batch {c.micro_batch} x "
        f"{c.microbatches} micro-batches (global batch {c.micro_batch * c.dp * c.microbatches}), {c.dtype} compute, "
        f"activations {c.activation_format}, stage bits {'chosen for the budget' if c.memory_budget is not None else c.stage_bits}.",
        "",
        f"Saved per decoder layer (before tp): baseline {plan.layer_units['baseline']:.2f}U, AGoQ {plan.layer_units['A']:.2f}U "
        f"(U = micro-batch x seq x hidden x 2 bytes). Peak in-flight micro-batches per pp rank: {', '.join(map(str, plan.inflight))}.",
    ]
    if c.capacity is not None:
        if c.memory_budget is not None:
            lines.append(f"Memory budget per GPU: {format_size(c.memory_budget)}.")
        else:
            lines.append(f"GPU memory {format_size(c.gpu_memory)}, less {format_size(c.reserved)} reserved: {format_size(c.capacity)} per GPU.")
    lines += [
        "",
        "| configuration | pp rank | layers | act. bits | in flight | parameters | gradients | optimizer | act. / micro-batch "
        "| act. peak | pipeline buffers | temporary | total | recompute |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sp in plan.setups:
        for r in sp.ranks:
            lines.append(
                f"| {sp.setup.name} | {r.pp_rank} | {r.layers} | {_bits(r.bits)} | {r.inflight} | {format_size(r.parameters)} "
                f"| {format_size(r.gradients)} | {format_size(r.optimizer)} | {format_size(r.activations_per_microbatch)} "
                f"| {format_size(r.activations_peak)} | {format_size(r.pipeline_buffers)} | {format_size(r.temporary)} "
                f"| **{format_size(r.total)}** | {r.recompute_layers} |"
            )
    has_baseline = any(s.setup.name == "baseline" for s in plan.setups)
    lines += [
        "",
        "| configuration | what it keeps | peak without recompute | verdict | peak as it runs "
        "| est. time / baseline without recompute | est. speedup over the baseline as it must run |",
        "|---|---|---|---|---|---|---|",
    ]
    for sp in plan.setups:
        speed = plan.speedup_estimate(sp.setup.name) if has_baseline else None
        lines.append(
            f"| {sp.setup.name} | {sp.setup.description} | {format_size(sp.peak_without_recompute)} | {verdict(sp)} "
            f"| {format_size(sp.peak)} | {'-' if sp.recompute_layers is None else f'{sp.relative_time:.3f}'} "
            f"| {'-' if speed is None else f'{speed:.2f}x'} |"
        )
    lines += _link_table(plan)
    if c.dp == 1 and any(sp.setup.zero1 for sp in plan.setups):
        lines += ["", ZERO1_DP1_NOTE]
    lines += [
        "",
        TIME_NOTE,
        "Temporary buffers are estimates of the largest transient working set (a layer's backward or the loss, the "
        "gradient path, pipeline send/receive); the other columns follow the trainer's measured accounting (docs/plan.md).",
    ]
    return "\n".join(lines)
