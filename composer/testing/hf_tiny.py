"""Tiny random models of every causal-LM architecture transformers lists, built on CPU
from each config class (no hub): a generic shrinker over a config's size fields
(``tiny_config``), a few per-architecture overrides where a config needs them
(``OVERRIDES``, each counted by the sweep), and the folder ``save_pretrained`` writes
(``write_folder``). ``benchmarks/hf_sweep.py`` and the suite's HF sweep build their
models here."""
from __future__ import annotations

import inspect
from pathlib import Path

import torch

LAYERS = 2
# a config's size fields (by the names transformers' configs give them) -> the tiny size
SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "model_dim",
                     "dim", "adapter_in_dim", "adapter_input_size", "hidden_size_global"), 64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size",
                     "ff_dim", "dense_intermediate_size", "mlp_dim"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size",
                     "expert_intermediate_size", "moe_ffn_hidden_size"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers",
                     "num_decoder_layers", "encoder_layers", "decoder_layers"), LAYERS),
    **dict.fromkeys(("encoder_ffn_dim", "decoder_ffn_dim"), 128),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads",
                     "encoder_attention_heads", "decoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads",
                     "multi_query_group_num", "n_head_kv"), 2),
    **dict.fromkeys(("head_dim", "attention_head_dim", "v_head_dim"), 16),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                     "seq_length", "max_sequence_length"), 256),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts",
                     "moe_num_experts"), 4),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 32),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim"), 8),
    "qk_head_dim": 16,
    **dict.fromkeys(("index_n_heads", "linear_num_heads"), 4),
    **dict.fromkeys(("index_head_dim", "linear_head_dim"), 16),
    "index_topk": 16,
    **dict.fromkeys(("vocab_size", "unpadded_vocab_size", "encoder_hash_byte_group_vocab"), 320),
    "sliding_window": 16,
}
# fields that are at most this (a top-k among 4 experts, shared experts, router groups)
AT_MOST = {"num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2,
           "num_selected_experts": 2, "top_k": 2, "moe_k": 2, "n_shared_experts": 1,
           "num_shared_experts": 1,
           "moe_num_shared_experts": 1, "n_group": 1, "topk_group": 1, "n_groups": 1,
           # the first layers dense: one, so that the second is an MoE's
           "first_k_dense_replace": 1, "num_dense_layers": 1, "moe_layer_start_index": 1}
# fields a config class may leave None that its model then needs
NEEDED = ("head_dim", "num_key_value_heads")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id",
             "decoder_start_token_id")
# per-architecture settings the generic shrinker cannot infer (each counted in the output)
OVERRIDES: dict[str, dict] = {
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "deepseek_v2": {"num_experts_per_tok": 2, "n_group": 1, "topk_group": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "kimi_linear": {"layer_types": ["linear_attention", "full_attention"]},
    "zamba2": {"mamba_headdim": 16, "attention_hidden_size": 128, "attention_head_dim": 32,
               "kv_channels": 16, "hybrid_layer_ids": [1],
               "layers_block_type": ["linear_attention", "hybrid"]},
    "xlstm": {"embedding_dim": 64, "num_blocks": LAYERS},
    "gemma3n_text": {"layer_types": ["sliding_attention", "full_attention"],
                     "num_kv_shared_layers": 0, "vocab_size_per_layer_input": 320,
                     "hidden_size_per_layer_input": 16},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1},
    "reformer": {"is_decoder": True, "axial_pos_embds": False},
    "mamba2": {"head_dim": 32},
    "olmo_hybrid": {"layer_types": ["linear_attention", "full_attention"],
                    "linear_key_head_dim": 16, "linear_value_head_dim": 16},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"], "mamba_n_heads": 8,
                         "mamba_d_head": 16},
    # its attention reads both; the defaults give neither
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                   "rope_theta": 10000.0}}},
    "xmod": {"default_language": "en_XX"},  # its forward needs one
    "kolibri1_1": {"index_num_heads": 2, "index_layers": [1], "mlp_only_layers": [0],
                   "layer_types": ["sliding_attention", "indexed_attention"]},
}


# a float field naming one of these draws random numbers in training (dropout, a router's
# jitter noise): zero
RANDOM = ("dropout", "pdrop", "jitter")


