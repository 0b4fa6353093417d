"""agoq: train LLaMA-style models with 4-bit saved activations and 8-bit gradients."""

__version__ = "0.1.0"
