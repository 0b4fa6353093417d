"""LLaMA models whose saved activations follow an activation policy, and Hugging Face interop.

Names are imported on first use (PEP 562), so reading a preset's numbers (agoq.models.config) does
not import torch: ``agoq --help`` and ``agoq plan --help`` stay fast.
"""

from agoq import _lazy_dir, _lazy_exports

# The model's parts (DecoderLayer, rope tables, IGNORE_INDEX) stay in agoq.models.llama.
_HOMES = {
    "PRESETS": "agoq.models.config",
    "LlamaConfig": "agoq.models.config",
    "get_config": "agoq.models.config",
    "Llama": "agoq.models.llama",
}

__all__ = sorted(_HOMES)
__getattr__ = _lazy_exports(__name__, _HOMES)
__dir__ = _lazy_dir(globals(), _HOMES)
