"""What a forward keeps for backward, op by op, in bytes per token of this
rank's slice of the sequence, from the model's shape and the layout; or, for a
model traced instead (``composer.planner.trace``), what its trace measured,
divided as the layout divides it (``costs`` gives either, as one interface).

The ops are those of composer's pre-norm decoder as autograd saves them
(checked tensor by tensor with ``torch.autograd.graph.saved_tensors_hooks``
on the debug models): an RMSNorm keeps its input in the compute dtype (a
float32 copy of a bfloat16 one), the reciprocal RMS and the normalised value;
a linear keeps its input; the rotary embedding keeps only its tables; the
fused attention kernel keeps q, k, v, its output and the log-sum-exp; SwiGLU
keeps w1's and w3's outputs, the SiLU and the product; the loss keeps the
float32 log-probabilities. Activations are in the parameter compute dtype
``a``; ``c`` is that promoted to float32 (float64 stays float64).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from torch import nn

from composer.data.sources import carries_documents
from composer.planner.layout import Layout
from composer.planner.roofline import sites
from composer.planner.state import tp_cut
from composer.planner.trace import Profile, Split
from composer.spec import TransformerShape

LSE_BYTES = 4  # the attention kernels' log-sum-exp is float32
INDEX_BYTES = 8  # int64 token ids and routing indices


@dataclass(frozen=True)
class Dtypes:
    a: int  # activations (the mixed-precision parameter dtype)
    c: int  # norms, softmax, loss: promoted to float32
    norm_weights_train: bool = True  # a frozen one (LoRA) needs no normalised value kept


def dtypes(layout: Layout) -> Dtypes:
    a = layout.compute_bytes
    return Dtypes(a, max(a, 4), layout.model.norm_weights_train)


def norm(features: int, d: Dtypes) -> int:
    """RMSNorm: input in c, 1/rms in c, and the normalised value in a, which only
    its weight's gradient reads."""
    return features * d.c + d.c + features * d.a * d.norm_weights_train


def swiglu(hidden: int, d: Dtypes) -> int:
    """w1 x, w3 x, silu(w1 x), their product (w2's input)."""
    return 4 * hidden * d.a


def on_stream(layout: Layout) -> float:
    """The share of the residual stream's tokens a rank holds (sequence parallel cuts it)."""
    return 1 / layout.dims.tp if layout.sequence_parallel else 1


