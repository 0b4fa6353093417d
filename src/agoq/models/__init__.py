"""LLaMA models whose saved activations follow an activation policy, and Hugging Face interop."""

from agoq.models.config import PRESETS, LlamaConfig, get_config
from agoq.models.llama import IGNORE_INDEX, DecoderLayer, Llama, apply_rope, rope_tables

__all__ = ["IGNORE_INDEX", "PRESETS", "DecoderLayer", "Llama", "LlamaConfig", "apply_rope", "get_config", "rope_tables"]
