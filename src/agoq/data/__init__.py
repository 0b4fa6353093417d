"""Text to training batches: the corpus, the tokenizer, the packed token cache and the samplers."""
