"""agoq: train LLaMA-style models with 4-bit saved activations and 8-bit gradients.

What a user needs is importable from here: patch a Hugging Face model (:func:`apply_agoq`,
:func:`remove_agoq`), train it (:class:`AgoqTrainer`, or any Trainer subclass such as TRL's SFTTrainer with
:class:`AgoqMixin`), reduce a wrapped model's gradients in 8 bits
(:func:`use_8bit_gradients`), the quantizer pair (:func:`quantize`, :func:`dequantize`), the
activation policy (:func:`make_policy`) and the training config (:class:`TrainConfig`,
:func:`load_config`). Everything else stays importable from its own module.
"""

__version__ = "0.1.0"


def _lazy_exports(package: str, homes: dict[str, str]):
    """A module ``__getattr__`` (PEP 562) that imports each name from its home module on first use.

    Packages whose modules import torch use it, so that ``agoq --help`` and ``agoq plan --help``
    (which read only presets and option lists) start without importing torch.
    """
    from importlib import import_module

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(homes[name]), name)
        setattr(import_module(package), name, value)
        return value

    return __getattr__


def _lazy_dir(namespace: dict[str, object], homes: dict[str, str]):
    """A module ``__dir__`` (PEP 562) that lists the lazily exported names before their first use."""

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __dir__


# Imported on first use: `import agoq` (and so `agoq --help`) does not import torch or transformers.
_HOMES = {
    "apply_agoq": "agoq.integrations.hf",
    "remove_agoq": "agoq.integrations.hf",
    "AgoqTrainer": "agoq.integrations.hf_trainer",
    "AgoqMixin": "agoq.integrations.hf_trainer",
    "use_8bit_gradients": "agoq.integrations.hf_trainer",
    "quantize": "agoq.quant",
    "dequantize": "agoq.quant",
    "make_policy": "agoq.activation.policy",
    "TrainConfig": "agoq.launch.config",
    "load_config": "agoq.launch.config",
}

__all__ = sorted(_HOMES)
__getattr__ = _lazy_exports(__name__, _HOMES)
__dir__ = _lazy_dir(globals(), _HOMES)
