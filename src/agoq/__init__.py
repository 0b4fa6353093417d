"""agoq: train LLaMA-style models with 4-bit saved activations and 8-bit gradients."""

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
