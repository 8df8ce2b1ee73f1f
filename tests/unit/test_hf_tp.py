"""Tensor parallel for the HF family (models/hf/tp.py): each architecture's plan is
transformers' own, translated to composer's styles, plus the entries sequence parallel
adds from the model's structure; what composer cannot honour is refused at validation in
one line naming the module pattern and the style. The numbers are proven by the parity
rows (tests/integration/test_hf_parity.py)."""
from __future__ import annotations

import json

import pytest
from torch import nn

from composer.cli.run import run_argv
from composer.models.hf import spec as hf_spec
from composer.parallel.tensor import STYLES, check_tp_styles, plan_of
from composer.spec import ModelSpec
from tests.support.hf_folders import PLANS, configs

pytest.importorskip("transformers")

LAYERS = "lm.model.layers.*"
ENDS = {"lm.lm_head": "output", "lm.model.embed_tokens": "embedding"}
SEPARATE = {**{f"{LAYERS}.self_attn.{p}_proj": "colwise" for p in "qkv"},
            f"{LAYERS}.self_attn.o_proj": "rowwise",
            f"{LAYERS}.mlp.gate_proj": "colwise", f"{LAYERS}.mlp.up_proj": "colwise",
            f"{LAYERS}.mlp.down_proj": "rowwise"}
QWEN3_MOE_ATTENTION = {**{k: v for k, v in SEPARATE.items() if ".mlp." not in k},
                       f"{LAYERS}.self_attn.q_norm": "head_norm",
                       f"{LAYERS}.self_attn.k_norm": "head_norm"}
FUSED = {f"{LAYERS}.self_attn.qkv_proj": "colwise_gathered",
         f"{LAYERS}.self_attn.o_proj": "rowwise_split_input"}
EXPECTED = {
    "llama": {**ENDS, **SEPARATE},
    "qwen2": {**ENDS, **SEPARATE},
    "mistral": {**ENDS, **SEPARATE},
    "qwen3": {**ENDS, **SEPARATE, f"{LAYERS}.self_attn.q_norm": "head_norm",
              f"{LAYERS}.self_attn.k_norm": "head_norm"},
    "phi3": {**ENDS, **FUSED, f"{LAYERS}.mlp.gate_up_proj": "colwise_gathered",
             f"{LAYERS}.mlp.down_proj": "rowwise_split_input"},
    "phi3_packed": {**ENDS, **FUSED, f"{LAYERS}.mlp.gate_up_proj": "packed_colwise",
                    f"{LAYERS}.mlp.down_proj": "rowwise"},
    # the experts' own entries (packed gate_up_proj, rowwise down_proj) are their cut
    "qwen3_moe": {**ENDS, **QWEN3_MOE_ATTENTION, f"{LAYERS}.mlp.experts": "experts"},
    # transformers 5.25's plan: the experts whole (its dense-MLP entries name no module here)
    "qwen3_moe_whole": {**ENDS, **QWEN3_MOE_ATTENTION},
}
# what sequence parallel adds: the norms on the residual stream, the modules reading it
SEQUENCE = {"lm.model.norm": "norm", f"{LAYERS}.input_layernorm": "norm",
            f"{LAYERS}.post_attention_layernorm": "norm",
            f"{LAYERS}.self_attn": "replicate_input", f"{LAYERS}.mlp": "replicate_input"}
KEY = "parallelism.tensor_parallel_degree=2"


def config_of(arch: str, plan: dict | None = None):
    config = configs()[arch]
    if plan or arch in PLANS:
        config.base_model_tp_plan = plan or PLANS[arch]
    return config


@pytest.mark.parametrize("arch", EXPECTED)
def test_each_architecture_gets_transformers_plan_translated(arch):
    model = hf_spec.build_meta(config_of(arch))
    assert plan_of(hf_spec.tp_plan, model, False, True) == EXPECTED[arch]
    # an MoE block sums its experts' outputs over tp, or the plan leaves it whole: either
    # way it runs on the whole sequence
    moe = arch.startswith("qwen3_moe")
    sequence = {**SEQUENCE, f"{LAYERS}.mlp": "gathered"} if moe else SEQUENCE
    assert plan_of(hf_spec.tp_plan, model, True, True) == {**EXPECTED[arch], **sequence}
    assert set(plan_of(hf_spec.tp_plan, model, True, True).values()) <= set(STYLES)


def test_transformers_own_qwen3_moe_plan_is_one_held_here():
    """The Qwen3-MoE plans the tests pin (tests/support/hf_folders.py) stand for the installed
    transformers': a release that ships a third fails here, not in the parity rows."""
    from transformers import Qwen3MoeConfig
    assert Qwen3MoeConfig.base_model_tp_plan in (PLANS["qwen3_moe"], PLANS["qwen3_moe_whole"])


