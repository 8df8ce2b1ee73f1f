"""Qwen3, dense and MoE: parameter counts equal transformers' for every
published flavor, logits equal transformers' Qwen3ForCausalLM and
Qwen3MoeForCausalLM on both import and export, config.json both ways, and the
refusals of what our model cannot express.

Run as a script under torchrun, this file is also the 2-rank check that the
q/k norms' gradients under tensor parallel are the unsharded model's:

    torchrun --nproc_per_node=2 tests/integration/test_qwen3.py OUT_FOLDER
"""
from __future__ import annotations

import dataclasses
import gc
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from composer.checkpoint.hf import adapter_of, export_hf, hf_names, load_hf_into
from composer.models import MODELS, qwen3
from composer.models.common import rope_inv_freq
from composer.testing.harness import launch

SMALL = dataclasses.replace(qwen3.flavors["debug"], max_seq_len=64)
SMALL_MOE = dataclasses.replace(qwen3.moe_flavors["debug"], max_seq_len=64)
CASES = {"dense": (qwen3.spec, SMALL), "moe": (qwen3.moe_spec, SMALL_MOE)}

# Literal values of the published config.json files (Qwen/Qwen3-*): hidden_size,
# intermediate_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, tie_word_embeddings; and the model cards' totals.
PUBLISHED = {
    "0.6B": ((1024, 3072, 28, 16, 8, True), "0.6"),
    "1.7B": ((2048, 6144, 28, 16, 8, True), "1.7"),
    "4B": ((2560, 9728, 36, 32, 8, True), "4.0"),
    "8B": ((4096, 12288, 36, 32, 8, False), "8.2"),
    "14B": ((5120, 17408, 40, 40, 8, False), "14.8"),
    "32B": ((5120, 25600, 64, 64, 8, False), "32.8"),
    "30B-A3B": ((2048, 6144, 48, 32, 4, False), "30.5"),
    "235B-A22B": ((4096, 12288, 94, 64, 4, False), "235"),
}
PUBLISHED_MOE = {"30B-A3B": 768, "235B-A22B": 1536}  # moe_intermediate_size
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "tie_word_embeddings")


def spec_of(flavor: str):
    return qwen3.moe_spec if flavor in qwen3.moe_flavors else qwen3.spec


def hf_class(spec):
    import transformers
    moe = spec is qwen3.moe_spec
    return getattr(transformers, "Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")


def hf_model_of(spec, config: dict):
    """transformers' model for our config.json, built as from_pretrained would read it."""
    cls = hf_class(spec)
    return cls(cls.config_class.from_dict(config))


def build(spec, args, dtype=torch.float64, seed=0):
    """The trainer's path (meta build, to_empty, seeded init), then norm weights
    away from one so that a wrong order of their features shows."""
    model = spec.build_meta(args).to(dtype).to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


# ---------------------------------------------------------------- flavors

def test_registered():
    assert MODELS["qwen3"] is qwen3.spec and MODELS["qwen3_moe"] is qwen3.moe_spec
    assert set(qwen3.flavors) == {"debug", "0.6B", "1.7B", "4B", "8B", "14B", "32B"}
    assert set(qwen3.moe_flavors) == {"debug", "30B-A3B", "235B-A22B"}
    for args in (SMALL, SMALL_MOE):
        assert args.n_heads * args.head_dim != args.dim


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_parameter_count_equals_transformers(flavor):
    spec = spec_of(flavor)
    args = spec.flavors[flavor]
    config = adapter_of(spec, args).config(torch.bfloat16)
    shape, total = PUBLISHED[flavor]
    assert tuple(config[k] for k in SHAPE_KEYS) == shape
    assert (config["head_dim"], config["vocab_size"], config["rope_theta"], config["rms_norm_eps"],
            config["max_position_embeddings"]) == (128, 151936, 1e6, 1e-6, 40960)
    if flavor in PUBLISHED_MOE:
        assert (config["moe_intermediate_size"], config["num_experts"],
                config["num_experts_per_tok"], config["norm_topk_prob"]) == \
            (PUBLISHED_MOE[flavor], 128, 8, True)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in hf_model_of(spec, config).parameters())
    ours = spec.num_params(args)
    assert ours == theirs
    assert f"{ours / 1e9:.{len(total.partition('.')[2])}f}" == total


# ---------------------------------------------------------------- logits parity

