"""The Hugging Face layout of a transformers model: its own names, under our ``lm.``
prefix, and its own config.json. Dense models store each tensor as transformers holds
it; the folder's config is read by transformers (``AutoConfig``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from composer.spec import StateDictAdapter

PREFIX = "lm."


class HFLayout(StateDictAdapter):
    """Our ``lm.<name>`` <-> transformers' ``<name>``; a tied output is not stored."""

    model_type = ""  # any: transformers reads the folder

    @classmethod
    def args_from_config(cls, config: dict):
        from transformers import AutoConfig
        config = dict(config)
        return AutoConfig.for_model(config.pop("model_type"), **config)

    @classmethod
    def args_from_folder(cls, folder: Path, trust_remote_code: bool = False):
        """transformers' config of the folder; code it ships runs only if trusted."""
        from transformers import AutoConfig
        written = json.loads((Path(folder) / "config.json").read_text())
        if written.get("auto_map") and not trust_remote_code:
            raise ValueError(f"its config.json names code of its own (auto_map: "
                             f"{', '.join(written['auto_map'])}), which runs only with "
                             f"model.hf_trust_remote_code = true")
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)

    def config(self, dtype: torch.dtype) -> dict:
        out = self.args.to_dict()
        out["dtype"] = out["torch_dtype"] = str(dtype).removeprefix("torch.")
        out.pop("_attn_implementation_autoset", None)
        out.pop("attn_implementation", None)
        return out

    def ties(self) -> dict[str, str]:
        """transformers' tied names of this model (a tied head -> the embedding it
        reads), when its config ties them."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
        if not getattr(self.args.get_text_config(), "tie_word_embeddings", False):
            return {}
        return dict(MODEL_FOR_CAUSAL_LM_MAPPING[type(self.args)]._tied_weights_keys or {})

    def hf_keys(self, ours: str) -> list[str]:
        if not ours.startswith(PREFIX):
            raise ValueError(f"{ours!r} is not a tensor of the transformers model")
        name = ours[len(PREFIX):]
        return [self.ties().get(name, name)]

    def to_hf(self, ours: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.hf_keys(ours)[0]: tensor}

    def from_hf(self, ours: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        return get(self.hf_keys(ours)[0])
