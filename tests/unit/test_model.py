"""Llama-3 model: shapes, attention math, RoPE, init, parameter counts, FLOPs."""
import copy
import dataclasses
import math

import pytest
import torch

from composer.models import MODELS, get_model_spec, llama
from composer.models.common import Attention, RMSNorm, apply_rotary, rope_inv_freq, rope_tables
from composer.models.llama import LlamaArgs, RopeScaling, Transformer

TINY = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                 multiple_of=16, max_seq_len=32)


def build(args, dtype=torch.float32, seed=0):
    """The trainer's path: meta build, to_empty, seeded init_weights."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to(dtype).to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_debug_flavor_logits_shape():
    model = build(llama.flavors["debug"])
    tokens = torch.randint(0, 258, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 512)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_bfloat16_forward_keeps_dtype():
    model = build(TINY, torch.bfloat16)
    logits = model(torch.randint(0, 64, (1, 8)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_causal_future_tokens_do_not_change_past_logits():
    model = build(TINY, torch.float64)
    tokens = torch.randint(0, 64, (2, 12))
    t = 5
    changed = tokens.clone()
    changed[:, t:] = (changed[:, t:] + 1) % 64
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=1e-12)
    assert (before[:, t:] - after[:, t:]).abs().max() > 1e-3


def complex_rope(x, args):
    """Meta's reference convention: pairs (2i, 2i+1) as complex numbers times e^{i*pos*freq}."""
    seqlen = x.shape[1]
    angles = torch.outer(torch.arange(seqlen, dtype=torch.float64), rope_inv_freq(args))
    rot = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * rot).flatten(-2)


def reference_attention(attn, x, args):
    """Hand-written GQA: explicit repeat of kv heads, explicit mask and softmax."""
    bs, s, _ = x.shape
    hd = args.head_dim
    q = complex_rope((x @ attn.wq.weight.T).view(bs, s, args.n_heads, hd), args)
    k = complex_rope((x @ attn.wk.weight.T).view(bs, s, args.n_kv_heads, hd), args)
    v = (x @ attn.wv.weight.T).view(bs, s, args.n_kv_heads, hd)
    rep = args.n_heads // args.n_kv_heads
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    weights = scores.exp() / scores.exp().sum(-1, keepdim=True)
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(bs, s, -1)
    return out @ attn.wo.weight.T


def test_gqa_attention_matches_hand_written_reference():
    args = dataclasses.replace(TINY, n_heads=8, n_kv_heads=2)
    torch.manual_seed(0)
    attn = Attention(args).double()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    cos, sin = rope_tables(args)
    x = torch.randn(2, 10, args.dim, dtype=torch.float64)
    torch.testing.assert_close(attn(x, cos, sin), reference_attention(attn, x, args),
                               rtol=0, atol=1e-10)


def llama31_scaled_freq(i, head_dim=128, theta=500000.0, factor=8.0, low=1.0, high=4.0,
                        old_len=8192):
    """The Llama 3.1 rule, written per frequency; returns (branch, value)."""
    freq = 1.0 / theta ** (2 * i / head_dim)
    wavelen = 2 * math.pi / freq
    if wavelen < old_len / high:
        return "high", freq
    if wavelen > old_len / low:
        return "low", freq / factor
    smooth = (old_len / wavelen - low) / (high - low)
    return "mid", (1 - smooth) * freq / factor + smooth * freq


@pytest.mark.parametrize("index, branch", [(0, "high"), (10, "high"), (31, "mid"),
                                           (33, "mid"), (50, "low"), (63, "low")])
def test_rope_scaling_8b_matches_llama31_rule(index, branch):
    inv_freq = rope_inv_freq(llama.flavors["8B"])
    assert inv_freq.shape == (64,)
    got_branch, expected = llama31_scaled_freq(index)
    assert got_branch == branch
    assert inv_freq[index].item() == pytest.approx(expected, rel=1e-12)
    unscaled = 1.0 / 500000.0 ** (2 * index / 128)
    if branch == "mid":
        assert unscaled / 8 < inv_freq[index].item() < unscaled


def test_rotation_preserves_norm_and_depends_on_offset_only():
    args = dataclasses.replace(llama.flavors["8B"], max_seq_len=64)
    cos, sin = rope_tables(args)
    torch.manual_seed(0)
    q, k = torch.randn(2, args.head_dim, dtype=torch.float64)
    qs = apply_rotary(q.expand(1, 64, 1, -1), cos, sin)[0, :, 0]
    ks = apply_rotary(k.expand(1, 64, 1, -1), cos, sin)[0, :, 0]
    torch.testing.assert_close(qs.norm(dim=-1), q.norm().expand(64), rtol=1e-14, atol=0)
    dots = qs @ ks.T
    torch.testing.assert_close(dots[1:, 1:], dots[:-1, :-1], rtol=0, atol=1e-12)
    assert (dots[5, 0] - dots[0, 0]).abs() > 1e-3


def test_rotary_matches_complex_reference():
    args = dataclasses.replace(llama.flavors["8B"], max_seq_len=16)
    cos, sin = rope_tables(args)
    x = torch.randn(2, 16, 3, args.head_dim, dtype=torch.float64)
    torch.testing.assert_close(apply_rotary(x, cos, sin), complex_rope(x, args),
                               rtol=0, atol=1e-12)


def test_rmsnorm_math_and_dtypes():
    norm = RMSNorm(16, eps=1e-5).double()
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected, rtol=1e-15, atol=0)
    norm = norm.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    out = norm(xb)
    assert out.dtype == torch.bfloat16
    x32 = xb.float()
    reference = ((x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
                 * norm.weight)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)


