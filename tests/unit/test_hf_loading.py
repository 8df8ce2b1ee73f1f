"""A Hugging Face folder as one process trains it: built on the meta device, initialised,
filled from the folder (``load_hf_into``), its loss on the first batch equal to
transformers' own from ``from_pretrained`` (float64, relative 1e-9), for architectures that
each reach a different corner of the way there; and transformers' per-step padding check
(a host sync) left out of the forward."""
from __future__ import annotations

import pytest
import torch

from composer.checkpoint.hf import load_hf_into
from composer.testing import hf_sweep, hf_tiny

transformers = pytest.importorskip("transformers")

CORNERS = {
    # an encoder family's decoder whose attention calls no interface: transformers' eager
    # attention with the causal mask it builds (composer's gave none: it saw the future)
    "roformer": "eager, unrouted",
    # sparse attention's indexer reads transformers' mask before attention
    "deepseek_v32": "eager, reads the mask",
    # MPT's blocks take the mask from the model, beside ALiBi
    "mpt": "eager, reads the mask",
    # xIELU's constants are persistent buffers, stored in the folder
    "apertus": "composer, buffers",
    # the multimodal config unties the head its text config ties, as transformers does
    "gemma3": "composer, ties",
}


def ours_and_theirs(arch: str, folder) -> tuple[float, float, object]:
    from composer.models.hf import HFLayout
    from composer.models.hf.model import HFCausalLM
    hf_tiny.write_folder(arch, folder)
    args = HFLayout.args_from_folder(folder)
    with torch.device("meta"):
        model = HFCausalLM(args)
    model.to_empty(device="cpu")
    model.init_weights()
    load_hf_into(model, folder, HFLayout(args))
    inputs, targets = hf_sweep.first_batch()
    with torch.no_grad():
        logits = model(inputs)
    ours = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    return ours, hf_sweep.reference_loss(folder)[0], model


@pytest.mark.parametrize("arch", CORNERS)
def test_one_process_is_transformers_own_loss(arch, tmp_path):
    torch.set_default_dtype(torch.float64)
    try:
        ours, theirs, model = ours_and_theirs(arch, tmp_path / arch)
    finally:
        torch.set_default_dtype(torch.float32)
    assert abs(ours - theirs) <= 1e-9 * theirs, (arch, ours, theirs)
    eager = CORNERS[arch].startswith("eager")
    assert bool(model.unrouted) is eager
    assert model.lm.config._attn_implementation == ("eager" if eager else "composer")


def test_the_forward_checks_no_token_for_padding():
    """transformers' ``warn_if_padding_and_no_attention_mask`` reads a batch's first and
    last tokens on the host (``.item()``) each step: composer's forward skips it, so it
    runs on the meta device too."""
    from composer.models.hf.model import HFCausalLM
    with torch.device("meta"):
        model = HFCausalLM(hf_tiny.tiny_config("roformer")[0])
        assert model(torch.zeros(2, 4, dtype=torch.long)).shape == (2, 4, 320)
