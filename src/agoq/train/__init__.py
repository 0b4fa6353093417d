"""`agoq train`: the typed config, data and tokenizer, trainer, optimizer, checkpoints, metrics and launcher."""
