"""What the fine-tuning benchmarks share: the Hugging Face model a variant trains, one training step,
how a step's peak tensor bytes are measured, and running each measurement in its own process.

``benchmarks/lora.py``, ``benchmarks/finetune_scale.py`` and ``tests/test_plan_finetune.py`` (which
holds the fine-tuning planner to these measurements) all build, step and measure through here, so
a planned peak and a benchmark's measured one are the same quantity.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lora_finetune.py"
LORA = {"r": 8, "alpha": 16, "dropout": 0.05}  # on every projection (the example's TARGETS)


def example() -> Any:
    """``examples/lora_finetune.py`` as a module (its LoRA targets and token windows)."""
    spec = importlib.util.spec_from_file_location("lora_finetune_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan_build_options(variant: str) -> dict[str, Any]:
    """:func:`build_model`'s options for a planner variant (``agoq.plan.finetune.VARIANTS``), ``qlora`` or ``agoq_qlora``."""
    from agoq.plan.finetune import CHECKPOINT_FORMAT, CHECKPOINTED

    return {
        # agoq_ckpt8 checkpoints through agoq itself, not through transformers.
        "checkpointing": variant in CHECKPOINTED and variant != "agoq_ckpt8",
        "agoq": variant.startswith("agoq"),
        "checkpoint_format": CHECKPOINT_FORMAT if variant == "agoq_ckpt8" else None,
        "qlora": variant.endswith("qlora"),
    }


def build_model(
    config: dict[str, Any],
    *,
    seed: int,
    tmp: Path,
    lora: bool = True,
    qlora: bool = False,
    checkpointing: bool = False,
    offload: bool = False,
    agoq: bool = False,
    checkpoint_format: str | None = None,
    compile_layers: bool = False,
) -> Any:
    """A seeded ``LlamaForCausalLM`` from ``config`` (LlamaConfig's fields), in training mode, as one variant trains it.

    ``lora``: PEFT LoRA (:data:`LORA`) on every projection, else every weight trains; ``qlora``: the
    base saved to ``tmp`` and loaded back in bitsandbytes nf4 (fp32 compute) first; ``checkpointing``:
    transformers' activation checkpointing of every layer, non-reentrant (``offload``: its
    ``save_on_cpu`` option); ``agoq``: ``apply_agoq`` (``checkpoint_format``: compressed
    checkpoints); ``compile_layers``: each decoder layer ``torch.compile``'d.
    """
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    if qlora:
        base.save_pretrained(tmp / "base")
        q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
        base = transformers.LlamaForCausalLM.from_pretrained(tmp / "base", quantization_config=q, dtype=torch.float32)
        # Checkpointing is a variant of its own: PEFT's default would switch it on.
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    if checkpointing:
        base.activation_checkpointing_enable({"use_reentrant": False}, offload=offload)
    model = base
    if lora:
        torch.manual_seed(seed)
        targets = example().TARGETS
        model = get_peft_model(base, LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], target_modules=targets))
    if agoq:
        from agoq.integrations.hf import apply_agoq

        apply_agoq(model, checkpoint_format=checkpoint_format)
    if compile_layers:
        for layer in decoder_layers(model):
            layer.compile()
    return model.train()


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a causal LM, PEFT-wrapped or not."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(inner.model.layers)


def trainer_optimizer(model: Any, lr: float) -> Any:
    """AdamW over the trainable parameters as transformers' Trainer makes it by default
    (``adamw_torch_fused``): fused, so its step makes no temporaries."""
    import torch

    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, fused=True)


def train_step(model: Any, optimizer: Any, ids: Any, meter: Any = None) -> float:
    """One training step on ``ids`` (labels = inputs), as transformers' Trainer takes it; its loss.

    The loss, and with it the graph, is dropped before the optimizer steps (the Trainer keeps only
    ``loss.detach()``), so the step's peak is the one the planner describes.
    """
    import contextlib

    with meter or contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    value = float(loss.detach())
    del loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value


def live_bytes(*groups: Any) -> int:
    """Bytes of the distinct CPU storages behind the tensors given (parameters, buffers, optimizer state)."""
    import torch

    seen: dict[int, int] = {}
    for group in groups:
        for t in group:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def state_bytes(model: Any, optimizer: Any) -> int:
    """Bytes alive between steps: parameters, buffers and optimizer state."""
    return live_bytes(model.parameters(), model.buffers(), (t for st in optimizer.state.values() for t in st.values()))


def profiled_peak(step: Callable[[], Any]) -> int:
    """The largest rise of allocated CPU bytes over its start during ``step()`` (torch.profiler's ``profile_memory``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def step_peak(model: Any, optimizer: Any, ids: Any) -> tuple[int, float]:
    """(peak tensor bytes of one :func:`train_step` on ``ids``: what is alive at its start plus the
    profiler's largest rise, that step's loss). Take it after a first step made the optimizer's state."""
    at_start = state_bytes(model, optimizer)
    losses: list[float] = []
    rise = profiled_peak(lambda: losses.append(train_step(model, optimizer, ids)))
    return at_start + rise, losses[0]


def spawn(module: str, spec: dict[str, Any], tmp: Path, name: str) -> dict[str, Any]:
    """``module``'s ``run_one(spec)`` in a process of its own (so its peak RSS is its own); its result,
    or ``{"error": one line, "stderr": the tail}`` where the process failed or was killed."""
    import agoq

    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    code = f"from {module} import _child_main; _child_main({str(spec_path)!r}, {str(out_path)!r})"
    paths = [str(ROOT), str(Path(agoq.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode == 0:
        return json.loads(out_path.read_text())
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        why = " (out of memory: the kernel's OOM killer)" if sig == "SIGKILL" else ""
        error = f"killed by {sig}{why}"
    else:
        error = next((line for line in reversed(proc.stderr.splitlines()) if line.strip()), f"exit status {proc.returncode}")
    return {"error": error, "stderr": proc.stderr[-3000:]}


def child_main(run_one: Callable[[dict[str, Any]], dict[str, Any]], spec_path: str, out_path: str) -> None:
    """The child's side of :func:`spawn`: read the spec, run, write the result."""
    spec = json.loads(Path(spec_path).read_text())
    Path(out_path).write_text(json.dumps(run_one(spec)))
