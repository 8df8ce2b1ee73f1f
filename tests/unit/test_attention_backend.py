"""model.attention: which backend ``auto`` picks, what ``flex`` sets on a model's mask
module and cores, and the one line for a model whose attention takes no block mask.
In process, on the meta device."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from composer.models import get_model_spec
from composer.parallel.attention import apply_attention, choose_attention


def llama():
    spec = get_model_spec("llama3")
    return spec, spec.build_meta(spec.flavors["debug"])


def test_auto_is_flex_on_cuda_and_sdpa_on_cpu_and_says_which(caplog):
    spec, model = llama()
    with caplog.at_level(logging.INFO, logger="composer.parallel.attention"):
        assert choose_attention("auto", torch.device("cuda"), model, spec) == "flex"
        assert choose_attention("auto", torch.device("cpu"), model, spec) == "sdpa"
    assert caplog.messages == ["attention: flex (model.attention=auto on cuda)",
                               "attention: sdpa (model.attention=auto on cpu)"]
    assert choose_attention("flex", torch.device("cpu"), model, spec) == "flex"


def test_flex_sets_the_mask_module_and_every_core():
    spec, model = llama()
    apply_attention(model, spec, "flex")
    modules = [model.get_submodule(f) for f in spec.parallel.attention_cores(model)]
    assert len(modules) == len(model.layers)
    assert all(m.flex for m in [*modules, model.attention_mask])
    apply_attention(model, spec, "sdpa")
    assert not any(m.flex for m in [*modules, model.attention_mask])
    assert not model.attention_mask.dense  # documents as spans
    apply_attention(model, spec, "sdpa", compiled=True)  # one graph: no loop over spans
    assert model.attention_mask.dense and not model.attention_mask.flex
    apply_attention(model, spec, "flex", compiled=True)
    assert model.attention_mask.flex and not model.attention_mask.dense


def test_a_model_whose_cores_take_no_block_mask_refuses_flex_in_one_line():
    spec, model = llama()
    for layer in model.layers.values():  # a core without the flex switch
        layer.attention.core = nn.Identity()
    message = ("model.attention='flex': model 'llama3' has attention that takes no "
               "FlexAttention block mask; allowed: auto, sdpa")
    with pytest.raises(ValueError, match=message):
        choose_attention("flex", torch.device("cpu"), model, spec)
    assert choose_attention("auto", torch.device("cuda"), model, spec) == "sdpa"
    with pytest.raises(ValueError, match="model.attention='eager'; allowed: auto, sdpa, flex"):
        choose_attention("eager", torch.device("cpu"), model, spec)
