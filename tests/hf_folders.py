"""Tiny random Hugging Face folders that transformers itself writes (no hub): the
architectures the HF-backed family is proven on. ``make(arch, folder)`` saves one
(config.json, model.safetensors) in float64 and returns it."""
from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def configs() -> dict:
    """Architecture -> its transformers config: Llama; Qwen2 (biases on q/k/v); Mistral
    (a sliding window shorter than the test sequences); Qwen3-MoE (per-head q/k norms,
    experts, a tied head)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3MoeConfig
    return {
        "llama": LlamaConfig(**COMMON, intermediate_size=128),
        "qwen2": Qwen2Config(**COMMON, intermediate_size=128),
        "mistral": MistralConfig(**COMMON, intermediate_size=128, sliding_window=16),
        "qwen3_moe": Qwen3MoeConfig(**{**COMMON, "tie_word_embeddings": True},
                                    intermediate_size=128, moe_intermediate_size=32,
                                    num_experts=4, num_experts_per_tok=2, head_dim=16,
                                    norm_topk_prob=True),
    }


ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3_moe")


def make(arch: str, folder: Path, seed: int = 0) -> Path:
    """A random model of ``arch``, saved by transformers into ``folder``."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs()[arch], dtype=torch.float64)
    with torch.no_grad():  # norms and biases away from their init, so that they count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder)
    return Path(folder)
