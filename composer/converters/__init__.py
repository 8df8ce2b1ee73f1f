"""Converters: features that change the model before the passes (float8, LoRA)."""