def _norm64(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _router64(self, x):
    logits = torch.nn.functional.linear(x.reshape(-1, self.hidden_dim), self.weight)
    top, chosen = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
    if self.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    return logits, top, chosen


def lift_float32(hf_model, inv_freq: torch.Tensor) -> None:
    """transformers' Qwen3 computes in float32 even in a float64 model: every
    RMSNorm (q_norm and k_norm too), the rotary tables and the MoE router's
    softmax (about 1e-7 relative). Compute them in float64 instead, the tables
    from ``inv_freq``, so the remaining difference is the weights' alone."""
    def rotary(self, x, position_ids):
        angles = position_ids[..., None].to(inv_freq.dtype) * inv_freq
        both = torch.cat((angles, angles), dim=-1)
        return both.cos().to(x.dtype), both.sin().to(x.dtype)

    lifted = {"Qwen3RMSNorm": _norm64, "Qwen3MoeRMSNorm": _norm64, "Qwen3MoeTopKRouter": _router64}
    for module in hf_model.modules():
        if type(module).__name__ in lifted:
            module.forward = types.MethodType(lifted[type(module).__name__], module)
    rotary_emb = hf_model.model.rotary_emb
    rotary_emb.forward = types.MethodType(rotary, rotary_emb)


def logits_differences(ours, theirs, args) -> tuple[float, float]:
    """Largest |difference| / largest |logit|, stock and lifted."""
    if theirs.config.model_type == "qwen3_moe":  # grouped_mm has no float64 kernel on CPU
        theirs.set_experts_implementation("eager")
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(tokens)
        scale = expected.abs().max()
        stock = theirs(tokens).logits
        lift_float32(theirs, rope_inv_freq(args))
        lifted = theirs(tokens).logits
    return tuple(((x - expected).abs().max() / scale).item() for x in (stock, lifted))


def assert_parity(ours, theirs, args, label: str) -> None:
    # transformers read the rope config as we meant it (to its float32 precision)
    torch.testing.assert_close(theirs.model.rotary_emb.inv_freq.double(), rope_inv_freq(args),
                               rtol=1e-6, atol=0)
    stock, lifted = logits_differences(ours, theirs, args)
    print(f"{label}: logits differ by {stock:.1e} stock, {lifted:.1e} lifted (of the largest)")
    assert stock < 1e-5 and lifted < 1e-9, (stock, lifted)


def random_hf_model(spec, args, seed=0):
    """transformers' model of ``args`` in float64 with every weight random
    (norms around one, the router's gate wide enough that top-k is clear-cut)."""
    theirs = hf_model_of(spec, adapter_of(spec, args).config(torch.float64)).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=generator, dtype=p.dtype) + 0.5)
            else:
                scale = 0.5 if name.endswith("mlp.gate.weight") else 0.05
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale)
    return theirs.eval()


@pytest.mark.parametrize("case", CASES)
def test_transformers_checkpoint_loads_with_the_same_logits(tmp_path, case):
    spec, args = CASES[case]
    theirs = random_hf_model(spec, args)
    theirs.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    adapter_class = spec.adapters.hf_adapter
    assert adapter_class.args_from_config(config) == args  # transformers' own spelling
    ours = build(spec, args, seed=1)
    load_hf_into(ours, tmp_path, adapter_class(args))
    assert_parity(ours, theirs, args, f"{case} import")