def _shrunk(values: dict) -> dict:
    """A config's fields with every size field tiny, every list that had one entry per
    layer cut to the tiny layer count, every token id inside the tiny vocabulary, and
    every sub-config's the same."""
    layers = next((values[k] for k in SIZES
                   if SIZES[k] == LAYERS and isinstance(values.get(k), int)), None)
    out = {}
    for key, value in values.items():
        if key == "per_layer_config" and isinstance(value, dict):  # layer index -> fields
            out[key] = {k: v for k, v in value.items() if int(k) < LAYERS}
        elif isinstance(value, dict):
            out[key] = _shrunk(value)
        elif isinstance(value, float) and any(w in str(key) for w in RANDOM):
            out[key] = 0.0  # runs on different layouts draw different masks and noise
        elif key == "is_decoder":
            out[key] = True  # a causal LM of an encoder's family is its decoder
        elif value is None and key in NEEDED:
            out[key] = SIZES[key]
        elif key in SIZES and isinstance(value, list) and all(type(v) is int for v in value):
            out[key] = [SIZES[key]] * min(len(value), LAYERS)  # one a layer
        elif key in SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = SIZES[key] if key != "num_key_value_heads" or value > 1 else 1
        elif key in AT_MOST and isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(value, AT_MOST[key])
        elif key in TOKEN_IDS:
            out[key] = _token(value)
        elif isinstance(value, list) and layers and len(value) == layers and layers > LAYERS:
            out[key] = value[:LAYERS]
        else:
            out[key] = value
    if "qk_rope_head_dim" in out:  # latent attention: its rotary part is the head_dim, a
        out["head_dim"] = SIZES["qk_rope_head_dim"]  # kv head per query head
        out["num_key_value_heads"] = SIZES["num_attention_heads"]
    return out


def _merged(values: dict, overrides: dict) -> dict:
    """``values`` with ``overrides``, a sub-config's merged into its own."""
    out = dict(values)
    for key, value in overrides.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def _token(value):
    if isinstance(value, list):
        return [_token(v) for v in value]
    return value if value is None or value < SIZES["vocab_size"] else 1


def tiny_config(model_type: str):
    """(the tiny config of ``model_type``, the overrides it needed: a dict, empty for
    most); transformers' error where its config class refuses even that."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    defaults = CONFIG_MAPPING[model_type]().to_dict()
    values = _merged(_shrunk(defaults), OVERRIDES.get(model_type, {}))
    values["tie_word_embeddings"] = False  # a tied head cannot be cut between stages
    # only what differs from the class's defaults: not every config reads back its to_dict
    changed = {k: v for k, v in values.items() if k not in defaults or defaults[k] != v}
    return AutoConfig.for_model(model_type, **changed), OVERRIDES.get(model_type, {})


def causal_lm_types() -> list[str]:
    """Every model type transformers' own auto mapping lists for causal LMs."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def write_folder(model_type: str, folder: Path, seed: int = 0) -> Path:
    """A random tiny ``model_type`` saved with ``save_pretrained`` in float64."""
    from transformers import AutoModelForCausalLM
    config, _ = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    model.save_pretrained(folder)
    return folder


def classify(model: torch.nn.Module) -> dict[str, str]:
    """The forms of a built transformers model, from its modules and config: its
    attention, norm, MLP, MoE and positional encoding (what the representative subset
    covers, one architecture per form)."""
    from torch import nn
    config = model.config.get_text_config()
    modules = list(model.named_modules())
    names = {name.rpartition(".")[2] for name, _ in modules}
    classes = [type(m).__name__ for _, m in modules]
    return {"attention": _attention(model, config, classes, names),
            "norm": "+".join(sorted({"rms" if "RMS" in c else "layer" if "LayerNorm" in c
                                     else "other" for c in classes if "Norm" in c})) or "none",
            "mlp": ("fused-gated" if "gate_up_proj" in names else
                    "gated" if names & {"gate_proj", "w3", "gate"} else "plain"),
            "moe": ("moe-stacked" if any(hasattr(m, "num_experts") and hasattr(m, "has_gate")
                                         for _, m in modules)
                    else "moe-list" if "experts" in names else "dense")
                   + ("+shared" if names & {"shared_expert", "shared_experts"} else ""),
            "position": ("rotary" if any("Rotary" in c for c in classes) else
                         "alibi" if "alibi" in inspect.getsource(type(model.base_model)) else
                         "learned" if any(isinstance(m, nn.Embedding)
                                          and m is not model.get_input_embeddings()
                                          for _, m in modules) else "none")}


def _attention(model, config, classes: list[str], names: set[str]) -> str:
    attention = [c for c in classes if c.endswith(("Attention", "MLA"))]
    if not attention:
        return "none"
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    form = ("latent" if getattr(config, "kv_lora_rank", None) else
            "mqa" if kv == 1 else "gqa" if heads and kv < heads else "mha")
    extras = [name for name, on in (
        ("window", getattr(config, "sliding_window", None)),
        ("sinks", "sinks" in names),
        ("softcap", getattr(config, "attn_logit_softcapping", None)),
        ("qk-norm", names & {"q_norm", "k_norm", "q_layernorm", "k_layernorm"}),
        ("fused-qkv", names & {"qkv_proj", "c_attn", "query_key_value", "Wqkv", "W_pack"}),
        ("hybrid", any(isinstance(m, torch.nn.Conv1d) for m in model.modules()))) if on]
    return "+".join([form, *extras])
