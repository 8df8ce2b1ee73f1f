"""Pipeline stages of a transformers model (``model.name = "hf"``): the cut falls between
the units of transformers' own pipeline plan, a stage holds ``PassThrough``s in place of the
units it lacks (transformers' names and checkpoint keys stay), those are no blocks for
FSDP, activation checkpointing or compile, and the stages run one after the other give
the whole model's logits. What cannot be cut is refused in one line, before any process."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from composer import ModelSpec, ParallelHooks, materialize, pipeline_stages
from composer.config import parse_args
from composer.models.hf import spec
from composer.planner.cluster import load_cluster
from composer.planner.layout import layout_of, load_model
from composer.planner.predict import predict
from composer.spec import PassThrough
from composer.trainer.build import default_dtype
from tests.support.hf_folders import COMMON, configs, make

transformers = pytest.importorskip("transformers")

DENSE = ("llama", "qwen2", "mistral")
LAYERS = [f"lm.model.layers.{i}" for i in range(COMMON["num_hidden_layers"])]


def stages(config, pp: int = 2) -> list[nn.Module]:
    """Every stage of ``config``'s model cut ``pp`` ways, on meta."""
    build = partial(spec.build_meta, config)
    return [pipeline_stages(spec, build, pp, rank, local_batch=8)[1][0] for rank in range(pp)]


def test_the_cut_falls_between_transformers_own_units():
    model = spec.build_meta(configs()["llama"])
    assert spec.parallel.pipeline_units(model) == [
        "lm.model.embed_tokens", *LAYERS, "lm.model.norm", "lm.lm_head"]


@pytest.mark.parametrize("arch", DENSE)
def test_stages_keep_transformers_names_and_hold_only_their_blocks(arch):
    config = configs()[arch]
    whole = spec.build_meta(config).state_dict()
    first, last = stages(config)
    keys = [set(stage.state_dict()) for stage in (first, last)]
    assert not keys[0] & keys[1] and keys[0] | keys[1] == set(whole)
    for stage, held in ((first, LAYERS[:2]), (last, LAYERS[2:])):
        assert spec.block_names(stage) == LAYERS  # transformers' list keeps its numbering
        assert [b for b in spec.blocks(stage) if isinstance(b, PassThrough)]
        names = {id(m): n for n, m in stage.named_modules()}
        assert [names[id(b)] for b in spec.held_blocks(stage)] == held
        assert all(tuple(t.shape) == tuple(whole[k].shape) for k, t in stage.state_dict().items())
    assert isinstance(first.lm.model.norm, PassThrough)
    assert isinstance(first.lm.lm_head, PassThrough)
    assert isinstance(last.lm.model.embed_tokens, PassThrough)
    assert first.holds_head() is False and last.holds_head() is True


def real(module: nn.Module, config) -> nn.Module:
    """``module`` (the model or a stage) with the whole model's weights of seed 0."""
    materialize(module, partial(spec.build_meta, config), torch.device("cpu"), seed=0,
                from_replica=True)
    return module


@pytest.mark.parametrize("arch", DENSE)
def test_the_stages_one_after_the_other_are_the_model(arch):
    """Stage 0 takes tokens and returns hidden states (no final norm); stage 1 takes them
    and returns the logits: exactly the whole model's, packed documents included."""
    config = configs()[arch]
    with default_dtype(torch.float64):
        model = real(spec.build_meta(config), config)
        first, last = (real(stage, config) for stage in stages(config))
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 24))
    documents = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    with torch.no_grad():
        hidden = first(tokens, documents)
        assert hidden.shape == (2, 24, COMMON["hidden_size"])
        torch.testing.assert_close(last(hidden, documents), model(tokens, documents),
                                   rtol=0, atol=0)


def test_the_planner_traces_the_model_and_counts_a_stages_own_blocks(tmp_path):
    """The trace keeps the blocks it measures and passes the others through; pipeline
    rank 0 of pp2 holds the first stage's parameters (float32), no more."""
    cfg, _ = parse_args(["--model.name", "hf", "--model.hf_path", str(make("llama", tmp_path)),
                         "--data.seq_len", "32", "--training.local_batch_size", "8",
                         "--parallelism.pipeline_parallel_degree", "2"])
    model = load_model(cfg)
    assert model.profile.n_layers == COMMON["num_hidden_layers"]
    first = stages(configs()["llama"])[0]
    params = predict(layout_of(cfg, model, 2, "cpu"), load_cluster("cpu")).peak.gib()["params"]
    assert params * 2**30 == 4 * sum(p.numel() for p in first.parameters())


GRANITE = ("parallelism.pipeline_parallel_degree=2: model 'hf' cannot be cut into pipeline "
           "stages: transformers' GraniteModel changes the hidden states outside its pipeline "
           "units (before lm.model.layers.0), which every later stage would do again; allowed: 1")


def test_a_base_model_that_changes_the_hidden_states_is_refused(tmp_path, monkeypatch, capsys):
    """Granite multiplies the embeddings inside its base model's forward, which a later
    stage (handed hidden states as inputs_embeds) would do again."""
    granite = transformers.GraniteConfig(**COMMON, intermediate_size=128, embedding_multiplier=12.0)
    with pytest.raises(ValueError) as refused:
        stages(granite)
    assert str(refused.value) == GRANITE
    granite.save_pretrained(tmp_path)
    from composer.cli.run import run_argv
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_argv(["--model.name", "hf", "--model.hf_path", str(tmp_path), "--validate",
                     "--parallelism.pipeline_parallel_degree", "2"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {GRANITE}"


def test_a_head_tied_to_the_embedding_is_refused_across_stages():
    with pytest.raises(ValueError, match="tied parameters lm.model.embed_tokens.weight, "
                                         "lm.lm_head.weight would land on stages"):
        stages(configs()["gemma2"])


class Listed(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


def test_blocks_in_a_module_list_are_refused_unless_passed_through():
    """Removing a block from an nn.ModuleList would renumber the rest; pass-throughs (the
    default) keep the numbering instead."""
    hooks = ParallelHooks(pipeline_units=lambda m: [f"layers.{i}" for i in range(len(m.layers))],
                          pipeline_pass_through=False)
    listed = ModelSpec("listed", {"tiny": 4}, build=Listed, blocks=lambda m: list(m.layers),
                       parallel=hooks)
    build = partial(listed.build_meta, 4)
    with pytest.raises(ValueError, match="'layers.0' is in an nn.ModuleList.*"
                                         "or leave ParallelHooks.pipeline_pass_through on"):
        pipeline_stages(listed, build, pp=2, pp_rank=0, local_batch=4)
    hooks.pipeline_pass_through = True
    stage = pipeline_stages(listed, build, pp=2, pp_rank=1, local_batch=4)[1][0]
    assert [type(m).__name__ for m in stage.layers] == ["PassThrough"] * 2 + ["Linear"] * 2
    assert sorted(stage.state_dict()) == [f"layers.{i}.{p}" for i in (2, 3)
                                          for p in ("bias", "weight")]
    assert listed.held_blocks(stage) == list(stage.layers)[2:]
