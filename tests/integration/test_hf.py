"""Hugging Face import/export: logits parity with transformers' LlamaForCausalLM,
bit-exact round trips (one file and sharded), the in-run loader on plain and
sharded models, and composer-convert-hf in both directions.

Run as a script under torchrun, this file is also the 2-rank check of loading
into and exporting from FSDP- and TP-sharded models:

    torchrun --nproc_per_node=2 tests/integration/test_hf.py OUT_FOLDER
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
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from composer.checkpoint.hf import (
    export_hf,
    from_hf,
    hf_names,
    load_hf_into,
    open_hf,
    save_hf,
    to_hf,
)
from composer.models import llama
from composer.models.common import RopeScaling, rope_inv_freq
from composer.models.llama.hf import LlamaAdapter, args_from_hf_config, hf_config, hf_name, our_name
from composer.parallel.tensor import resolve_plan
from composer.testing.harness import ROOT, launch
from composer.tools import convert_hf

# dcp.save / dcp.load without a process group: what these tests mean to do
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SMALL = dataclasses.replace(llama.flavors["debug"], max_seq_len=64)
VARIANTS = {
    "gqa": SMALL,  # 8 heads, 4 kv heads
    # original length 16 < 64: one frequency is interpolated, the others divided
    "rope_scaling": dataclasses.replace(SMALL, rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)),
    "tied": dataclasses.replace(SMALL, tie_embeddings=True),
}
SHARD_BYTES = 300_000  # about a dozen shards for the float32 debug model


def build(args, dtype=torch.float32, seed=0):
    """The trainer's path: meta build, to_empty, seeded init_weights."""
    model = llama.spec.build_meta(args).to(dtype).to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def save_model_hf(folder, args, config: dict | None = None) -> dict[str, torch.Tensor]:
    """The seeded float32 model of ``args`` as a Hugging Face folder; returns our state."""
    state = build(args).state_dict()
    save_hf(folder, to_hf(state, LlamaAdapter(args)), config or hf_config(args, torch.float32))
    return state


def read_all(folder) -> dict[str, torch.Tensor]:
    _, get = open_hf(folder)
    return {name: get(name) for name in hf_names(folder)}


def assert_equal_states(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


# ---------------------------------------------------------------- names and config

def test_every_name_maps_and_back():
    for variant in ("gqa", "tied"):
        args = VARIANTS[variant]
        for ours in llama.spec.build_meta(args).state_dict():
            hf = hf_name(ours, args)
            tied_output = ours == "output.weight" and args.tie_embeddings
            assert our_name(hf) == ("tok_embeddings.weight" if tied_output else ours)
    assert hf_name("layers.3.feed_forward.w1.weight", SMALL) == \
        "model.layers.3.mlp.gate_proj.weight"
    with pytest.raises(ValueError, match="rope_cos"):
        hf_name("rope_cos", SMALL)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_norm.weight"):
        our_name("model.layers.0.self_attn.q_norm.weight")


def same_model_args(a, b) -> bool:
    fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim",
              "norm_eps", "rope_theta", "rope_scaling", "max_seq_len", "tie_embeddings")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


@pytest.mark.parametrize("name", [*llama.flavors, *VARIANTS])
def test_args_from_hf_config_inverts_hf_config(name):
    from transformers import LlamaConfig
    args = llama.flavors.get(name) or VARIANTS[name]
    config = hf_config(args, torch.bfloat16)
    assert same_model_args(args_from_hf_config(config), args)
    # as transformers itself would write it again (rope_parameters only, "dtype")
    rewritten = LlamaConfig(**config).to_dict()
    assert same_model_args(args_from_hf_config(rewritten), args)
    assert rewritten["rope_parameters"]["rope_type"] == \
        ("llama3" if args.rope_scaling else "default")