@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, case):
    spec, args = CASES[case]
    ours = build(spec, args)
    export_hf(ours, tmp_path, spec, args, torch.float64)
    theirs, info = hf_class(spec).from_pretrained(tmp_path, dtype=torch.float64,
                                                   output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    names = hf_names(tmp_path)
    if case == "moe":
        assert "model.layers.3.mlp.experts.7.down_proj.weight" in names
        assert not [n for n in names if "gate_up_proj" in n or "bias" in n]
    assert ("lm_head.weight" in names) == (not args.tie_embeddings)
    assert_parity(ours, theirs, args, f"{case} export")


# ---------------------------------------------------------------- names and config

@pytest.mark.parametrize("case", CASES)
def test_round_trip_through_the_adapter_is_exact(case):
    spec, args = CASES[case]
    adapter = adapter_of(spec, args)
    state = build(spec, args, dtype=torch.float32).state_dict()
    hf = {}
    for ours, tensor in state.items():
        converted = adapter.to_hf(ours, tensor)
        assert list(converted) == adapter.hf_keys(ours)
        hf.update(converted)
    for ours, tensor in state.items():
        assert torch.equal(adapter.from_hf(ours, hf.__getitem__), tensor), ours


def test_names_of_the_qwen3_tensors():
    dense, moe = adapter_of(qwen3.spec, SMALL), adapter_of(qwen3.moe_spec, SMALL_MOE)
    assert dense.hf_keys("layers.2.attention.k_norm.weight") == \
        ["model.layers.2.self_attn.k_norm.weight"]
    assert dense.hf_keys("output.weight") == ["model.embed_tokens.weight"]  # tied
    assert moe.hf_keys("layers.1.moe.router.gate.weight") == ["model.layers.1.mlp.gate.weight"]
    assert moe.hf_keys("layers.1.moe.router.expert_bias") == []
    assert moe.to_hf("layers.1.moe.router.expert_bias", torch.zeros(8)) == {}
    assert moe.hf_keys("layers.0.moe.experts.w3")[7] == \
        "model.layers.0.mlp.experts.7.up_proj.weight"
    with pytest.raises(ValueError, match="'rope_cos' has no Hugging Face qwen3_moe name"):
        moe.hf_keys("rope_cos")


def test_norm_features_are_ordered_like_the_rotated_rows():
    # HF rotates halves of a head: our pair (2i, 2i+1) is its (i, i + head_dim/2)
    adapter = adapter_of(qwen3.spec, SMALL)
    ours = torch.arange(SMALL.head_dim, dtype=torch.float32)
    [theirs] = adapter.to_hf("layers.0.attention.q_norm.weight", ours).values()
    half = SMALL.head_dim // 2
    assert theirs[:3].tolist() == [0, 2, 4] and theirs[half:half + 3].tolist() == [1, 3, 5]


ALL_FLAVORS = [(spec, name) for spec in (qwen3.spec, qwen3.moe_spec) for name in spec.flavors]


@pytest.mark.parametrize("spec,flavor", ALL_FLAVORS, ids=[f"{s.name}-{f}" for s, f in ALL_FLAVORS])
def test_config_round_trip(spec, flavor):
    args = spec.flavors[flavor]
    config = adapter_of(spec, args).config(torch.bfloat16)
    assert spec.adapters.hf_adapter.args_from_config(config) == args
    rewritten = hf_class(spec).config_class.from_dict(config).to_dict()  # transformers' spelling
    assert spec.adapters.hf_adapter.args_from_config(rewritten) == args


def test_refusals_name_everything_in_one_error():
    config = {**adapter_of(qwen3.spec, SMALL).config(torch.float32), "attention_bias": True,
              "use_sliding_window": True, "rope_parameters": {"rope_type": "yarn", "factor": 4.0},
              "rope_scaling": None}
    with pytest.raises(ValueError) as refused:
        qwen3.Qwen3Adapter.args_from_config(config)
    message = str(refused.value)
    for part in ("attention_bias=True", "use_sliding_window=True", "rope_type='yarn'"):
        assert part in message, message
    moe_config = {**adapter_of(qwen3.moe_spec, SMALL_MOE).config(torch.float32),
                  "mlp_only_layers": [0], "decoder_sparse_step": 2}
    with pytest.raises(ValueError, match=re.escape("mlp_only_layers=[0] (only []); "
                                                   "decoder_sparse_step=2 (only 1)")):
        qwen3.Qwen3MoeAdapter.args_from_config(moe_config)
    with pytest.raises(ValueError, match="model_type='qwen3_moe'"):
        qwen3.Qwen3Adapter.args_from_config(moe_config)


def test_export_refuses_moe_features_qwen3_lacks():
    shared = dataclasses.replace(SMALL_MOE, n_shared_experts=1, bias_update_speed=1e-3)
    with pytest.raises(ValueError, match=r"n_shared_experts=1 \(only 0\); bias_update_speed=0.001"):
        adapter_of(qwen3.moe_spec, shared).config(torch.float32)


def test_args_refuse_an_odd_head_dim():
    with pytest.raises(ValueError, match="head_dim=31"):
        dataclasses.replace(SMALL, head_dim=31)
    with pytest.raises(ValueError, match="head_dim=31"):
        dataclasses.replace(SMALL_MOE, attn_head_dim=31)


# ---------------------------------------------------------------- spec

def test_spec_hooks():
    dense, moe = (spec.build_meta(args) for spec, args in CASES.values())
    assert list(qwen3.moe_spec.parallel.moe_modules(moe)) == [f"layers.{i}.moe" for i in range(4)]
    assert qwen3.moe_spec.parallel.moe_modules(dense) == {}
    assert "ffn_hidden_dim" not in qwen3.moe_spec.parallel.tp_divisible(SMALL_MOE)
    assert qwen3.spec.parallel.tp_divisible(SMALL)["ffn_hidden_dim"] == 384
    for spec, args in CASES.values():
        plan = spec.tp_plan
        assert all(k in plan for k in qwen3.QK_NORMS)
        # counted, not the default 0
        assert spec.training.flops_per_token(args, 64) > 6 * 64 * args.dim


# ---------------------------------------------------------------- tensor parallel

def norm_grads(model, tokens) -> dict[str, torch.Tensor]:
    """The q/k norms' whole gradients after one backward of the summed logits."""
    from torch.distributed.tensor import DTensor

    from composer.parallel.tensor import reduce_partial_grads
    logits = model(tokens)
    (logits.full_tensor() if isinstance(logits, DTensor) else logits).sum().backward()
    reduce_partial_grads(list(model.parameters()))  # as the optimizer step does
    return {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for n, p in model.named_parameters() if re.search(r"\.[qk]_norm\.", n)}


def tp_norm_error(spec, mesh, sp: bool, with_norm_entries: bool, tokens, reference) -> float:
    """Worst relative difference of the q/k-norm gradients under tensor parallel."""
    from composer.parallel.tensor import apply_tp, resolve_plan
    model = build(spec, spec.flavors["debug"])
    plan = {k: v for k, v in spec.tp_plan.items()
            if with_norm_entries or k not in qwen3.QK_NORMS}
    apply_tp(model, mesh, resolve_plan(model, plan, sp, False), optional=spec.parallel.tp_optional)
    grads = norm_grads(model, tokens)
    return max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in reference.items())


