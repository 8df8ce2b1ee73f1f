"""The dense Llama-3 family (3, 3.1, 3.2) as a plain nn.Module, and its flavors.

Nothing here knows about distribution. Tensor parallelism shards heads by
sharding the projections, so attention reads the head count from tensor
shapes, never from the arguments. Pipeline stages set ``tok_embeddings``,
``norm`` or ``output`` to None and delete entries of ``layers``; ``forward``
and ``init_weights`` skip whatever is missing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from composer.models.llama.attention import CausalAttention, DocumentMask


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 rotary frequency scaling for long context."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaArgs:
    """Shape of one Llama model; frozen so shared flavors can't be edited by accident
    (derive variants with ``dataclasses.replace``)."""

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    n_kv_heads: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 8192
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim {self.dim} must split into {self.n_heads} heads of even size")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width, Meta's rule: 2/3 of 4*dim, times the multiplier, rounded up."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, float64 stays float64 (parity runs need exactness)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(_compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight

    def init_weights(self):
        nn.init.ones_(self.weight)


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies (float64, one per pair) with Llama-3.1 scaling if configured.

    Wavelengths shorter than original_len/high_freq_factor are kept, those longer
    than original_len/low_freq_factor are divided by ``factor``, and those between
    are interpolated linearly in original_len/wavelength.
    """
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim
    inv_freq = 1.0 / args.rope_theta**exponents
    s = args.rope_scaling
    if s is None:
        return inv_freq
    ratio = s.original_max_position_embeddings * inv_freq / (2 * math.pi)
    smooth = ((ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
    return (1 - smooth) * inv_freq / s.factor + smooth * inv_freq


def rope_tables(args: LlamaArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * inv_freq, shape [max_seq_len, head_dim // 2], float64."""
    positions = torch.arange(args.max_seq_len, dtype=torch.float64)
    angles = torch.outer(positions, rope_inv_freq(args))
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved pairs (0,1), (2,3), ... of x [B, S, H, D] by position.

    cos/sin are [S, D/2], or [B, S, D/2] where each sequence has positions of its
    own; real arithmetic instead of complex numbers because DTensor and
    torch.compile handle real tensors better.
    """
    dtype = _compute_dtype(x.dtype)
    pairs = x.to(dtype).unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos.to(dtype).unsqueeze(-2), sin.to(dtype).unsqueeze(-2)
    rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.core = CausalAttention()
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [batch, seq, heads, head_dim], before the rotary embedding
        (a family that transforms the heads first overrides this)."""
        bs, seqlen, _ = x.shape
        return tuple(w(x).view(bs, seqlen, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        # Shapes, not args, give the head counts and the sequence length: under
        # tensor parallelism a rank holds a slice of the heads, and under
        # sequence parallelism x here is already gathered to the full sequence.
        bs, seqlen, _ = x.shape
        q, k, v = self.project(x)
        cos, sin = cos[..., :seqlen, :], sin[..., :seqlen, :]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

    def init_weights(self, out_std: float):
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, 0.02)
        trunc_normal_(self.wo.weight, out_std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float):
        trunc_normal_(self.w1.weight, 0.02)
        trunc_normal_(self.w2.weight, out_std)
        trunc_normal_(self.w3.weight, out_std)


class TransformerBlock(nn.Module):
    """Pre-norm attention and feed-forward, each added to the residual stream.
    Families change the attention (``make_attention``) or the feed-forward
    (``make_ffn``, which also names it: ``feed_forward``, or e.g. ``moe``)."""

    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = self.make_attention(args)
        self.ffn_name, ffn = self.make_ffn(layer_id, args)
        self.add_module(self.ffn_name, ffn)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def make_attention(self, args: LlamaArgs) -> nn.Module:
        return Attention(args)

    def make_ffn(self, layer_id: int, args: LlamaArgs) -> tuple[str, nn.Module]:
        return "feed_forward", FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + getattr(self, self.ffn_name)(self.ffn_norm(h))

    def init_weights(self):
        out_std = residual_std(self.layer_id)
        self.attention.init_weights(out_std)
        getattr(self, self.ffn_name).init_weights(out_std)
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()


def residual_std(layer_id: int) -> float:
    """Init std of the projections writing into the residual stream: it shrinks
    with depth so the stream's variance does not grow with the number of layers."""
    return 0.02 / math.sqrt(2 * (layer_id + 1))


def trunc_normal_(weight: torch.Tensor, std: float):
    """Normal(0, std) truncated at +-3 std."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Transformer(nn.Module):
    """Llama-3: tokens [B, S] -> logits [B, S, vocab].

    A pipeline stage without ``tok_embeddings`` takes hidden states [B, S, dim];
    one without ``output`` returns hidden states. Subclasses change the block
    through ``block_class``.
    """

    block_class = TransformerBlock

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block_class(i, args)
                                     for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.attention_mask = DocumentMask()
        self._tie_embeddings()
        # Derived from args, so not saved in checkpoints; filled by init_weights.
        table_shape = (args.max_seq_len, args.head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(table_shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table_shape), persistent=False)

    def _tie_embeddings(self):
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        # to_empty() gives each module a new Parameter, which would untie the
        # shared embedding; tie it again after any conversion.
        super()._apply(fn, recurse)
        self._tie_embeddings()
        return self

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` ([S], or [B, S] for positions of each sequence's own): the
        rotary positions of ``tokens``' columns when they are not 0..S-1 (a
        context-parallel rank holds two chunks of the sequence; packed documents
        may each count from 0). ``documents`` ([B, S_whole], the document number of
        each position of the whole sequence): attention stays inside a document."""
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        cos, sin = self.rope_cos, self.rope_sin
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        mask = self.attention_mask(documents, h)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        if self.norm is not None:
            h = self.norm(h)
        return h if self.output is None else self.output(h)

    @torch.no_grad()
    def init_weights(self):
        """Initialise every parameter and buffer from the global torch RNG.

        Untied: embedding N(0, 1), output truncated N(0, dim**-0.5). Tied: the one
        shared matrix gets N(0, dim**-0.5), the output's scale, because N(0, 1)
        would give logits of size sqrt(dim) at the start.
        """
        cos, sin = rope_tables(self.args)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        tied = self.args.tie_embeddings
        output_std = self.args.dim**-0.5
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=output_std if tied else 1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.init_weights()
        if self.output is not None and not (tied and self.tok_embeddings is not None):
            init = nn.init.normal_ if tied else trunc_normal_
            init(self.output.weight, std=output_std)


def non_embedding_params(args: LlamaArgs) -> int:
    """Parameters doing matmul work: all but the input embedding.

    The output projection always counts, tied or not, because it is a real
    matmul even when its weight is shared with the embedding lookup.
    """
    dim, kv_dim = args.dim, args.n_kv_heads * args.head_dim
    attention = 2 * dim * args.n_heads * args.head_dim + 2 * dim * kv_dim
    feed_forward = 3 * dim * args.ffn_hidden_dim
    block = attention + feed_forward + 2 * dim
    return args.n_layers * block + dim + dim * args.vocab_size


def flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 * non_embedding_params(args) for the matmuls
    (forward 2, backward 4) plus 12 * n_layers * n_heads * head_dim * seq_len
    for the attention scores and their weighted sum (causal masking not discounted).
    """
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6 * non_embedding_params(args) + attention


_LLAMA31_SCALING = RopeScaling(factor=8.0)
_LLAMA32_SCALING = RopeScaling(factor=32.0)

flavors: dict[str, LlamaArgs] = {
    "debug": LlamaArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512,
                       multiple_of=64, max_seq_len=2048),
    # the debug model at dim 256: every linear a multiple of NF4's 64 x 256 blocks (QLoRA),
    # twice over for wk/wv, so FSDP2 can shard them over 2 ranks
    "debug256": LlamaArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                          multiple_of=128, max_seq_len=2048),
    "1B": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                    ffn_dim_multiplier=1.5, rope_scaling=_LLAMA32_SCALING, tie_embeddings=True),
    "3B": LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
                    ffn_dim_multiplier=1.0, rope_scaling=_LLAMA32_SCALING, tie_embeddings=True),
    "8B": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                    ffn_dim_multiplier=1.3, multiple_of=1024, rope_scaling=_LLAMA31_SCALING),
    "70B": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                     ffn_dim_multiplier=1.3, multiple_of=4096, rope_scaling=_LLAMA31_SCALING),
    "405B": LlamaArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                      ffn_dim_multiplier=1.2, multiple_of=4096, rope_scaling=_LLAMA31_SCALING),
}
