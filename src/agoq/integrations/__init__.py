"""Where users already train: AGoQ inside other libraries' models and loops (Hugging Face transformers)."""