def kv_bytes(layout: Layout) -> float:
    """A rank's k and v per token of its slice of the sequence."""
    s = layout.shape
    return 2 * (s.n_kv_heads // layout.dims.tp) * s.head_dim * dtypes(layout).a


def layout_extras(layout: Layout, layer: int) -> dict[str, float]:
    """What a block keeps because of the layout: context parallel's all-gather method
    keeps k and v of the whole sequence; expert parallel the tokens received for the
    rank's experts and sorted for them."""
    s, out = layout.shape, {}
    cp = layout.dims.cp
    if cp > 1 and layout.cfg.parallelism.context_parallel_method == "allgather":
        out["gathered k, v"] = (cp - 1) * kv_bytes(layout)
    if layout.dims.ep > 1 and s.is_moe(layer):
        out["expert-parallel buffers"] = 2 * s.top_k * s.dim * dtypes(layout).a
    return out


def attention(s: TransformerShape, layout: Layout, d: Dtypes) -> dict[str, float]:
    """Per token: the projections' input, head norms, the kernel's tensors."""
    heads, kv = s.n_heads // layout.dims.tp, s.n_kv_heads // layout.dims.tp
    out = {"qkv input": s.dim * d.a,
           "q, out": 2 * heads * s.head_dim * d.a,
           "k, v": kv_bytes(layout),
           "log-sum-exp": heads * LSE_BYTES}
    if s.head_norm:
        out["q/k head norms"] = (heads + kv) * norm(s.head_dim, d)
    return out


def experts(s: TransformerShape, layout: Layout, d: Dtypes) -> dict[str, float]:
    """An MoE layer per token (experts whole under TP: it runs on the gathered
    sequence). Balanced routing: each rank's experts get top_k tokens per
    token on average, with or without expert parallel."""
    k = s.top_k
    out = {"router": s.dim * d.a + s.n_experts * d.c + k * (2 * INDEX_BYTES + 2 * d.c),
           "routed tokens": 2 * k * s.dim * d.a,
           "experts": k * swiglu(s.expert_hidden, d)}
    if s.shared_hidden:
        out["shared experts"] = swiglu(s.shared_hidden, d)
    return out


def block(layout: Layout, layer: int) -> dict[str, float]:
    """Bytes per token one block keeps without activation checkpointing."""
    s, d = layout.shape, dtypes(layout)
    out = {"norms": 2 * norm(s.dim, d) * on_stream(layout), **attention(s, layout, d)}
    if s.is_moe(layer):
        out.update(experts(s, layout, d))
    else:
        out["ffn"] = s.dim * d.a + swiglu(s.ffn_hidden // layout.dims.tp, d)
    return {**out, **layout_extras(layout, layer)}


def selective_op(layout: Layout, layer: int) -> dict[str, float]:
    """Selective-op AC keeps the matmul and attention outputs and the block input."""
    s, d = layout.shape, dtypes(layout)
    tp = layout.dims.tp
    heads, kv = s.n_heads // tp, s.n_kv_heads // tp
    out = {"block input": block_input(layout),
           "q, k, v, wo out": ((heads + 2 * kv) * s.head_dim + s.dim) * d.a,
           "attention out": heads * (s.head_dim * d.a + LSE_BYTES)}
    if s.is_moe(layer):
        shared = 2 * s.shared_hidden + s.dim if s.shared_hidden else 0
        out["experts mm out"] = (s.n_experts + s.top_k * (2 * s.expert_hidden + s.dim)
                                 + shared) * d.a
    else:
        out["ffn mm out"] = (2 * s.ffn_hidden // tp + s.dim) * d.a
    added = added_matmul_outputs(layout).get(layer, 0)
    if added:
        out["converters' mm out"] = added * d.a
    return out


def added_matmul_outputs(layout: Layout) -> dict[int, int]:
    """Block index -> elements per token that the matmuls a converter adds to its linears
    output (a linear's parameters besides its weight: LoRA's adapters, rank then the
    linear's width), as the rank holds them. Selective-op AC keeps every matmul's output."""
    if not layout.converters:
        return {}
    if "_added_matmuls" not in layout.__dict__:
        added: dict[int, int] = defaultdict(int)
        for site in sites(layout):
            if site.block is not None and isinstance(site.module, nn.Linear) \
                    and site.name != "weight":
                added[site.block] += site.n
        layout.__dict__["_added_matmuls"] = dict(added)
    return layout.__dict__["_added_matmuls"]


def block_input(layout: Layout) -> float:
    """Full AC keeps only the block's input (the residual stream, sequence-cut under SP)."""
    return layout.shape.dim * dtypes(layout).a * on_stream(layout)


def _vocab(layout: Layout) -> int:
    """Logit columns a rank holds: its vocabulary shard under loss parallel."""
    s = layout.shape
    return s.vocab_size // layout.dims.tp if layout.loss_parallel else s.vocab_size


def head(layout: Layout) -> dict[str, float]:
    """The final norm, the output projection's input, the logits (held until the
    loss's backward) and the loss's log-probabilities."""
    s, d = layout.shape, dtypes(layout)
    return {"final norm": norm(s.dim, d) * on_stream(layout), "output input": s.dim * d.a,
            "logits": _vocab(layout) * d.a, "log-probabilities": _vocab(layout) * d.c}


def logits_grad(layout: Layout) -> float:
    """Backward of the loss holds the log-probabilities' and the logits' gradients;
    loss parallel's also the softmax of its vocabulary shard."""
    tensors = 3 if layout.loss_parallel else 2
    return tensors * _vocab(layout) * dtypes(layout).c


def backward_temporaries(layout: Layout, layer: int, recomputed: bool) -> float:
    """Gradients a block's backward holds at once: the one flowing into the
    block and those of the feed-forward's hidden tensors, and the output of a
    recomputed forward."""
    s, d = layout.shape, dtypes(layout)
    if s.is_moe(layer):
        hidden = s.top_k * s.expert_hidden + s.shared_hidden
    else:
        hidden = s.ffn_hidden // layout.dims.tp
    return (s.dim * (1 + recomputed) + 3 * hidden) * d.a


def _cores_take_spans(layout: Layout) -> bool:
    """Whether the model's attention cores take documents as spans and context
    parallel's chunks as ``LowerRight`` (``takes_spans``): then no mask is held."""
    cache = layout.model.__dict__  # the model's, for every layout a search tries
    if "_cores_take_spans" not in cache:
        model, hooks = layout.model.converted, layout.model.spec.parallel
        try:
            cores = [model.get_submodule(fqn) for fqn in hooks.attention_cores(model)] \
                if hooks.attention_cores is not None else []
        except ValueError:  # no mask reaches its attention: none is held
            cores = []
        cache["_cores_take_spans"] = bool(cores) and all(
            getattr(core, "takes_spans", False) for core in cores)
    return cache["_cores_take_spans"]


def mask_bytes(layout: Layout) -> float:
    """The attention mask a forward builds once for every layer, per local token.

    None where the cores take spans (composer's: per document and per chunk, SDPA
    aligned to the lower right) or, on CUDA, FlexAttention's BlockMask (a few bytes per
    block). Cores that take additive masks only: packed documents get an additive
    [batch, 1, seq, seq] mask; context parallel's all-gather method builds
    [batch, 1, seq/cp, seq] whether or not there are documents."""
    d = layout.cfg.data
    documents = carries_documents(d.format, d.sft_packing, d.document_mask)
    seq, cp, a = d.seq_len, layout.dims.cp, dtypes(layout).a
    if _cores_take_spans(layout):
        return 0.0
    if cp > 1 and layout.cfg.parallelism.context_parallel_method == "allgather":
        return seq * a
    if not documents or layout.device == "cuda":
        return 0.0
    return seq * cp * a  # all-to-all: each rank builds the whole sequence's mask


def embedding() -> float:
    return INDEX_BYTES  # the token ids


def first_grad_numel(layout: Layout, layer: int) -> int:
    """Elements of the gradient a block's backward computes first: its feed-forward's
    output projection's (an MoE layer's: its shared or one expert's)."""
    s = layout.shape
    if s.is_moe(layer):
        return s.dim * (s.shared_hidden or s.expert_hidden)
    return s.dim * s.ffn_hidden // layout.dims.tp


def routed(layout: Layout, layer: int) -> float:
    """Bytes per token of an MoE layer that grow with the tokens its experts get."""
    s, d = layout.shape, dtypes(layout)
    if not s.is_moe(layer):
        return 0.0
    return 2 * s.top_k * s.dim * d.a + s.top_k * swiglu(s.expert_hidden, d)


class Formulas:
    """The shape path: what a block keeps, from the model's TransformerShape."""

    def block(self, layout: Layout, layer: int) -> dict[str, float]:
        return block(layout, layer)

    def selective_op(self, layout: Layout, layer: int) -> dict[str, float]:
        return selective_op(layout, layer)

    def block_input(self, layout: Layout) -> float:
        return block_input(layout)

    def first(self, layout: Layout) -> dict[str, float]:
        return {"token ids": embedding()}

    def last(self, layout: Layout) -> dict[str, float]:
        return head(layout)

    def temporaries(self, layout: Layout, layer: int, recomputed: bool) -> float:
        return backward_temporaries(layout, layer, recomputed)

    def first_grad_numel(self, layout: Layout, layer: int) -> int:
        return first_grad_numel(layout, layer)

    def routed(self, layout: Layout, layer: int) -> float:
        return routed(layout, layer)


class Traced:
    """The traced path: what the trace measured, divided as the layout divides it (TP the
    cut part, sequence parallel the residual stream's, loss parallel the logits')."""

    def __init__(self, profile: Profile):
        self.profile = profile

    @staticmethod
    def _share(layout: Layout, split: Split, cut: bool = True) -> float:
        return split.share(layout.dims.tp, layout.sequence_parallel, cut)

    def block(self, layout: Layout, layer: int) -> dict[str, float]:
        saved = self.profile.blocks[layer].saved
        return {**{name: self._share(layout, s) for name, s in saved.items()},
                **layout_extras(layout, layer)}

    def selective_op(self, layout: Layout, layer: int) -> dict[str, float]:
        piece = self.profile.blocks[layer]
        return {"block input": piece.input_bytes * on_stream(layout),
                "kept op outputs": self._share(layout, piece.kept)}

    def block_input(self, layout: Layout) -> float:
        blocks = self.profile.blocks
        return blocks[0].input_bytes * on_stream(layout) if blocks else 0.0

    def first(self, layout: Layout) -> dict[str, float]:
        return {name: self._share(layout, s) for name, s in self.profile.first.saved.items()}

    def last(self, layout: Layout) -> dict[str, float]:
        return {name: self._share(layout, s, cut=layout.loss_parallel)
                for name, s in self.profile.last.saved.items()}

    def temporaries(self, layout: Layout, layer: int, recomputed: bool) -> float:
        """The gradient into the block (and a recomputed output), and those of its
        widest saved tensors."""
        piece = self.profile.blocks[layer]
        return piece.input_bytes * (1 + recomputed) + self._share(layout, piece.widest)

    def first_grad_numel(self, layout: Layout, layer: int) -> int:
        """The last trainable parameter the block's forward reads (one expert's, of stacked
        experts), as the rank holds it."""
        name = self.profile.blocks[layer].last_param
        fqn = f"{layout.model.block_names[layer]}.{name}"
        p = next((p for p in layout.model.params if p.fqn == fqn), None)
        if p is None:
            return 0
        numel = math.prod(p.shape) // (layout.dims.tp if tp_cut(layout, p) else 1)
        return numel // p.shape[0] if p.expert else numel

    def routed(self, layout: Layout, layer: int) -> float:
        if not self.profile.is_moe(layer):
            return 0.0
        return self._share(layout, self.profile.blocks[layer].routed)


FORMULAS = Formulas()


def costs(layout: Layout) -> Formulas | Traced:
    """What a block of ``layout``'s model keeps: its traced profile's measures, or the
    formulas of its shape."""
    profile = layout.model.profile
    return FORMULAS if profile is None else Traced(profile)
