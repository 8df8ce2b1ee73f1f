"""Hugging Face's ``LlamaForCausalLM`` layout for our Llama.

Two differences besides names: Hugging Face rotates the two halves of each
head where we rotate interleaved pairs, so the rows of wq and wk are permuted
per head; and a tied output projection is not stored (it is the embedding).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch

from composer.models.common.rotary import RopeScaling
from composer.models.llama.model import LlamaArgs
from composer.spec import StateDictAdapter

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_BLOCK = {"attention.wq.weight": "self_attn.q_proj.weight",
          "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight",
          "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight",
          "feed_forward.w2.weight": "mlp.down_proj.weight",
          "feed_forward.w3.weight": "mlp.up_proj.weight",
          "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_TOP_BACK = {hf: ours for ours, hf in _TOP.items()}
_BLOCK_BACK = {hf: ours for ours, hf in _BLOCK.items()}
_OURS_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_name(ours: str, args: LlamaArgs) -> str:
    """Hugging Face name of our parameter ``ours``; a tied output reads the embedding."""
    if ours == "output.weight" and args.tie_embeddings:
        return _TOP["tok_embeddings.weight"]
    block = _OURS_BLOCK.fullmatch(ours)
    if block and block[2] in _BLOCK:
        return f"model.layers.{block[1]}.{_BLOCK[block[2]]}"
    if ours in _TOP:
        return _TOP[ours]
    raise ValueError(f"{ours!r} has no Hugging Face Llama name")


def our_name(hf: str) -> str:
    """Our name of the Hugging Face tensor ``hf`` (inverse of ``hf_name``)."""
    block = _HF_BLOCK.fullmatch(hf)
    if block and block[2] in _BLOCK_BACK:
        return f"layers.{block[1]}.{_BLOCK_BACK[block[2]]}"
    if hf in _TOP_BACK:
        return _TOP_BACK[hf]
    raise ValueError(f"{hf!r} is not a Hugging Face Llama tensor")


def _rotary_heads(ours: str, args: LlamaArgs) -> int | None:
    """Heads whose rows need reordering in our tensor ``ours`` (None: no reorder)."""
    if ours.endswith("attention.wq.weight"):
        return args.n_heads
    return args.n_kv_heads if ours.endswith("attention.wk.weight") else None


def stored_unchanged(ours: str, args: LlamaArgs) -> bool:
    """Whether our tensor ``ours`` is stored as we hold it (all but wq's and wk's rows)."""
    return _rotary_heads(ours, args) is None


def convert_tensor_to_hf(ours: str, tensor: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    """Our tensor ``ours`` in Hugging Face layout: each head's rows go from
    pairs (0,1),(2,3),... to halves (0,2,4,...,1,3,5,...)."""
    heads = _rotary_heads(ours, args)
    if heads is None:
        return tensor
    return tensor.unflatten(0, (heads, -1, 2)).transpose(1, 2).reshape(tensor.shape)


def convert_tensor_from_hf(ours: str, tensor: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    """The Hugging Face tensor for our ``ours`` in our layout (inverse of the above)."""
    heads = _rotary_heads(ours, args)
    if heads is None:
        return tensor
    return tensor.unflatten(0, (heads, 2, -1)).transpose(1, 2).reshape(tensor.shape)


def hf_config(args: LlamaArgs, dtype: torch.dtype) -> dict:
    """config.json for ``LlamaForCausalLM``. Rope and dtype are written both the
    transformers 5 way (``rope_parameters``, ``dtype``) and the older one
    (``rope_theta`` + ``rope_scaling``, ``torch_dtype``) so that older readers
    get the scaling too."""
    scaling = None if args.rope_scaling is None else {
        "rope_type": "llama3", **dataclasses.asdict(args.rope_scaling)}
    rope = {"rope_type": "default", "rope_theta": args.rope_theta, **(scaling or {})}
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim, "hidden_act": "silu", "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False, "mlp_bias": False,
        "rope_parameters": rope, "rope_theta": args.rope_theta, "rope_scaling": scaling,
        "dtype": dtype_name, "torch_dtype": dtype_name,
    }


def _check_supported(config: dict) -> None:
    """Refuse configs our model can't express rather than import them wrongly."""
    unsupported = {"model_type": "llama", "hidden_act": "silu",
                   "attention_bias": False, "mlp_bias": False}
    for key, ours in unsupported.items():
        if config.get(key, ours) != ours:
            raise ValueError(f"config {key}={config[key]!r} is not supported (only {ours!r})")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * config["num_attention_heads"] != config["hidden_size"]:
        raise ValueError(f"config head_dim={head_dim} must be hidden_size / num_attention_heads")


def rope_from_config(config: dict) -> tuple[float, RopeScaling | None]:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"config rope_type={kind!r} is not supported (only 'default', 'llama3')")
    return theta, RopeScaling(**{f.name: rope[f.name] for f in dataclasses.fields(RopeScaling)})


def args_from_hf_config(config: dict) -> LlamaArgs:
    """LlamaArgs of a ``LlamaForCausalLM`` config.json (inverse of ``hf_config``).

    The FFN width is given directly, so ``multiple_of`` is set to it and the
    multiplier chosen so that Meta's rounding lands on exactly one multiple."""
    _check_supported(config)
    dim, width = config["hidden_size"], config["intermediate_size"]
    theta, scaling = rope_from_config(config)
    return LlamaArgs(
        dim=dim, n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads"), vocab_size=config["vocab_size"],
        multiple_of=width, ffn_dim_multiplier=width / int(8 * dim / 3),
        norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_seq_len=config.get("max_position_embeddings", 2048),
        tie_embeddings=config.get("tie_word_embeddings", False))


class LlamaAdapter(StateDictAdapter):
    """Our Llama <-> ``LlamaForCausalLM`` safetensors, one tensor to one tensor."""

    model_type = "llama"

    @classmethod
    def args_from_config(cls, config: dict) -> LlamaArgs:
        return args_from_hf_config(config)

    def config(self, dtype: torch.dtype) -> dict:
        return hf_config(self.args, dtype)

    def hf_keys(self, ours: str) -> list[str]:
        return [hf_name(ours, self.args)]

    def to_hf(self, ours: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {hf_name(ours, self.args): convert_tensor_to_hf(ours, tensor, self.args)}

    def from_hf(self, ours: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        return convert_tensor_from_hf(ours, get(hf_name(ours, self.args)), self.args)

    def stored_as(self, ours: str) -> str | None:
        return hf_name(ours, self.args) if stored_unchanged(ours, self.args) else None