def test_hf_config_of_8B_and_1B_has_the_published_values():
    c = hf_config(llama.flavors["8B"], torch.bfloat16)
    assert (c["intermediate_size"], c["num_key_value_heads"], c["head_dim"], c["rope_theta"]) == \
        (14336, 8, 128, 500000.0)
    assert c["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    c = hf_config(llama.flavors["1B"], torch.bfloat16)
    assert (c["intermediate_size"], c["tie_word_embeddings"], c["rope_parameters"]["factor"]) == \
        (8192, True, 32.0)


@pytest.mark.parametrize("key,value,message", [
    ("hidden_act", "gelu", "hidden_act='gelu'"), ("mlp_bias", True, "mlp_bias=True"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'")])
def test_args_from_hf_config_refuses_what_we_cannot_express(key, value, message):
    config = {**hf_config(SMALL, torch.float32), key: value, "rope_scaling": None}
    with pytest.raises(ValueError, match=re.escape(message)):
        args_from_hf_config(config)


# ---------------------------------------------------------------- logits parity

def lift_float32(hf_model, inv_freq: torch.Tensor) -> None:
    """transformers computes RMSNorm and the rotary tables in float32 even in a
    float64 model (about 1e-7 relative); compute both in float64 instead, the
    tables from ``inv_freq``, so the remaining difference is the weights' alone."""
    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                              + self.variance_epsilon))

    def rotary(self, x, position_ids):
        angles = position_ids[..., None].to(inv_freq.dtype) * inv_freq
        both = torch.cat((angles, angles), dim=-1)
        return both.cos().to(x.dtype), both.sin().to(x.dtype)

    for module in hf_model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = types.MethodType(norm, module)
    rotary_emb = hf_model.model.rotary_emb
    rotary_emb.forward = types.MethodType(rotary, rotary_emb)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(tmp_path, variant):
    from transformers import LlamaForCausalLM
    args = VARIANTS[variant]
    ours = build(args, torch.float64)
    save_hf(tmp_path, to_hf(ours.state_dict(), LlamaAdapter(args)), hf_config(args, torch.float64))
    theirs = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    # transformers read the rope config as we meant it (to its float32 precision)
    torch.testing.assert_close(theirs.model.rotary_emb.inv_freq.double(), rope_inv_freq(args),
                               rtol=1e-6, atol=0)
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(tokens)
        scale = expected.abs().max().item()
        stock = theirs(tokens).logits
        lift_float32(theirs, rope_inv_freq(args))
        lifted = theirs(tokens).logits
    torch.testing.assert_close(stock, expected, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(lifted, expected, rtol=1e-9, atol=1e-9 * scale)
    assert theirs.lm_head.weight is theirs.model.embed_tokens.weight or not args.tie_embeddings


def test_rope_scaling_variant_changes_frequencies():
    assert not torch.allclose(rope_inv_freq(VARIANTS["rope_scaling"]), rope_inv_freq(SMALL))


# ---------------------------------------------------------------- round trips and files

@pytest.mark.parametrize("variant,shard_bytes", [("gqa", 5 * 2**30), ("gqa", SHARD_BYTES),
                                                 ("tied", SHARD_BYTES)])
def test_round_trip_is_bit_identical(tmp_path, variant, shard_bytes):
    args = VARIANTS[variant]
    state = build(args).state_dict()
    folder = tmp_path / "hf"
    save_hf(folder, to_hf(state, LlamaAdapter(args)), hf_config(args, torch.float32),
            max_shard_bytes=shard_bytes)
    back = from_hf(read_all(folder), LlamaAdapter(args), state)
    assert_equal_states(back, state)
    llama.spec.build_meta(args).load_state_dict(back, assign=True)  # strict: nothing missing
    files = sorted(p.name for p in folder.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left
    if shard_bytes > 2**30:
        assert files == ["config.json", "model.safetensors"]
        return
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 3 and files == sorted(["config.json",
                                                "model.safetensors.index.json", *shards])
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    assert ("lm_head.weight" in weight_map) == (not args.tie_embeddings)


def test_save_hf_replaces_a_folder_whole_or_not_at_all(tmp_path):
    folder = tmp_path / "hf"
    (folder / "stale").mkdir(parents=True)
    state = to_hf(build(SMALL).state_dict(), LlamaAdapter(SMALL))
    save_hf(folder, state, hf_config(SMALL, torch.float32), files=[ROOT / "pyproject.toml"])
    assert sorted(p.name for p in folder.iterdir()) == \
        ["config.json", "model.safetensors", "pyproject.toml"]
    with pytest.raises(FileNotFoundError):  # after every shard is written
        save_hf(folder, state, {}, max_shard_bytes=SHARD_BYTES, files=[tmp_path / "missing.json"])
    assert sorted(p.name for p in folder.iterdir()) == \
        ["config.json", "model.safetensors", "pyproject.toml"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


@pytest.mark.parametrize("variant", ["gqa", "tied"])
def test_export_hf_casts_and_shards(tmp_path, variant):
    args = VARIANTS[variant]
    model = build(args)
    export_hf(model, tmp_path / "hf", llama.spec, args, torch.bfloat16,
              max_shard_bytes=SHARD_BYTES // 2)
    expected = {k: v.to(torch.bfloat16)
                for k, v in to_hf(model.state_dict(), LlamaAdapter(args)).items()}
    assert_equal_states(read_all(tmp_path / "hf"), expected)
    config, _ = open_hf(tmp_path / "hf")
    assert config["dtype"] == "bfloat16" and same_model_args(args_from_hf_config(config), args)
    export_hf(model, tmp_path / "none", llama.spec, args, torch.bfloat16, write=False)
    assert not (tmp_path / "none").exists()


def test_export_hf_refuses_a_pipeline_stage(tmp_path):
    stage = build(SMALL)
    stage.output = None
    with pytest.raises(ValueError, match="export needs the whole model; missing .'output.weight'"):
        export_hf(stage, tmp_path / "hf", llama.spec, SMALL, torch.float32)


# ---------------------------------------------------------------- the in-run loader

@pytest.mark.parametrize("variant", ["gqa", "tied"])
def test_load_hf_into_gives_the_original_weights(tmp_path, variant):
    args = VARIANTS[variant]
    original = save_model_hf(tmp_path, args)
    model = build(args, seed=1)
    load_hf_into(model, tmp_path, LlamaAdapter(args))
    assert_equal_states(model.state_dict(), original)
    assert model.output.weight is model.tok_embeddings.weight or not args.tie_embeddings


def test_load_hf_into_a_pipeline_stage(tmp_path):
    original = save_model_hf(tmp_path, SMALL)
    stage = build(SMALL, seed=1)
    stage.tok_embeddings = None
    del stage.layers["0"]
    load_hf_into(stage, tmp_path, LlamaAdapter(SMALL))
    assert_equal_states(stage.state_dict(), {k: original[k] for k in stage.state_dict()})


def test_load_hf_into_names_a_shape_mismatch_and_a_missing_tensor(tmp_path):
    save_model_hf(tmp_path / "wide", dataclasses.replace(SMALL, vocab_size=1024))
    shapes = r"tok_embeddings\.weight.*embed_tokens.*\(512, 128\).*\(1024, 128\)"
    with pytest.raises(ValueError, match=shapes):
        load_hf_into(build(SMALL), tmp_path / "wide", LlamaAdapter(SMALL))
    state = to_hf(build(SMALL).state_dict(), LlamaAdapter(SMALL))
    del state["model.layers.2.mlp.up_proj.weight"]
    save_hf(tmp_path / "holey", state, hf_config(SMALL, torch.float32))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_hf_into(build(SMALL), tmp_path / "holey", LlamaAdapter(SMALL))


def shard_fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def shard_tp(model, mesh):
    from torch.distributed.tensor.parallel import parallelize_module
    parallelize_module(model, mesh, resolve_plan(model, llama.TP_PLAN, False, False))


def full(param) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param


def distributed_check(out: Path) -> None:
    """On every rank: load the debug model into FSDP- and TP-sharded copies and
    export them again (rank 0 writes); each rank records if its copies are exact."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reference = build(SMALL).state_dict()
    if rank == 0:
        save_hf(out / "hf", to_hf(reference, LlamaAdapter(SMALL)), hf_config(SMALL, torch.float32))
    dist.barrier()
    exact = {}
    for name, shard in (("fsdp", shard_fsdp), ("tp", shard_tp)):
        model = llama.spec.build_meta(SMALL)
        shard(model, mesh)
        model.to_empty(device="cpu")
        load_hf_into(model, out / "hf", LlamaAdapter(SMALL))
        exact[name] = all(torch.equal(full(p), reference[n]) for n, p in model.named_parameters())
        export_hf(model, out / name, llama.spec, SMALL, torch.float32,
                  write=rank == 0, max_shard_bytes=SHARD_BYTES)
    (out / f"rank{rank}.json").write_text(json.dumps(exact))
    # every rank's sends have landed before any rank tears its groups down (seen
    # once in about 30 runs: a rank aborting in teardown, after all its work)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_models_load_and_export_exactly(tmp_path):
    result = launch([str(tmp_path)], nproc=2, timeout=180, program="tests/integration/test_hf.py")
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"fsdp": True, "tp": True}
    expected = to_hf(build(SMALL).state_dict(), LlamaAdapter(SMALL))
    for name in ("fsdp", "tp"):
        assert_equal_states(read_all(tmp_path / name), expected)


# ---------------------------------------------------------------- the converter script

def run_script(*args):
    return launch(list(map(str, args)), timeout=120, program="composer.tools.convert_hf")


def load_script():
    return convert_hf


def save_dcp(folder: Path, model) -> None:
    dcp.save({"model": model.state_dict(), "train": {"step": torch.tensor(7)}},
             checkpoint_id=folder)


def test_convert_script_round_trip(tmp_path):
    args = llama.flavors["debug"]
    original = build(args)
    save_dcp(tmp_path / "ckpt", original)
    result = run_script("to-hf", tmp_path / "ckpt", tmp_path / "hf", "--model", "llama3",
                        "--flavor", "debug", "--dtype", "float32")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_equal_states(read_all(tmp_path / "hf"), to_hf(original.state_dict(), LlamaAdapter(args)))
    result = run_script("from-hf", tmp_path / "hf", tmp_path / "back")
    assert result.returncode == 0, result.stderr[-3000:]
    back = build(args, seed=1)
    dcp.load({"model": back.state_dict()}, checkpoint_id=tmp_path / "back")
    assert_equal_states(back.state_dict(), original.state_dict())


def test_convert_script_bad_input_exits_2_with_one_line(tmp_path):
    result = run_script("to-hf", tmp_path / "missing", tmp_path / "hf", "--flavor", "debug")
    assert result.returncode == 2
    assert (result.stderr.strip().count("\n") == 0
            and result.stderr.startswith("error: ")), result.stderr
    assert "missing" in result.stderr


def exit_status(main, argv) -> int:
    """main's return value, or the status it exits with (argument errors)."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


def test_convert_script_errors_name_the_problem(tmp_path, capsys):
    main = load_script().main
    wider = dataclasses.replace(llama.flavors["debug"], vocab_size=1024)
    save_dcp(tmp_path / "ckpt", build(wider))
    save_model_hf(tmp_path / "wide", wider)
    save_model_hf(tmp_path / "deep", dataclasses.replace(SMALL, n_layers=5))
    no_width = {k: v for k, v in hf_config(SMALL, torch.float32).items()
                if k != "intermediate_size"}
    save_model_hf(tmp_path / "no_width", SMALL, no_width)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    cases = [
        (["to-hf", ckpt, out, "--flavor", "huge"], "unknown flavor 'huge'"),
        (["to-hf", ckpt, out, "--flavor", "debug"],
         r"tok_embeddings\.weight.*\(512, 128\).*\(1024, 128\)"),
        (["to-hf", ckpt, out, "--flavor", "debug", "--dtype", "int8"], "unknown dtype"),
        (["from-hf", tmp_path / "wide", out, "--flavor", "debug"],
         r"tok_embeddings\.weight.*embed_tokens"),
        (["from-hf", tmp_path / "deep", out, "--flavor", "debug"], r"model\.layers\.4\."),
        (["from-hf", tmp_path / "missing", out], "no config.json"),
        (["from-hf", tmp_path / "no_width", out], "config.json has no 'intermediate_size'"),
        (["from-hf", tmp_path / "wide", out, "--model", "moe"],
         r"--model moe: it has no Hugging Face adapter"),
        (["from-hf", tmp_path / "wide", out, "--model", "lama3"], r"did you mean 'llama3'"),
    ]
    capsys.readouterr()
    for argv, message in cases:
        assert exit_status(main, list(map(str, argv))) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.match(rf"error: .*{message}", err), (argv, err)
    assert not out.exists()


def test_no_pickle_loading():
    """User weights come from safetensors or DCP; nothing unpickles a user file."""
    sources = [p for folder in ("composer", "models", "scripts")
               for p in (ROOT / folder).rglob("*.py")]
    assert len(sources) > 20
    for path in sources:
        text = path.read_text()
        assert "pickle.load" not in text, path
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (path, call)


if __name__ == "__main__":
    distributed_check(Path(sys.argv[1]))
    gc.collect()  # sharded tensors' cycles go while the interpreter is whole (composer.train.cli)
