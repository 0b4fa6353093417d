"""Hugging Face interop without a download: LlamaForCausalLM state dicts and safetensors <-> ours."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from agoq.models.config import LlamaConfig

# ours -> Hugging Face, per decoder layer (the rotate-half RoPE convention is the same, so q/k
# weights need no permutation).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.o.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "head.weight": "lm_head.weight"}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def config_from_hf(hf_config: Any) -> LlamaConfig:
    """Our LlamaConfig from a transformers LlamaConfig (or its dict)."""
    c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    if head_dim * heads != c["hidden_size"]:
        raise ValueError(f"head_dim={head_dim} x heads={heads} != hidden_size={c['hidden_size']}: not supported")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    return LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads,
        intermediate=c["intermediate_size"],
        max_seq_len=c.get("max_position_embeddings", 4096),
        rope_theta=float(theta),
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def hf_config(cfg: LlamaConfig) -> Any:
    """A transformers LlamaConfig for our config (needs the `hf` extra)."""
    from transformers import LlamaConfig as HFLlamaConfig

    return HFLlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
    )


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our state dict (full model or a stage) with Hugging Face LlamaForCausalLM names."""
    out = {}
    for name, t in state.items():
        m = _OURS_LAYER.match(name)
        if m and m.group(2) in _LAYER_NAMES:
            out[f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"] = t
        elif name in _TOP_NAMES:
            if name == "head.weight" and cfg.tie_embeddings:
                continue  # tied: Hugging Face stores only the embedding
            out[_TOP_NAMES[name]] = t
        else:
            raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return out


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """A Hugging Face LlamaForCausalLM state dict with our names (rotary buffers dropped)."""
    layer_names = {v: k for k, v in _LAYER_NAMES.items()}
    top_names = {v: k for k, v in _TOP_NAMES.items()}
    out = {}
    for name, t in hf_state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        m = _HF_LAYER.match(name)
        if m and m.group(2) in layer_names:
            out[f"layers.{m.group(1)}.{layer_names[m.group(2)]}"] = t
        elif name in top_names:
            out[top_names[name]] = t
        else:
            raise KeyError(f"unexpected Hugging Face parameter {name!r}: not a LLaMA weight agoq knows")
    if "head.weight" not in out and "embed.weight" in out:
        out["head.weight"] = out["embed.weight"]
    missing = {f"layers.{i}.{k}" for i in range(cfg.n_layers) for k in _LAYER_NAMES} - set(out)
    if missing:
        raise KeyError(f"the Hugging Face state dict lacks {len(missing)} weight(s), e.g. {sorted(missing)[0]!r}")
    return out


def load_safetensors(path: str | Path, cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our state dict from a Hugging Face safetensors file (or a folder of shards)."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.exists() for f in files):
        raise FileNotFoundError(f"no safetensors file at {path}; pass a .safetensors file or a folder holding them")
    hf_state: dict[str, torch.Tensor] = {}
    for f in files:
        hf_state.update(load_file(str(f)))
    return from_hf_state_dict(hf_state, cfg)


def save_safetensors(state: dict[str, torch.Tensor], cfg: LlamaConfig, path: str | Path) -> None:
    """Write our state dict as a Hugging Face-named safetensors file."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in to_hf_state_dict(state, cfg).items()}, str(path))
