"""Hugging Face import and export for the Llama model (``LlamaForCausalLM`` layout).

Two differences besides names: Hugging Face rotates the two halves of each
head where we rotate interleaved pairs, so the rows of wq and wk are permuted
per head; and a tied output projection is not stored (it is the embedding).
Everything works one tensor at a time, so a sharded or pipelined model is
loaded and a large model exported without holding a full copy in memory.
Weights are read from safetensors only, never through pickle.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from composer.init import copy_full_into, full_tensor
from composer.converters.lora import is_adapter
from composer.models.llama import LlamaArgs, RopeScaling, Transformer

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


def _export_names(names: Iterable[str], args: LlamaArgs) -> dict[str, str]:
    """Hugging Face name -> our name, keeping the first of names that share a
    tensor (a tied output is the embedding, stored once)."""
    out: dict[str, str] = {}
    for ours in names:
        out.setdefault(hf_name(ours, args), ours)
    return out


def to_hf(state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Our full state dict in Hugging Face names and layout."""
    return {hf: convert_tensor_to_hf(ours, state[ours], args)
            for hf, ours in _export_names(state, args).items()}


def from_hf(state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict as ``Transformer.load_state_dict`` wants it
    (with tied embeddings, ``output.weight`` is the embedding again)."""
    out = {}
    for hf, tensor in state.items():
        ours = our_name(hf)
        out[ours] = convert_tensor_from_hf(ours, tensor, args)
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


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


def _rope_from_config(config: dict) -> tuple[float, RopeScaling | None]:
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
    theta, scaling = _rope_from_config(config)
    return LlamaArgs(
        dim=dim, n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads"), vocab_size=config["vocab_size"],
        multiple_of=width, ffn_dim_multiplier=width / int(8 * dim / 3),
        norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_seq_len=config.get("max_position_embeddings", 2048),
        tie_embeddings=config.get("tie_word_embeddings", False))


@contextmanager
def writing_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``folder`` to fill; on success it replaces
    ``folder`` by renames, so a crash leaves the old folder (or none), never a
    half-written one."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def _shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Names in order, cut into shards of at most ``max_shard_bytes`` (a larger
    tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _shard_file(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _write_hf(folder, shards: Iterable[dict[str, torch.Tensor]], count: int, config: dict,
              files: list | None, write: bool) -> None:
    """Consume ``shards`` (all ``count`` of them, also when not writing: producing
    them may be collective) and, if ``write``, save them as a Hugging Face folder."""
    if not write:
        for _ in shards:
            pass
        return
    weight_map, total = {}, 0
    with writing_folder(folder) as tmp:
        for index, shard in enumerate(shards):
            file = _shard_file(index, count)
            save_file({k: v.contiguous() for k, v in shard.items()}, tmp / file,
                      metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            total += sum(v.numel() * v.element_size() for v in shard.values())
        if count > 1:
            index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for extra in files or []:
            shutil.copy(extra, tmp / Path(extra).name)


def save_hf(folder, state_hf: dict[str, torch.Tensor], config: dict,
            max_shard_bytes: int = 5 * 2**30, files: list | None = None) -> None:
    """Write ``state_hf`` (Hugging Face names) and ``config`` as a Hugging Face
    model folder, replacing ``folder`` atomically; ``files`` (e.g. the tokenizer's)
    are copied in."""
    sizes = {k: v.numel() * v.element_size() for k, v in state_hf.items()}
    plan = _shard_plan(sizes, max_shard_bytes)
    shards = ({k: state_hf[k] for k in names} for names in plan)
    _write_hf(folder, shards, len(plan), config, files, write=True)


def hf_names(folder) -> list[str]:
    """Names of the tensors stored in a Hugging Face model folder."""
    return list(_weight_map(Path(folder)))


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single.name)


def open_hf(folder) -> tuple[dict, Callable[[str], torch.Tensor]]:
    """config.json of a Hugging Face folder and ``get(name)``, which reads that
    one tensor from its shard (memory-mapped; nothing else is loaded)."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {folder}")
    config = json.loads((folder / "config.json").read_text())
    weight_map = _weight_map(folder)

    def get(name: str) -> torch.Tensor:
        if name not in weight_map:
            raise ValueError(f"tensor {name!r} is missing from {folder}")
        with safe_open(folder / weight_map[name], framework="pt") as f:
            return f.get_tensor(name)

    return config, get


def load_hf_into(model: nn.Module, folder, args: LlamaArgs) -> None:
    """Fill every parameter ``model`` has (a whole model or a pipeline stage,
    plain or DTensor-sharded) from a Hugging Face folder; each rank keeps its slice."""
    _, get = open_hf(folder)
    for name, param in model.named_parameters():
        if is_adapter(name):  # LoRA adapters are not part of the base model
            continue
        hf = hf_name(name, args)
        tensor = get(hf)
        if tensor.shape != param.shape:
            raise ValueError(f"{name} (Hugging Face {hf}): model has shape {tuple(param.shape)}, "
                             f"file has {tuple(tensor.shape)}")
        copy_full_into(param, convert_tensor_from_hf(name, tensor, args))


def full_tensors(model: nn.Module) -> dict[str, Callable[[], torch.Tensor]]:
    """Each tensor of ``model``'s state dict, whole when called (a collective for a DTensor)."""
    return {name: partial(full_tensor, value) for name, value in model.state_dict().items()}


def export_hf(model: nn.Module, folder, args: LlamaArgs, dtype: torch.dtype, write: bool = True,
              max_shard_bytes: int = 5 * 2**30, files: list | None = None,
              tensors: dict[str, Callable[[], torch.Tensor]] | None = None) -> None:
    """Save ``model`` as a Hugging Face folder in ``dtype``; ``tensors`` (default
    ``full_tensors(model)``) says what each tensor is, e.g. with LoRA adapters
    folded in (``composer.converters.lora.merged_tensors``).

    Under FSDP/TP every rank must call this (gathering a DTensor is a collective
    over its mesh) and only the one with ``write`` saves. Tensors are gathered
    shard by shard, so memory holds one output shard at a time. Pipeline stages
    are not supported: each holds only part of the model.
    """
    tensors = full_tensors(model) if tensors is None else tensors
    names = _export_names(tensors, args)
    with torch.device("meta"):  # refused on every rank alike, before any collective
        reference = Transformer(args).state_dict()
    missing = set(_export_names(reference, args)) - set(names)
    if missing:
        raise ValueError(f"export needs the whole model; missing {sorted(missing)[:3]}")
    sizes = {hf: reference[ours].numel() * dtype.itemsize for hf, ours in names.items()}
    plan = _shard_plan(sizes, max_shard_bytes)

    def shard(hf_keys: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for hf in hf_keys:
            full = tensors[names[hf]]()
            if write:  # the others only take part in the gather
                out[hf] = convert_tensor_to_hf(names[hf], full.to("cpu", dtype), args)
        return out

    shards = (shard(hf_keys) for hf_keys in plan)
    _write_hf(folder, shards, len(plan), hf_config(args, dtype), files, write)
