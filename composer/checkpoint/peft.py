"""LoRA adapters as a PEFT folder (``lora.export = "peft"``): what ``peft`` and vLLM load
beside the base model, ``adapter_config.json`` + ``adapter_model.safetensors``.

Each adapted linear's ``lora_a`` [rank, in] and ``lora_b`` [out, rank] are stored under
the Hugging Face name of its weight (the family's ``StateDictAdapter``), as
``base_model.model.<module>.lora_A.weight`` and ``...lora_B.weight``. Where the family's
adapter reorders a weight's rows on the way to Hugging Face (Llama's q/k for rotary),
``lora_b``'s rows, which are the weight's output features, are reordered alike; ``lora_a``
reads the input features, which no family reorders. The scale is PEFT's own,
``lora_alpha / r``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from composer.checkpoint.hf import writing_folder
from composer.parallel.materialize import copy_full_into, full_tensor
from composer.spec import StateDictAdapter

PREFIX = "base_model.model."


def hf_module(fqn: str, adapter: StateDictAdapter) -> str:
    """The Hugging Face name of our linear ``fqn`` (its weight's, less ``.weight``);
    ValueError where the family stores the weight as several tensors."""
    keys = adapter.hf_keys(f"{fqn}.weight")
    if len(keys) != 1 or not keys[0].endswith(".weight"):
        raise ValueError(f"{fqn}: its weight is stored as {keys}, which one PEFT adapter "
                         f"cannot name")
    return keys[0].removesuffix(".weight")


def adapter_tensors(parts: list[nn.Module], adapter: StateDictAdapter) -> dict[str, torch.Tensor]:
    """Every adapter of the model ``parts`` hold, whole (a collective where they are
    sharded: every rank calls it), in PEFT's names and Hugging Face's layout."""
    out = {}
    for part in parts:
        for fqn, module in part.named_modules():
            if not hasattr(module, "lora_a"):
                continue
            name = PREFIX + hf_module(fqn, adapter)
            a, b = full_tensor(module.lora_a.detach()), full_tensor(module.lora_b.detach())
            [b] = adapter.to_hf(f"{fqn}.weight", b).values()
            out[f"{name}.lora_A.weight"] = a.contiguous()
            out[f"{name}.lora_B.weight"] = b.contiguous()
    return out


def adapter_config(cfg: Any, targets: list[str], base: str) -> dict:
    """PEFT's ``adapter_config.json`` for the ``lora`` section ``cfg``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank,
            "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
            "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "use_rslora": False, "base_model_name_or_path": base}


def export_peft(parts: list[nn.Module], folder: Path, adapter: StateDictAdapter, cfg: Any,
                base: str, dtype: torch.dtype, write: bool, files: list | None = None) -> None:
    """Write the adapters as a PEFT folder (replacing ``folder`` atomically) where
    ``write``; every rank takes part in gathering them."""
    tensors = {k: v.to(dtype) for k, v in adapter_tensors(parts, adapter).items()}
    if not write:
        return
    from safetensors.torch import save_file
    targets = {key.split(".lora_")[0].rsplit(".", 1)[-1] for key in tensors}
    with writing_folder(folder) as tmp:
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(
            json.dumps(adapter_config(cfg, sorted(targets), base), indent=2))
        for extra in files or []:
            (tmp / Path(extra).name).write_bytes(Path(extra).read_bytes())


def check_peft(folder: str, cfg: Any) -> None:
    """ValueError (naming ``lora.initial_adapter``) unless ``folder`` is a PEFT LoRA folder
    whose rank and alpha are the ``lora`` section's."""
    key = f"lora.initial_adapter={folder!r}"
    path = Path(folder)
    if not (path / "adapter_config.json").is_file() or not (
            path / "adapter_model.safetensors").is_file():
        raise ValueError(f"{key}: no adapter_config.json and adapter_model.safetensors there; "
                         f"allowed: a PEFT LoRA folder")
    config = json.loads((path / "adapter_config.json").read_text())
    theirs = (config.get("peft_type"), config.get("r"), config.get("lora_alpha"))
    if theirs != ("LORA", cfg.rank, cfg.alpha):
        raise ValueError(f"{key}: its peft_type, r and lora_alpha are {theirs}; the run's are "
                         f"('LORA', {cfg.rank}, {cfg.alpha}) (lora.rank, lora.alpha)")


@torch.no_grad()
def load_peft(parts: list[nn.Module], folder: str, adapter: StateDictAdapter) -> int:
    """Every adapter of ``parts`` from the PEFT folder (each rank keeps its slice);
    returns how many linears it filled. ValueError naming a linear the folder lacks."""
    from safetensors.torch import load_file
    stored = load_file(Path(folder) / "adapter_model.safetensors")
    filled = 0
    for part in parts:
        for fqn, module in part.named_modules():
            if not hasattr(module, "lora_a"):
                continue
            name = PREFIX + hf_module(fqn, adapter)
            if f"{name}.lora_A.weight" not in stored:
                raise ValueError(f"lora.initial_adapter={folder!r} holds no adapter for "
                                 f"{name.removeprefix(PREFIX)}")
            b = adapter.from_hf(f"{fqn}.weight", lambda _: stored[f"{name}.lora_B.weight"])
            copy_full_into(module.lora_a, stored[f"{name}.lora_A.weight"])
            copy_full_into(module.lora_b, b)
            filled += 1
    return filled
