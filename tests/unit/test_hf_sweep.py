"""The HF architecture sweep's own parts: the tiny configs, where the decoder layers are
found, the float32 ops it names, the representative subset, and the support table that
docs/hf_models.md shows, rendered from the committed sweep (benchmarks/hf_sweep.json)."""
from __future__ import annotations

import json

import pytest
import torch

from composer.testing import hf_table, hf_tiny
from composer.testing.harness import ROOT
from composer.testing.hf_sweep import SUBSET

transformers = pytest.importorskip("transformers")
RESULTS = ROOT / "benchmarks" / "hf_sweep.json"


def committed() -> dict:
    return json.loads(RESULTS.read_text())


def test_the_support_table_is_the_committed_sweep_rendered():
    page = hf_table.PAGE.read_text()
    assert hf_table.BEGIN in page and hf_table.END in page
    assert hf_table.page_with(committed(), page) == page, (
        "docs/hf_models.md differs from benchmarks/hf_sweep.json rendered: run "
        "python benchmarks/hf_sweep.py --merge benchmarks/hf_sweep.json --render")


def test_the_sweep_covers_every_type_transformers_lists():
    """Nothing drops out of the denominator: a row per listed type, each with a
    one-process cell, stamped with the version it ran on."""
    rows = committed()["rows"]
    assert sorted(row["arch"] for row in rows) == hf_tiny.causal_lm_types()
    assert all("1 process" in row["cells"] and row["transformers"] == transformers.__version__
               for row in rows)


def test_the_committed_subset_shows_every_form_the_sweep_found():
    rows = [row for row in committed()["rows"] if "class" in row]
    chosen = hf_table.choose_subset(rows)
    def forms(archs):
        return set().union(*(hf_table.forms(row) for row in rows if row["arch"] in archs))
    assert forms(chosen) <= forms(SUBSET)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3_moe", "deepseek_v3", "bart"])
def test_a_tiny_config_is_tiny_and_builds(arch):
    config, overrides = hf_tiny.tiny_config(arch)
    text = config.get_text_config()
    assert text.vocab_size == 320 and text.num_hidden_layers == hf_tiny.LAYERS
    assert getattr(text, "hidden_size") == 64 and not overrides
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


@pytest.mark.parametrize("arch, layers", [("llama", "model.layers"), ("gpt2", "transformer.h"),
                                          ("bart", "model.decoder.layers"),
                                          ("falcon_mamba", "backbone.layers")])
def test_the_decoder_layers_are_found_wherever_the_model_keeps_them(arch, layers):
    from composer.models.hf.model import HFCausalLM
    with torch.device("meta"):
        model = HFCausalLM(hf_tiny.tiny_config(arch)[0])
    assert model.layers_name == layers
    assert model.layers is model.lm.get_submodule(layers)


def test_the_float32_ops_transformers_forces_are_named():
    from composer.testing.float32_ops import Float32Ops
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_tiny.tiny_config("gemma2")[0],
                                                          dtype=torch.float64)
    with torch.no_grad(), Float32Ops() as ops:
        model(torch.randint(0, 320, (1, 8)), use_cache=False)
    assert "Gemma2RMSNorm: float" in ops.names()
    with torch.no_grad(), Float32Ops() as ops:
        torch.nn.Linear(4, 4, dtype=torch.float64)(torch.ones(4, dtype=torch.float64))
    assert ops.names() == []


def test_an_argument_given_as_none_is_not_refused():
    """A decoder of an encoder's family passes ``encoder_hidden_states=None``: nothing asked;
    given a tensor, it is refused in one line."""
    from composer.models.hf.attention import Core, Refused, attention
    module = torch.nn.Module()
    module.core = Core()
    q = torch.randn(1, 2, 4, 8)
    out, _ = attention(module, q, q, q, None, encoder_hidden_states=None)
    assert out.shape == (1, 4, 2, 8)
    with pytest.raises(Refused, match="'encoder_hidden_states'"):
        attention(module, q, q, q, None, encoder_hidden_states=q)


@pytest.mark.parametrize("arch, counts", [("llama", False), ("roberta", True), ("gpt2", False)])
def test_an_embeddings_module_that_counts_positions_is_left_to(arch, counts):
    """RoBERTa's embeddings count the positions from the token ids, offset by the padding
    index; composer gives none then (a sweep row holds the loss to transformers')."""
    from composer.models.hf.model import HFCausalLM
    with torch.device("meta"):
        model = HFCausalLM(hf_tiny.tiny_config(arch)[0])
    assert model.counts_positions is counts


@pytest.mark.parametrize("arch", ["gpt_neo", "git"])
def test_a_model_that_picks_its_attention_from_a_table_of_its_own_runs_it(arch):
    """transformers has no entry for composer's attention in such a model's table: it runs
    transformers' eager attention, and says why where composer's is needed."""
    from composer.models.hf.model import HFCausalLM
    with torch.device("meta"):
        model = HFCausalLM(hf_tiny.tiny_config(arch)[0])
    assert "a table of its own" in model.unrouted
    assert model.lm.config._attn_implementation == "eager"


def test_a_tensor_split_from_one_stored_is_its_part(tmp_path):
    """Lara-mini stores one in_proj and holds in_proj_qkv, _z, _b, _a: each is read as its
    own rows of the stored tensor (transformers' Split sizes them by the first target)."""
    from safetensors import safe_open

    from composer.models.hf import HFLayout
    folder = hf_tiny.write_folder("lara_mini", tmp_path / "lara")
    layout = HFLayout(HFLayout.args_from_folder(folder))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("model.layers.0.linear_attn.in_proj.weight")
        start = 0
        for part in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            got = layout.from_hf(f"lm.model.layers.0.linear_attn.{part}.weight", f.get_tensor)
            assert torch.equal(got, stored[start:start + len(got)])
            start += len(got)
    assert start == len(stored)
