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
    Qwen3-MoE (per-head q/k norms, stacked experts), also as ``qwen3_moe_whole`` with
    the plan that leaves its experts whole (``PLANS``); Phi-3 (fused qkv and gate_up
    linears, a padding row), also with a plan of its own (``PLANS``); Gemma2 (attention
    and final logits soft-capped, caps low and weights wide enough that both bite;
    scaled embeddings; a tied head; a sliding window on alternate layers); gpt-oss
    (attention sinks, a window on alternate layers, experts with biases; weights wide
    enough that the sinks bite)."""
    from transformers import (
        Gemma2Config,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )
    tied = {**COMMON, "tie_word_embeddings": True}
    moe = dict(**COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
               num_experts_per_tok=2, head_dim=16, norm_topk_prob=True)
    return {
        "llama": LlamaConfig(**COMMON, intermediate_size=128),
        "qwen2": Qwen2Config(**COMMON, intermediate_size=128),
        "mistral": MistralConfig(**COMMON, intermediate_size=128, sliding_window=16),
        "qwen3": Qwen3Config(**COMMON, intermediate_size=128, head_dim=16),
        "qwen3_moe": Qwen3MoeConfig(**moe),
        "qwen3_moe_whole": Qwen3MoeConfig(**moe),
        "phi3": Phi3Config(**COMMON, intermediate_size=128, pad_token_id=0, eos_token_id=2),
        "phi3_packed": Phi3Config(**COMMON, intermediate_size=128, pad_token_id=0, eos_token_id=2),
        "gemma2": Gemma2Config(**tied, intermediate_size=128, head_dim=16, sliding_window=16,
                               attn_logit_softcapping=2.0, final_logit_softcapping=2.0,
                               query_pre_attn_scalar=16, initializer_range=0.1),
        "gpt_oss": GptOssConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                                num_experts_per_tok=2, head_dim=16, sliding_window=16,
                                initializer_range=0.2,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                                 "factor": 8.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 32}),
    }


# Tensor-parallel plans a folder's config.json gives in place of its class's (transformers
# reads them): Phi-3's fused [gate; up] cut per part, its output no longer gathered; the
# two Qwen3-MoE plans transformers has shipped, held here so that the tests do not move
# with the installed release: up to 5.24 the stacked experts cut by their hidden features,
# from 5.25 the experts left whole (its dense-MLP entries name no module of this model).
QWEN3_MOE_NON_EXPERT = {**{f"layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
                       "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                       "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
                       "layers.*.self_attn.o_proj": "rowwise",
                       "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
                       "layers.*.mlp.down_proj": "rowwise"}
PLANS = {"phi3_packed": {"layers.*.self_attn.qkv_proj": "colwise_gather_output",
                         "layers.*.self_attn.o_proj": "rowwise_split_input",
                         "layers.*.mlp.gate_up_proj": "packed_colwise",
                         "layers.*.mlp.down_proj": "rowwise"},
         "qwen3_moe": {**QWEN3_MOE_NON_EXPERT,
                       "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                       "layers.*.mlp.experts.down_proj": "rowwise",
                       "layers.*.mlp.experts": "moe_tp_experts"},
         "qwen3_moe_whole": QWEN3_MOE_NON_EXPERT}
# what a folder's config.json adds for transformers: its own tensor-parallel plan; and
# torch's grouped matmul of experts takes no float64, so gpt-oss runs its experts one
# matmul each
RUN_AS = {**{arch: {"base_model_tp_plan": plan} for arch, plan in PLANS.items()},
          "gpt_oss": {"experts_implementation": "eager"}}


def make(arch: str, folder: Path, seed: int = 0) -> Path:
    """A random model of ``arch``, saved by transformers into ``folder``."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs()[arch], dtype=torch.float64)
    with torch.no_grad():  # norms and biases away from their init, so that they count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder)
    if arch in RUN_AS:
        config = Path(folder) / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), **RUN_AS[arch]}))
    return Path(folder)
