"""Hugging Face's ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM`` layouts.

Llama's names and conversions (``composer.models.llama.hf``) plus Qwen3's:
``q_norm`` and ``k_norm``, whose features are permuted like each head's rows
of wq and wk (Hugging Face rotates halves of a head, we rotate interleaved
pairs); and for the MoE, the router's gate and one tensor per expert and
projection (``mlp.experts.E.gate_proj.weight``..., the published layout, which
transformers' ``save_pretrained`` writes too) for our stacked w1/w3/w2.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import torch

from composer.models.llama.hf import (
    convert_tensor_from_hf,
    convert_tensor_to_hf,
    hf_config,
    hf_name,
    rope_from_config,
    stored_unchanged,
)
from composer.models.qwen3.model import Qwen3Args, Qwen3MoeArgs
from composer.spec import StateDictAdapter

_QK_NORM = re.compile(r"layers\.(\d+)\.attention\.(q_norm|k_norm)\.weight")
_ROUTER = re.compile(r"layers\.(\d+)\.moe\.router\.(gate\.weight|expert_bias)")
_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3)")
_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def to_halves(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's features (rows) from pairs (0,1),(2,3),... to halves (0,2,...,1,3,...)."""
    return t.unflatten(0, (heads, -1, 2)).transpose(1, 2).reshape(t.shape)


