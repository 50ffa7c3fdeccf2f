"""Quality evaluation: how far a memory format (FP8 KV, FP8/INT4 weights) moves a model from its baseline."""
