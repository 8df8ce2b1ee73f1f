"""The Hugging Face layout of a transformers model, as transformers itself loads and
saves it: its own names, under our ``lm.`` prefix, and its own conversion mapping
between what a folder stores and what the model holds (an MoE's experts, for one, are
one packed ``experts.gate_up_proj`` in memory and one tensor per expert on disk).
transformers' functions do the renaming and the conversion both ways, one of our
tensors at a time; the folder's config is read by transformers (``AutoConfig``)."""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from composer.spec import StateDictAdapter

PREFIX = "lm."


def causal_lm(config, **kwargs) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config, **kwargs)``; for a config its auto class
    does not map (a multimodal model's text config: Emu3's, Mllama's), the causal-LM class
    the folder names (``architectures``)."""
    import transformers
    try:
        return transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    except ValueError as e:
        named = [getattr(transformers, name, None) for name in config.architectures or []]
        named = [cls for cls in named if cls is not None and cls.__name__.endswith("ForCausalLM")]
        if not str(e).startswith("Unrecognized configuration class") or not named:
            raise
        kwargs.pop("trust_remote_code", None)
        return named[0]._from_config(config, **kwargs)


class HFLayout(StateDictAdapter):
    """Our ``lm.<name>`` <-> what transformers stores for ``<name>``; a tied output
    is the embedding, stored once."""

    model_type = ""  # any: transformers reads the folder

    @classmethod
    def args_from_config(cls, config: dict):
        from transformers import AutoConfig
        config = dict(config)
        return AutoConfig.for_model(config.pop("model_type"), **config)

    @classmethod
    def args_from_folder(cls, folder: Path, trust_remote_code: bool = False):
        """transformers' config of the folder; code it ships runs only if trusted."""
        try:
            from transformers import AutoConfig
        except ImportError:
            raise ValueError("the model is transformers' own, and transformers is not "
                             "installed: pip install 'composer-parallel[hf]'") from None
        written = json.loads((Path(folder) / "config.json").read_text())
        if written.get("auto_map") and not trust_remote_code:
            raise ValueError(f"its config.json names code of its own (auto_map: "
                             f"{', '.join(written['auto_map'])}), which runs only with "
                             f"model.hf_trust_remote_code = true")
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)

    def config(self, dtype: torch.dtype) -> dict:
        out = self.args.to_dict()
        out["dtype"] = out["torch_dtype"] = str(dtype).removeprefix("torch.")
        out.pop("attn_implementation", None)
        return out

    @functools.cached_property
    def _meta(self) -> nn.Module:
        """transformers' model on the meta device: what its conversion mapping reads."""
        with torch.device("meta"):
            return causal_lm(self.args,
                             trust_remote_code=bool(getattr(self.args, "auto_map", None)))

    @functools.cached_property
    def _ties(self) -> dict[str, str]:
        """A tied name -> the name transformers stores it under, as transformers ties
        them (a multimodal model by its own config, not its text config's)."""
        return self._meta.get_expanded_tied_weights_keys(all_submodels=True)

    def _name(self, ours: str) -> str:
        if not ours.startswith(PREFIX):
            raise ValueError(f"{ours!r} is not a tensor of the transformers model")
        name = ours[len(PREFIX):]
        return self._ties.get(name, name)

    def to_hf(self, ours: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion
        return revert_weight_conversion(self._meta, {self._name(ours): tensor})

    def hf_keys(self, ours: str) -> list[str]:
        name = self._name(ours)
        return list(self.to_hf(ours, self._meta.state_dict()[name]))

    def from_hf(self, ours: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        name, keys = self._name(ours), self.hf_keys(ours)
        if keys == [name]:
            return get(name)
        return _converted(self._meta, name, {key: get(key) for key in keys})

    def stored_as(self, ours: str) -> str | None:
        """transformers' name for ``ours`` where its mapping stores the tensor as it
        is; None where it converts it (e.g. an MoE's experts, one tensor each)."""
        name = self._name(ours)
        return name if self.hf_keys(ours) == [name] else None


def _converted(meta: nn.Module, name: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensor ``name`` the model holds, made from the ``stored`` ones by the
    converter of transformers' mapping that names it (as ``from_pretrained`` does)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )
    transforms = get_model_conversion_mapping(meta, add_legacy=False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    converter = None
    for key in sorted(stored, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters)
        matching = [c for c in converters if pattern in c.source_patterns]
        if not matching and len(stored) == 1:  # renamed only (a multimodal model's text part)
            return stored[key]
        if converter is None:
            converter = copy.deepcopy(matching[0])
        converter.add_tensor(renamed, key, pattern, stored[key])
    # named by its first target, whose name transformers' ops turn into the others' (a
    # split's sizes: in_proj_qkv, in_proj_z, ... of one stored in_proj)
    first = converter.target_patterns[0]
    ours = next((t for t in converter.target_patterns if t in name), first)
    out = converter.convert(name.replace(ours, first), model=meta, config=meta.config)
    return out[name]