def refusal(arch: str, *args: str, plan: dict | None = None, tp: int = 2, world: int = 0,
            tmp_path, monkeypatch, capsys) -> str:
    """The one line ``--validate`` ends with for a folder of ``arch`` (its config only)."""
    plan = plan or PLANS.get(arch)
    config_of(arch, plan).save_pretrained(tmp_path)
    if plan:  # transformers does not write a plan; a folder may give one, as PLANS's do
        written = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**written,
                                                          "base_model_tp_plan": plan}))
    monkeypatch.setenv("WORLD_SIZE", str(world or tp))
    code = run_argv(["--validate", "--model.name", "hf", "--model.hf_path", str(tmp_path),
                     "--parallelism.tensor_parallel_degree", str(tp), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1] if code == 2 and len(lines) == 1 else f"exit {code}: {lines}"


ALLOWED = ("colwise, rowwise, colwise_gather_output, rowwise_split_input, packed_colwise, "
           "embedding_rowwise, replicated_with_grad_allreduce, moe_tp_experts, mla_kv_a_proj, "
           "local_params, replicate, embedding_colwise")


@pytest.mark.parametrize("arch, whole", [
    ("deepseek_v3", "self_attn"),  # mla_kv_a_proj, and q_a_proj the plan leaves whole
    ("beam", "self_attn"),  # local_params: its bare gate_bias is cut
    ("dots1", "mlp"),  # an MoE's router and experts whole beside cut shared experts
])
def test_a_module_transformers_syncs_by_code_of_its_own_runs_whole(arch, whole):
    """Its entries dropped, it runs whole on the gathered sequence with sequence parallel,
    and is left as it is without; the rest of the plan stays cut."""
    from composer.testing.hf_tiny import tiny_config
    model = hf_spec.build_meta(tiny_config(arch)[0])
    with_sp = plan_of(hf_spec.tp_plan, model, True, True)
    inside = f"{LAYERS}.{whole}."
    assert with_sp[f"{LAYERS}.{whole}"] == "gathered"
    assert not any(key.startswith(inside) for key in with_sp)
    assert "whole" not in with_sp.values() and set(with_sp.values()) <= set(STYLES)
    without = plan_of(hf_spec.tp_plan, model, False, True)
    assert not any(key.startswith(inside) or key == f"{LAYERS}.{whole}" for key in without)
    assert any(style == "rowwise" for style in without.values())


def test_a_style_composer_cannot_honour_is_one_line(tmp_path, monkeypatch, capsys):
    """Any style without a translation; stacked experts stored transposed (gpt-oss's),
    or with a parameter the plan does not cut (each rank would add it)."""
    seen = dict(tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    experts = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise",
               "layers.*.mlp.experts.down_proj": "rowwise",
               "layers.*.mlp.experts": "moe_tp_experts"}
    assert refusal("gpt_oss", plan=experts, **seen) == (
        f"error: {KEY}: {LAYERS}.mlp.experts: transformers' tensor-parallel style "
        f"'moe_tp_experts' cannot be honoured: its stacked weights are stored transposed "
        f"([n_experts, in, out])")
    uncut = {k: v for k, v in experts.items() if not k.endswith("down_proj")}
    assert refusal("qwen3_moe", plan=uncut, **seen) == (
        f"error: {KEY}: {LAYERS}.mlp.experts: transformers' tensor-parallel style "
        f"'moe_tp_experts' cannot be honoured: the plan does not cut down_proj (each rank "
        f"would add it)")
    assert refusal("qwen3_moe", "--checkpoint.enable", "true", **seen) == (
        f"error: checkpoint.enable=true: '{LAYERS}.mlp.experts' is experts with packed "
        f"weights, whose layout (a strided shard) torch's DCP cannot save; allowed: false, or "
        f"parallelism.tensor_parallel_degree=1")
    assert refusal("qwen3_moe", "--parallelism.expert_parallel_degree", "2", world=4,
                   **seen) == (
        f"error: parallelism.expert_parallel_degree=2 with tensor_parallel_degree=2: the "
        f"tensor-parallel plan cuts the experts ({LAYERS}.mlp.experts); allowed: one of the "
        f"two above 1")
    plan = {**PLANS["phi3_packed"], "layers.*.mlp.down_proj": "all_reduce"}
    assert refusal("phi3", plan=plan, **seen) == (
        f"error: {KEY}: {LAYERS}.mlp.down_proj: transformers' tensor-parallel style "
        f"'all_reduce' has no translation in composer; allowed: {ALLOWED}")


def test_sequence_parallel_refused_where_it_cannot_cut_the_stream(tmp_path, monkeypatch,
                                                                  capsys):
    """An attention whose output linear cuts nothing while its input's does (a colwise
    qkv_proj, no rowwise o_proj) would read a sequence slice whole and add it to a slice:
    sequence parallel asked for is refused, not run; ``auto`` (the default) turns it off."""
    plan = {"layers.*.self_attn.qkv_proj": "colwise",
            "layers.*.mlp.gate_up_proj": "packed_colwise", "layers.*.mlp.down_proj": "rowwise"}
    seen = dict(tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert refusal("phi3", "--parallelism.sequence_parallel", "true", plan=plan, **seen) == (
        f"error: {KEY}: sequence parallel: lm.model.layers.0.self_attn (Phi3Attention) is "
        f"neither a norm nor a module whose linears the tensor-parallel plan makes write the "
        f"residual stream; set parallelism.sequence_parallel = false")
    for args in (["--parallelism.sequence_parallel", "false"], []):
        assert refusal("phi3", *args, plan=plan, **seen).startswith("exit 0")


def test_auto_sequence_parallel_is_off_only_where_the_plan_cannot_cut_the_stream():
    """``parallelism.sequence_parallel = "auto"`` is decided before any process group:
    on for a plan that cuts the stream, off (in the log) for one that cannot."""
    from composer.config import JobConfig
    from composer.job.plan import resolve_sequence_parallel
    from composer.testing.hf_tiny import tiny_config
    for arch, plan, on in (("phi3", None, True),
                           ("phi3", {"layers.*.self_attn.qkv_proj": "colwise"}, False)):
        config = tiny_config(arch)[0]
        config.base_model_tp_plan = plan or config.base_model_tp_plan
        cfg = JobConfig()
        cfg.parallelism.tensor_parallel_degree = 2
        assert cfg.parallelism.sequence_parallel == "auto"
        resolve_sequence_parallel(cfg, hf_spec, hf_spec.build_meta(config))
        assert cfg.parallelism.sequence_parallel is on, arch


def test_a_module_whose_cut_linears_gather_their_output_runs_whole_with_sequence_parallel():
    """A gated delta net (Qwen3-Next's linear attention) whose projections the plan cuts
    and gathers whole again (colwise_gather_output) takes the gathered stream and keeps its
    slice; an input embedding the plan leaves whole keeps its slice of the token ids'."""
    from composer.models.hf.tp import tp_plan
    from composer.testing.hf_tiny import tiny_config
    plan = tp_plan(True, True, hf_spec.build_meta(tiny_config("qwen3_next")[0]))
    assert plan[f"{LAYERS}.linear_attn"] == "gathered"
    assert plan[f"{LAYERS}.linear_attn.in_proj_qkvz"] == "colwise_gathered"
    plan = tp_plan(True, True, hf_spec.build_meta(tiny_config("ergo")[0]))
    assert plan["lm.model.embed_tokens"] == "sliced"


def test_degrees_that_do_not_divide_are_caught(tmp_path, monkeypatch, capsys):
    seen = dict(tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert refusal("llama", tp=3, **seen) == (
        f"error: parallelism.tensor_parallel_degree=3 does not divide the model's "
        f"num_attention_heads=4 (hf/{tmp_path.name})")


def test_packed_weights_refuse_a_bias_and_dcp_steps():
    spec = ModelSpec("packed", {}, build=lambda args: nn.Linear(4, 8, bias=args),
                     blocks=lambda model: [model], tp_plan={"": "packed_colwise"})
    check = dict(tp=2, spec=spec, sequence_parallel=True, loss_parallel=True)
    check_tp_styles(meta=spec.build_meta(False), checkpoint=False, **check)
    with pytest.raises(ValueError, match=f"^{KEY}: '' is packed_colwise and has a bias;"):
        check_tp_styles(meta=spec.build_meta(True), checkpoint=False, **check)
    with pytest.raises(ValueError, match="^checkpoint.enable=true: '' is packed_colwise, whose"):
        check_tp_styles(meta=spec.build_meta(False), checkpoint=True, **check)


def test_a_plan_may_be_a_function_of_the_model_or_not():
    """Specs' plans: data, (sp, lp) -> plan (as before), or (sp, lp, model) -> plan; a
    style composer does not know is one line naming the pattern and the style."""
    model = nn.Linear(2, 2)
    assert plan_of({"": "colwise"}, model, True, False) == {"": "colwise"}
    assert plan_of(lambda sp, lp: {"": sp}, model, True, False) == {"": True}
    assert plan_of(lambda sp, lp, m: {"": m}, model, True, False) == {"": model}
    spec = ModelSpec("typo", {}, build=lambda args: nn.Linear(2, 2), blocks=lambda m: [m],
                     tp_plan=lambda sp, lp, m: {"layers.*.w": "colwize"})
    with pytest.raises(ValueError) as error:
        check_tp_styles(2, spec, model, True, True, checkpoint=False)
    assert str(error.value) == (f"{KEY}: the tensor-parallel plan gives 'layers.*.w' the style "
                                f"'colwize', which composer does not know; allowed: "
                                f"{', '.join(STYLES)}")
