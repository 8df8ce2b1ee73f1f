"""Your own model, trained by composer's own trainer: an OPT-style decoder written
from scratch, with names, norms and an MLP of its own.

    python -m composer.train --config examples/my_model.toml
    torchrun --nproc_per_node=4 -m composer.train --config examples/my_model.toml \\
        --parallelism.tensor_parallel_degree 2

``model.name = "examples.my_model:spec"`` names the spec at the bottom of this file
(the module is imported, so its code runs). The model is plain PyTorch: LayerNorms and
linears with biases, a ReLU MLP, learned positions, a head tied to the token
embedding or not. Everything composer needs to know comes from the spec: the blocks
(FSDP, activation checkpointing, compile), the tensor-parallel plan, the pipeline
units, the attention core and mask (context parallel, packed documents) and the
Hugging Face layout (OPT's, so ``transformers`` loads what composer exports).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from composer import Adapters, ModelSpec, ParallelHooks, StateDictAdapter, TrainingHooks


@dataclass(frozen=True)
class MyArgs:
    vocab_size: int = 512
    dim: int = 64
    n_heads: int = 4
    n_layers: int = 4
    hidden: int = 256
    max_seq_len: int = 512
    tied: bool = True
    eps: float = 1e-5

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not a multiple of n_heads={self.n_heads}")


class Attend(nn.Module):
    """Causal softmax attention on [batch, heads, seq, head_dim], within what ``mask``
    allows. No weights: a module of its own so that context parallel can put its
    own in its place."""

    def forward(self, q, k, v, mask=None):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))


class SameDocument(nn.Module):
    """Packed documents [batch, seq] -> the additive mask every ``Attend`` gets: a
    query sees the keys of its own document at or before it (None: plain causal)."""

    def forward(self, documents, like):
        if documents is None:
            return None
        seq = documents.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
        allowed = (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]
        return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill(
            ~allowed, float("-inf"))


class SelfAttention(nn.Module):
    def __init__(self, a: MyArgs):
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(a.dim, a.dim) for _ in range(4))
        self.attend = Attend()

    def forward(self, x, mask):
        b, s, _ = x.shape  # the shapes give the heads: tensor parallel leaves a rank some
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        return self.o(self.attend(q, k, v, mask).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, a: MyArgs):
        super().__init__()
        self.up, self.down = nn.Linear(a.dim, a.hidden), nn.Linear(a.hidden, a.dim)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


class Block(nn.Module):
    def __init__(self, a: MyArgs):
        super().__init__()
        self.norm_attn, self.attn = nn.LayerNorm(a.dim, eps=a.eps), SelfAttention(a)
        self.norm_mlp, self.mlp = nn.LayerNorm(a.dim, eps=a.eps), MLP(a)

    def forward(self, x, mask):
        x = x + self.attn(self.norm_attn(x), mask)
        return x + self.mlp(self.norm_mlp(x))


class MyModel(nn.Module):
    def __init__(self, a: MyArgs):
        super().__init__()
        self.tok, self.pos = nn.Embedding(a.vocab_size, a.dim), nn.Embedding(a.max_seq_len, a.dim)
        self.same_document = SameDocument()
        # a dict keyed "0".."N-1": a pipeline stage deletes the blocks it does not
        # hold and the others keep their names (and checkpoint keys)
        self.blocks = nn.ModuleDict({str(i): Block(a) for i in range(a.n_layers)})
        self.norm_out = nn.LayerNorm(a.dim, eps=a.eps)
        self.head = nn.Linear(a.dim, a.vocab_size, bias=False)
        if a.tied:
            self.head.weight = self.tok.weight

    def forward(self, tokens, documents=None, positions=None):
        """``tokens`` [batch, seq] (or, on a later pipeline stage, the hidden states);
        ``documents``: each position's document number, for the mask; ``positions``:
        the positions of the columns held (context parallel), default 0..seq-1. A
        module a pipeline stage does not hold is None and skipped."""
        h = tokens
        if self.tok is not None:
            if positions is None:
                positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
            h = self.tok(tokens) + self.pos(positions)
        mask = self.same_document(documents, h)
        for block in self.blocks.values():
            h = block(h, mask)
        if self.norm_out is not None:
            h = self.norm_out(h)
        return h if self.head is None else self.head(h)

    def init_weights(self):
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()


# Tensor parallel as data: q/k/v and up shard their output features, o and down
# their input features; the two embeddings shard their rows and write the residual
# stream (sequence-sharded with sequence parallel), the head shards the vocabulary.
TP_PLAN = {
    "tok": "embedding", "pos": "embedding",
    "blocks.*.norm_attn": "norm", "blocks.*.norm_mlp": "norm", "norm_out": "norm",
    "blocks.*.attn": "replicate_input", "blocks.*.mlp": "replicate_input",
    "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise",
    "head": "output",
}


def flops_per_token(a: MyArgs, seq_len: int) -> float:
    """Training FLOPs a token (forward + backward: 3 x 2 x the matmul weights, plus
    attention's scores and sums over the causal half of the sequence)."""
    matmuls = a.n_layers * (4 * a.dim * a.dim + 2 * a.dim * a.hidden) + a.dim * a.vocab_size
    return 6 * matmuls + 6 * a.n_layers * a.dim * seq_len


class OPTLayout(StateDictAdapter):
    """Our names <-> transformers' ``OPTForCausalLM``. OPT's position table starts
    with two rows no position uses (its offset of 2); a tied head is not stored."""

    model_type = "opt"
    OFFSET = 2
    TOP = {"tok.weight": "model.decoder.embed_tokens.weight",
           "pos.weight": "model.decoder.embed_positions.weight",
           "norm_out.weight": "model.decoder.final_layer_norm.weight",
           "norm_out.bias": "model.decoder.final_layer_norm.bias",
           "head.weight": "lm_head.weight"}
    BLOCK = {"norm_attn": "self_attn_layer_norm", "attn.q": "self_attn.q_proj",
             "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
             "attn.o": "self_attn.out_proj", "norm_mlp": "final_layer_norm",
             "mlp.up": "fc1", "mlp.down": "fc2"}

    @classmethod
    def args_from_config(cls, config: dict) -> MyArgs:
        expected = {"do_layer_norm_before": True, "activation_function": "relu",
                    "enable_bias": True, "word_embed_proj_dim": config["hidden_size"]}
        for key, value in expected.items():
            if config.get(key, value) != value:
                raise ValueError(f"config {key}={config[key]!r} is not supported (only {value!r})")
        return MyArgs(vocab_size=config["vocab_size"], dim=config["hidden_size"],
                      n_heads=config["num_attention_heads"], n_layers=config["num_hidden_layers"],
                      hidden=config["ffn_dim"], max_seq_len=config["max_position_embeddings"],
                      tied=config.get("tie_word_embeddings", True))

    def config(self, dtype: torch.dtype) -> dict:
        a = self.args
        name = str(dtype).removeprefix("torch.")
        return {"architectures": ["OPTForCausalLM"], "model_type": "opt",
                "vocab_size": a.vocab_size, "hidden_size": a.dim, "word_embed_proj_dim": a.dim,
                "num_attention_heads": a.n_heads, "num_hidden_layers": a.n_layers,
                "ffn_dim": a.hidden, "max_position_embeddings": a.max_seq_len,
                "tie_word_embeddings": a.tied, "do_layer_norm_before": True,
                "activation_function": "relu", "enable_bias": True, "dropout": 0.0,
                "attention_dropout": 0.0, "layerdrop": 0.0, "dtype": name, "torch_dtype": name}

    def hf_keys(self, ours: str) -> list[str]:
        if ours == "head.weight" and self.args.tied:
            ours = "tok.weight"
        if ours in self.TOP:
            return [self.TOP[ours]]
        _, layer, rest = ours.split(".", 2) if ours.startswith("blocks.") else ("", "", "")
        module, _, kind = rest.rpartition(".")
        if module not in self.BLOCK:
            raise ValueError(f"{ours!r} has no Hugging Face OPT name")
        return [f"model.decoder.layers.{layer}.{self.BLOCK[module]}.{kind}"]

    def to_hf(self, ours: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if ours == "pos.weight":
            tensor = torch.cat([tensor.new_zeros(self.OFFSET, tensor.shape[1]), tensor])
        return {self.hf_keys(ours)[0]: tensor}

    def from_hf(self, ours: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        tensor = get(self.hf_keys(ours)[0])
        return tensor[self.OFFSET:] if ours == "pos.weight" else tensor


spec = ModelSpec(
    name="my_model",
    flavors={"tiny": MyArgs(), "tiny_untied": MyArgs(tied=False),
             "small": MyArgs(vocab_size=4096, dim=256, n_heads=8, n_layers=8, hidden=1024,
                             max_seq_len=1024)},
    build=MyModel,
    blocks=lambda model: list(model.blocks.values()),
    tp_plan=TP_PLAN,
    parallel=ParallelHooks(
        tp_divisible=lambda a: {"n_heads": a.n_heads, "vocab_size": a.vocab_size,
                                "hidden": a.hidden, "max_seq_len": a.max_seq_len},
        pipeline_units=lambda model: ["tok", "pos", *(f"blocks.{k}" for k in model.blocks),
                                      "norm_out", "head"],
        pipeline_pass_through=False,  # its forward skips what a stage does not hold
        attention_cores=lambda model: [f"blocks.{k}.attn.attend" for k in model.blocks],
        attention_mask="same_document",
        heads=lambda a: {"n_heads": a.n_heads, "n_kv_heads": a.n_heads},
    ),
    training=TrainingHooks(flops_per_token=flops_per_token),
    adapters=Adapters(logits_modules=("head",), lora_targets=("q", "v", "o", "up", "down"),
                      hf_adapter=OPTLayout),
)
