"""Tiny random Hugging Face folders that transformers itself writes (no hub): the
architectures the HF-backed family is proven on. ``make(arch, folder)`` saves one
(config.json, model.safetensors) in float64 and returns it."""
from __future__ import annotations

import json
from pathlib import Path

import torch

COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def configs() -> dict:
    """Architecture -> its transformers config: Llama; Qwen2 (biases on q/k/v); Mistral
    (a sliding window shorter than the test sequences); Qwen3 (per-head q/k norms);
    Qwen3-MoE (per-head q/k norms, experts, a tied head); Phi-3 (fused qkv and gate_up
    linears, a padding row), also with a plan of its own (``PLANS``)."""
    from transformers import (
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )
    return {
        "llama": LlamaConfig(**COMMON, intermediate_size=128),
        "qwen2": Qwen2Config(**COMMON, intermediate_size=128),
        "mistral": MistralConfig(**COMMON, intermediate_size=128, sliding_window=16),
        "qwen3": Qwen3Config(**COMMON, intermediate_size=128, head_dim=16),
        "qwen3_moe": Qwen3MoeConfig(**{**COMMON, "tie_word_embeddings": True},
                                    intermediate_size=128, moe_intermediate_size=32,
                                    num_experts=4, num_experts_per_tok=2, head_dim=16,
                                    norm_topk_prob=True),
        "phi3": Phi3Config(**COMMON, intermediate_size=128, pad_token_id=0, eos_token_id=2),
        "phi3_packed": Phi3Config(**COMMON, intermediate_size=128, pad_token_id=0, eos_token_id=2),
    }


# Tensor-parallel plans a folder's config.json gives in place of its class's (transformers
# reads them): Phi-3's fused [gate; up] cut per part, its output no longer gathered.
PLANS = {"phi3_packed": {"layers.*.self_attn.qkv_proj": "colwise_gather_output",
                         "layers.*.self_attn.o_proj": "rowwise_split_input",
                         "layers.*.mlp.gate_up_proj": "packed_colwise",
                         "layers.*.mlp.down_proj": "rowwise"}}
ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "phi3", "phi3_packed")


def make(arch: str, folder: Path, seed: int = 0) -> Path:
    """A random model of ``arch``, saved by transformers into ``folder``."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs()[arch], dtype=torch.float64)
    with torch.no_grad():  # norms and biases away from their init, so that they count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder)
    if arch in PLANS:
        config = Path(folder) / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()),
                                      "base_model_tp_plan": PLANS[arch]}))
    return Path(folder)
