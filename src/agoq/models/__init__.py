"""LLaMA models whose saved activations follow an activation policy, and Hugging Face interop.

Names are imported on first use (PEP 562), so reading a preset's numbers (agoq.models.config) does
not import torch: ``agoq --help`` and ``agoq plan --help`` stay fast.
"""

from importlib import import_module
from typing import Any

_HOMES = {
    "PRESETS": "agoq.models.config",
    "LlamaConfig": "agoq.models.config",
    "get_config": "agoq.models.config",
    "IGNORE_INDEX": "agoq.models.llama",
    "DecoderLayer": "agoq.models.llama",
    "Llama": "agoq.models.llama",
    "apply_rope": "agoq.models.llama",
    "rope_tables": "agoq.models.llama",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'agoq.models' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