def test_tied_embeddings_share_storage_and_count_once():
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    model = build(tied)
    assert model.output.weight is model.tok_embeddings.weight
    untied_count = llama.spec.num_params(TINY)
    assert llama.spec.num_params(tied) == untied_count - TINY.vocab_size * TINY.dim
    assert sum(p.numel() for p in model.parameters()) == llama.spec.num_params(tied)
    assert model.output.weight.std().item() == pytest.approx(TINY.dim**-0.5, rel=0.2)
    assert llama.flops_per_token(tied, 16) == llama.flops_per_token(TINY, 16)


PUBLISHED = {"1B": 1_235_814_400, "3B": 3_212_749_824, "8B": 8_030_261_248,
             "70B": 70_553_706_496, "405B": 405_853_388_800}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_published_parameter_counts(flavor):
    args = llama.flavors[flavor]
    count = llama.spec.num_params(args)
    print(f"{flavor}: {count:,} parameters")
    assert abs(count - PUBLISHED[flavor]) <= 0.01 * PUBLISHED[flavor]
    assert count == PUBLISHED[flavor]
    embedding = args.vocab_size * args.dim
    untied_total = count + (embedding if args.tie_embeddings else 0)
    assert llama.non_embedding_params(args) == untied_total - embedding


def test_ffn_hidden_dims_of_published_flavors():
    hidden = {name: llama.flavors[name].ffn_hidden_dim for name in PUBLISHED}
    assert hidden == {"1B": 8192, "3B": 8192, "8B": 14336, "70B": 28672, "405B": 53248}
    assert llama.flavors["debug"].ffn_hidden_dim == 384


def test_pipeline_stages_compose_to_full_model():
    model = build(TINY, torch.float64)
    tokens = torch.randint(0, 64, (2, 8))
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    first.norm = first.output = None
    del first.layers["1"]
    last.tok_embeddings = None
    del last.layers["0"]
    hidden = first(tokens)
    assert hidden.shape == (2, 8, TINY.dim)
    torch.testing.assert_close(last(hidden), model(tokens), rtol=0, atol=0)


def test_stage_init_weights_skips_missing_modules():
    with torch.device("meta"):
        stage = Transformer(dataclasses.replace(TINY, tie_embeddings=True))
    stage.tok_embeddings = None
    del stage.layers["0"]
    stage.to_empty(device="cpu")
    stage.init_weights()
    assert all(torch.isfinite(p).all() for p in stage.parameters())
    assert list(stage.layers) == ["1"]


def init_fresh(args, seed, garbage):
    """Meta build, to_empty, fill every tensor with garbage, then init_weights."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(garbage)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_init_weights_covers_everything_and_is_reproducible():
    args = llama.flavors["debug"]
    a, b = init_fresh(args, 7, float("nan")), init_fresh(args, 7, 1e30)
    for name, t in [*a.named_parameters(), *a.named_buffers()]:
        assert torch.isfinite(t).all(), name
    tensors_b = dict([*b.named_parameters(), *b.named_buffers()])
    for name, t in [*a.named_parameters(), *a.named_buffers()]:
        assert torch.equal(t, tensors_b[name]), name
    other = init_fresh(args, 8, 0.0)
    assert not torch.equal(a.layers["0"].attention.wq.weight, other.layers["0"].attention.wq.weight)


def test_init_weights_follows_the_scheme():
    args = llama.flavors["debug"]
    model = build(args)

    def std(t):
        return t.std().item()

    assert std(model.tok_embeddings.weight) == pytest.approx(1.0, rel=0.05)
    assert std(model.output.weight) == pytest.approx(args.dim**-0.5, rel=0.05)
    assert model.output.weight.abs().max() <= 3 * args.dim**-0.5
    for layer_id, layer in model.layers.items():
        depth_std = 0.02 / math.sqrt(2 * (int(layer_id) + 1))
        for w in ("wq", "wk", "wv"):
            assert std(getattr(layer.attention, w).weight) == pytest.approx(0.02, rel=0.2)
        assert std(layer.feed_forward.w1.weight) == pytest.approx(0.02, rel=0.2)
        assert std(layer.attention.wo.weight) == pytest.approx(depth_std, rel=0.2)
        assert std(layer.feed_forward.w2.weight) == pytest.approx(depth_std, rel=0.2)
        assert std(layer.feed_forward.w3.weight) == pytest.approx(depth_std, rel=0.2)
        assert torch.equal(layer.attention_norm.weight, torch.ones(args.dim))
    cos, sin = rope_tables(args)
    torch.testing.assert_close(model.rope_cos, cos.float(), rtol=0, atol=0)
    torch.testing.assert_close(model.rope_sin, sin.float(), rtol=0, atol=0)
    assert "rope_cos" not in model.state_dict()


def test_flops_per_token_8b():
    args = llama.flavors["8B"]
    non_embedding = 8_030_261_248 - 128256 * 4096
    expected = 6 * non_embedding + 12 * 32 * 32 * 128 * 8192
    assert llama.flops_per_token(args, 8192) == expected


def test_registry_and_blocks():
    assert MODELS["llama3"] is llama.spec
    model = llama.spec.build_meta(TINY)
    assert llama.spec.blocks(model) == [model.layers["0"], model.layers["1"]]
    with pytest.raises(KeyError, match="llama3"):
        get_model_spec("gpt2")


def test_args_validation_and_defaults():
    assert LlamaArgs(dim=64, n_layers=1, n_heads=4, vocab_size=8).n_kv_heads == 4
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=3, vocab_size=8)
    with pytest.raises(ValueError, match="heads"):
        LlamaArgs(dim=60, n_layers=1, n_heads=8, vocab_size=8)
    assert llama.flavors["1B"].rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
