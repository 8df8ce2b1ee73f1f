"""The Llama-3 family: its arguments and flavors (``model.py``; the model is
the shared decoder of ``composer.models.common``), its Hugging Face layout
(``hf.py``) and what the passes need to know about it (the spec, below)."""
from __future__ import annotations

from composer.models.common.decoder import Transformer
from composer.models.common.rotary import RopeScaling
from composer.models.llama.hf import LlamaAdapter
from composer.models.llama.model import LlamaArgs, flavors, flops_per_token, non_embedding_params
from composer.spec import Adapters, ModelSpec, ParallelHooks, TrainingHooks, TransformerShape

# How tensor parallel cuts Llama (styles named in composer.parallel.tensor; the
# modules never see it). q/k/v and w1/w3 are column-wise (each rank gets whole
# heads / hidden features), o and w2 row-wise (their partial sums are reduced).
# The embedding is cut along the vocabulary (the large dim; its partial output
# reduces straight into the sequence-parallel layout). With sequence parallel
# the residual stream and the norms hold 1/tp of the sequence; the output
# projection is column-wise over the vocabulary, and with loss parallel its
# logits stay sharded for the cross-entropy.
TP_PLAN = {
    "tok_embeddings": "embedding",
    "output": "output",
    "norm": "norm",
    "layers.*.attention_norm": "norm",
    "layers.*.ffn_norm": "norm",
    "layers.*.attention": "replicate_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward": "replicate_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
}


def tp_divisible(args: LlamaArgs) -> dict[str, int]:
    return {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
            "vocab_size": args.vocab_size, "ffn_hidden_dim": args.ffn_hidden_dim}


def shape(args: LlamaArgs) -> TransformerShape:
    return TransformerShape(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                            n_kv_heads=args.n_kv_heads, head_dim=args.head_dim,
                            vocab_size=args.vocab_size, ffn_hidden=args.ffn_hidden_dim)


def attention_cores(model: Transformer) -> list[str]:
    return [f"layers.{k}.attention.core" for k in model.layers]


def pipeline_units(model: Transformer) -> list[str]:
    return ["tok_embeddings", *(f"layers.{k}" for k in model.layers), "norm", "output"]


spec = ModelSpec(
    name="llama3",
    flavors=flavors,
    build=Transformer,
    blocks=lambda model: list(model.layers.values()),
    tp_plan=TP_PLAN,
    parallel=ParallelHooks(
        tp_divisible=tp_divisible,
        pipeline_units=pipeline_units,
        pipeline_pass_through=False,  # the forward skips the units a stage lacks
        attention_cores=attention_cores,
        attention_mask="attention_mask",
        heads=lambda args: {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads},
    ),
    training=TrainingHooks(flops_per_token=flops_per_token, shape=shape),
    adapters=Adapters(lora_targets=("wq", "wk", "wv", "wo"), hf_adapter=LlamaAdapter),
)

__all__ = ["LlamaAdapter", "LlamaArgs", "RopeScaling", "TP_PLAN", "Transformer", "attention_cores",
           "flavors", "flops_per_token", "non_embedding_params", "pipeline_units", "shape", "spec",
           "tp_divisible"]
