"""The decoder: embedding, the blocks in ``layers`` (keyed "0".."N-1", so a
pipeline stage can delete some and the checkpoint names stay), the final norm
and the output projection. Pipeline stages set ``tok_embeddings``, ``norm`` or
``output`` to None and delete entries of ``layers``; ``forward`` and
``init_weights`` skip whatever is missing."""
from __future__ import annotations

import torch
from torch import nn

from composer import torch_compat
from composer.models.common.args import DecoderArgs
from composer.models.common.block import TransformerBlock
from composer.models.common.init import trunc_normal_
from composer.models.common.mask import DocumentMask
from composer.models.common.norm import RMSNorm
from composer.models.common.rotary import rope_tables


class Transformer(torch_compat.AfterApplyHook, nn.Module):
    """A pre-norm decoder (Llama-3's, and the base of every family here):
    tokens [B, S] -> logits [B, S, vocab].

    A pipeline stage without ``tok_embeddings`` takes hidden states [B, S, dim];
    one without ``output`` returns hidden states. Subclasses change the block
    through ``block_class``.
    """

    block_class = TransformerBlock

    def __init__(self, args: DecoderArgs):
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

    def after_apply(self) -> None:
        # to_empty() gives each module a new Parameter, which would untie the
        # shared embedding; tie it again after any conversion.
        self._tie_embeddings()

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
