"""The dense Llama-3 family (3, 3.1, 3.2): its arguments, its flavors and its
cost. The model is the shared decoder (``composer.models.common``) as it is:
``Transformer`` with ``TransformerBlock``, grouped-query attention with
Llama-3.1's rotary scaling and a SwiGLU feed-forward. Nothing here knows about
distribution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from composer.models.common.rotary import RopeScaling


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
            raise ValueError(f"n_heads {self.n_heads} must be a multiple of "
                             f"n_kv_heads {self.n_kv_heads}")

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
