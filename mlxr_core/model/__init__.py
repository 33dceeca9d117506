"""Checkpoints, tokenizers, KV caches and the loading pipeline."""