def to_pairs(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of ``to_halves``."""
    return t.unflatten(0, (heads, 2, -1)).transpose(1, 2).reshape(t.shape)


# ---------------------------------------------------------------- config.json

def _problems(config: dict, model_type: str) -> list[str]:
    """What ``config`` sets that our model cannot express, one phrase each."""
    wanted = {"model_type": model_type, "hidden_act": "silu", "attention_bias": False,
              "use_sliding_window": False}
    found = [f"{key}={config[key]!r} (only {ours!r})" for key, ours in wanted.items()
             if config.get(key, ours) != ours]
    sliding = sorted(set(config.get("layer_types") or []) - {"full_attention"})
    found += [f"layer_types with {kind!r} (only 'full_attention')" for kind in sliding]
    try:
        rope_from_config(config)
    except ValueError as e:
        found.append(str(e).removeprefix("config "))
    return found


def _refuse(found: list[str], model_type: str) -> None:
    if found:
        raise ValueError(f"config.json sets what our {model_type} cannot express: "
                         + "; ".join(found))


def _common_args(config: dict) -> dict[str, Any]:
    """The Llama arguments of a Qwen3 config.json (Qwen3's defaults where absent)."""
    theta, scaling = rope_from_config(config)
    return dict(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"], n_kv_heads=config.get("num_key_value_heads"),
        vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=scaling,
        max_seq_len=config.get("max_position_embeddings", 40960),
        tie_embeddings=config.get("tie_word_embeddings", False))


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def qwen3_config(args: Qwen3Args | Qwen3MoeArgs, dtype: torch.dtype, architecture: str,
                 model_type: str) -> dict:
    """Llama's config.json (both rope spellings, both dtype spellings) with
    Qwen3's keys; Qwen3 has no ``mlp_bias``."""
    config = {**hf_config(args, dtype), "architectures": [architecture],
              "model_type": model_type, "attention_dropout": 0.0,
              "use_sliding_window": False, "sliding_window": None,
              "max_window_layers": args.n_layers}
    del config["mlp_bias"]
    return config


def dense_args_from_config(config: dict) -> Qwen3Args:
    _refuse(_problems(config, "qwen3"), "qwen3")
    return Qwen3Args(**_common_args(config), head_dim=_head_dim(config),
                     ffn_hidden_dim=config["intermediate_size"])


def _moe_problems(config: dict) -> list[str]:
    found = _problems(config, "qwen3_moe")
    if config.get("mlp_only_layers"):
        found.append(f"mlp_only_layers={config['mlp_only_layers']!r} (only [])")
    if config.get("decoder_sparse_step", 1) != 1:
        found.append(f"decoder_sparse_step={config['decoder_sparse_step']!r} (only 1)")
    return found


def moe_args_from_config(config: dict) -> Qwen3MoeArgs:
    _refuse(_moe_problems(config), "qwen3_moe")
    # transformers writes num_experts as num_local_experts; the published files as num_experts
    n_experts = config.get("num_experts", config.get("num_local_experts"))
    return Qwen3MoeArgs(
        **_common_args(config), attn_head_dim=_head_dim(config),
        dense_hidden_dim=config.get("intermediate_size"), n_experts=n_experts,
        top_k=config["num_experts_per_tok"], moe_hidden_dim=config["moe_intermediate_size"],
        route_norm=config.get("norm_topk_prob", False),
        aux_loss_coef=config.get("router_aux_loss_coef", 1e-3))


def _check_exportable(args: Qwen3MoeArgs) -> None:
    """Refuse MoE features Qwen3-MoE lacks rather than export a different model
    (a trained expert bias would change which experts tokens go to)."""
    wanted = {"n_dense_layers": 0, "n_shared_experts": 0, "score_func": "softmax",
              "route_scale": 1.0, "bias_update_speed": 0.0}
    found = [f"{key}={getattr(args, key)!r} (only {ours!r})" for key, ours in wanted.items()
             if getattr(args, key) != ours]
    if found:
        raise ValueError("Qwen3-MoE's layout cannot express " + "; ".join(found))


def moe_config(args: Qwen3MoeArgs, dtype: torch.dtype) -> dict:
    _check_exportable(args)
    return {**qwen3_config(args, dtype, "Qwen3MoeForCausalLM", "qwen3_moe"),
            "moe_intermediate_size": args.moe_hidden_dim, "num_experts": args.n_experts,
            "num_experts_per_tok": args.top_k, "norm_topk_prob": args.route_norm,
            "decoder_sparse_step": 1, "mlp_only_layers": [],
            "router_aux_loss_coef": args.aux_loss_coef, "output_router_logits": False}


# ---------------------------------------------------------------- adapters

class Qwen3Adapter(StateDictAdapter):
    """Our Qwen3 <-> ``Qwen3ForCausalLM`` safetensors, one tensor to one tensor:
    Llama's names and q/k row order, and the q/k norms."""

    model_type = "qwen3"

    @classmethod
    def args_from_config(cls, config: dict) -> Qwen3Args:
        return dense_args_from_config(config)

    def config(self, dtype: torch.dtype) -> dict:
        return qwen3_config(self.args, dtype, "Qwen3ForCausalLM", "qwen3")

    def hf_keys(self, ours: str) -> list[str]:
        norm = _QK_NORM.fullmatch(ours)
        if norm:
            return [f"model.layers.{norm[1]}.self_attn.{norm[2]}.weight"]
        try:
            return [hf_name(ours, self.args)]
        except ValueError:
            raise ValueError(f"{ours!r} has no Hugging Face {self.model_type} name") from None

    def to_hf(self, ours: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        [key] = self.hf_keys(ours)
        if _QK_NORM.fullmatch(ours):  # one head's features, ordered like wq's rows
            return {key: to_halves(tensor, 1)}
        return {key: convert_tensor_to_hf(ours, tensor, self.args)}

    def from_hf(self, ours: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        [key] = self.hf_keys(ours)
        if _QK_NORM.fullmatch(ours):
            return to_pairs(get(key), 1)
        return convert_tensor_from_hf(ours, get(key), self.args)

    def stored_as(self, ours: str) -> str | None:
        [key] = self.hf_keys(ours)
        unchanged = stored_unchanged(ours, self.args) and not _QK_NORM.fullmatch(ours)
        return key if unchanged else None


class Qwen3MoeAdapter(Qwen3Adapter):
    """Our Qwen3-MoE <-> ``Qwen3MoeForCausalLM`` safetensors: as dense Qwen3
    for attention, embeddings and norms; each stacked expert weight [E, ...] is
    E tensors, and the router's balancing bias is not stored (Qwen3-MoE has
    none: it reads back as zeros)."""

    model_type = "qwen3_moe"

    @classmethod
    def args_from_config(cls, config: dict) -> Qwen3MoeArgs:
        return moe_args_from_config(config)

    def config(self, dtype: torch.dtype) -> dict:
        return moe_config(self.args, dtype)

    def hf_keys(self, ours: str) -> list[str]:
        router, experts = _ROUTER.fullmatch(ours), _EXPERTS.fullmatch(ours)
        if router:  # the gate; the balancing bias is not stored
            gate = router[2] == "gate.weight"
            return [f"model.layers.{router[1]}.mlp.gate.weight"] if gate else []
        if experts:
            proj = _PROJ[experts[2]]
            return [f"model.layers.{experts[1]}.mlp.experts.{e}.{proj}.weight"
                    for e in range(self.args.n_experts)]
        return super().hf_keys(ours)

    def to_hf(self, ours: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if _EXPERTS.fullmatch(ours):
            # clones: safetensors refuses tensors that share storage
            return {key: w.clone() for key, w in zip(self.hf_keys(ours), tensor.unbind(0))}
        if _ROUTER.fullmatch(ours):
            return {key: tensor for key in self.hf_keys(ours)}  # the gate, or nothing
        return super().to_hf(ours, tensor)

    def from_hf(self, ours: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        if _EXPERTS.fullmatch(ours):
            return torch.stack([get(key) for key in self.hf_keys(ours)])
        router = _ROUTER.fullmatch(ours)
        if router and router[2] == "expert_bias":
            return torch.zeros(self.args.n_experts, dtype=torch.float32)
        if router:
            return get(self.hf_keys(ours)[0])
        return super().from_hf(ours, get)

    def stored_as(self, ours: str) -> str | None:
        if _EXPERTS.fullmatch(ours):
            return None  # stacked from one tensor per expert
        if _ROUTER.fullmatch(ours):  # the gate; the balancing bias is not stored
            return next(iter(self.hf_keys(ours)), None)
        return super().stored_as(ours)