def distributed_check(out: Path) -> None:
    """On 2 ranks, each family's debug model: the q/k-norm gradients under tensor
    parallel (with and without sequence parallel), with the plan's q/k-norm
    entries and without them; rank 0 records the worst relative differences."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    errors = {}
    for spec in (qwen3.spec, qwen3.moe_spec):
        tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
        reference = norm_grads(build(spec, spec.flavors["debug"]), tokens)
        for sp in (False, True):
            for entries in (True, False):
                key = f"{spec.name} sp={sp} entries={entries}"
                errors[key] = tp_norm_error(spec, mesh, sp, entries, tokens, reference)
    if dist.get_rank() == 0:
        (out / "errors.json").write_text(json.dumps(errors, indent=1))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_qk_norm_gradients_under_tensor_parallel(tmp_path):
    result = launch([str(tmp_path)], nproc=2, timeout=180,
                    program="tests/integration/test_qwen3.py")
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads((tmp_path / "errors.json").read_text())
    assert len(errors) == 8
    for key, error in errors.items():
        # without the entries each rank's gradient holds only its own heads' share
        assert (error < 1e-12) if "entries=True" in key else (error > 0.1), (key, error)


# ---------------------------------------------------------------- LoRA from a Qwen3 folder

def first_batch_loss(theirs, seq_len: int, batch: int) -> float:
    """transformers' mean loss on the trainer's first batch (byte tokenizer, built-in corpus)."""
    from composer.data import DataLoader
    inputs, targets = DataLoader("tinyshakespeare", "byte", seq_len, batch, 0, 1).next_batch()
    with torch.no_grad():
        logits = theirs(inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def test_lora_fine_tunes_from_a_qwen3_folder_and_exports_merged_weights(tmp_path):
    """The trainer reads a transformers Qwen3 folder, puts adapters on the spec's
    targets (wq, wk, wv, wo), starts from the base's loss, and its merged export
    loads in transformers with only the adapted projections changed."""
    from composer.testing.harness import train
    args = qwen3.flavors["debug"]
    theirs = random_hf_model(qwen3.spec, args)
    theirs.save_pretrained(tmp_path / "base")
    rows = train(tmp_path / "run", 1, [
        "--model.name", "qwen3", "--model.converters", "lora", "--training.dtype", "float64",
        "--checkpoint.initial_load_path", str(tmp_path / "base"), "--lora.merge_on_export", "true",
        "--checkpoint.export_dtype", "float64",
        "--training.steps", "3", "--training.local_batch_size", "2", "--data.seq_len", "32",
        "--optimizer.lr", "3e-2", "--metrics.log_freq", "1",
        "--data.document_mask", "false"])  # transformers' reference attends causally
    assert rows[0]["loss"] == pytest.approx(first_batch_loss(theirs, 32, 2), rel=1e-5)
    merged = hf_class(qwen3.spec).from_pretrained(tmp_path / "run" / "checkpoint" / "step-3-hf",
                                                  dtype=torch.float64)
    base = dict(theirs.named_parameters())
    changed = {n for n, p in merged.named_parameters() if not torch.equal(p, base[n])}
    assert (changed and {n.rsplit(".", 2)[-2] for n in changed}
            == {"q_proj", "k_proj", "v_proj", "o_proj"})


if __name__ == "__main__":
    distributed_check(Path(sys.argv[1]))
    gc.collect()  # sharded tensors' cycles go while the interpreter is whole (composer.train.cli)
