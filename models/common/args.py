"""What the shared decoder pieces read of a family's model arguments."""
from __future__ import annotations

from typing import Any, Protocol


class DecoderArgs(Protocol):
    """The sizes of a pre-norm decoder. A family's own arguments (``LlamaArgs``
    and its subclasses) provide them, as fields or as properties; the pieces
    name this protocol so that they depend on no family."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    ffn_hidden_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling: Any  # a RopeScaling, or None
    max_seq_len: int
    tie_embeddings: bool
