"""A decoder-only mixture-of-experts transformer (DeepSeek-V3 / Qwen3-MoE style)
as a plain nn.Module, and its ModelSpec.

Attention, norms and rotary embeddings are the shared decoder's
(``composer.models.common``, as Llama uses them). The feed-forward of every
layer after the first ``n_dense_layers`` is an MoE layer: a router picks
``top_k`` of ``n_experts`` experts per token, the tokens are sorted by expert
and each expert's SwiGLU runs on its contiguous group (a grouped matmul, no
loop over tokens), optional shared experts see every token. Dropless: every
token reaches every expert it picked, however skewed the routing.

Two ways to balance the load, usable together:
- a sequence-wise auxiliary loss (``aux_loss_coef``; DeepSeek-V3's form): per
  sequence, E/(k T) x tokens routed to each expert, dotted with the mean routing
  probabilities. Per sequence, so it needs no statistics from other ranks and
  is the same on every parallel layout. Its gradient is added in backward;
  nothing changes in the loss the caller computes.
- auxiliary-loss-free balancing (``bias_update_speed``): a per-expert bias
  added to the scores for choosing experts only; after each step
  ``update_expert_bias`` moves it by speed x sign(mean load - load).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from composer import torch_compat
from composer.models.common.block import FeedForward, TransformerBlock
from composer.models.common.decoder import Transformer
from composer.models.common.init import trunc_normal_
from composer.models.llama.model import LlamaArgs, non_embedding_params
from composer.spec import not_counting as counting_off

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEArgs(LlamaArgs):
    """Llama's arguments plus the MoE ones. ``moe_hidden_dim`` is one expert's
    SwiGLU width; shared experts are one SwiGLU ``n_shared_experts`` times as wide.
    ``dense_hidden_dim`` (default: Llama's rule) sizes the first dense layers."""

    n_experts: int = 8
    top_k: int = 2
    moe_hidden_dim: int = 256
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    dense_hidden_dim: int | None = None
    score_func: str = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    aux_loss_coef: float = 0.0
    bias_update_speed: float = 0.0
    attn_head_dim: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={self.score_func!r}; allowed: {', '.join(SCORE_FUNCS)}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"n_dense_layers={self.n_dense_layers} must be in "
                             f"0..n_layers={self.n_layers}")
        if min(self.moe_hidden_dim, self.n_shared_experts + 1, self.aux_loss_coef + 1,
               self.bias_update_speed + 1) <= 0:
            raise ValueError("moe_hidden_dim must be positive; n_shared_experts, "
                             "aux_loss_coef and bias_update_speed must not be negative")

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.dense_hidden_dim or super().ffn_hidden_dim

    def is_moe(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [M, in], sorted into groups of ``counts`` [G] rows, each times its
    own ``weight[g]`` [out, in] transposed -> [M, out].

    torch's grouped matmul (``composer.torch_compat.grouped_mm``) on Hopper or newer in
    bfloat16 (one kernel); elsewhere one matmul per group, which is exact in float64
    (the parity setting).
    """
    if (x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0)):
        offsets = counts.cumsum(0).to(torch.int32)
        return torch_compat.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    groups = x.split(counts.tolist())
    return torch.cat([g @ w.T for g, w in zip(groups, weight.unbind(0))])


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts with stacked weights [E, out, in] (each slice
    laid out like an nn.Linear weight). ``forward(x, counts)``: ``x`` holds the
    tokens sorted by expert, ``counts[e]`` of them for expert e."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(grouped_mm(x, self.w1, counts)) * grouped_mm(x, self.w3, counts)
        return grouped_mm(hidden, self.w2, counts)

    def init_weights(self, out_std: float):
        trunc_normal_(self.w1, 0.02)
        trunc_normal_(self.w2, out_std)
        trunc_normal_(self.w3, out_std)


class Router(nn.Module):
    """Scores every expert per token and picks ``top_k``. The balancing bias
    shifts which experts are picked, never the weights their outputs get."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        # float32 whatever the model dtype: it accumulates many small steps
        self.register_buffer("expert_bias", torch.empty(args.n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, dim] -> scores [N, E], chosen experts [N, k], their weights [N, k]."""
        a = self.args
        logits = self.gate(x).to(torch.promote_types(x.dtype, torch.float32))
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores + self.expert_bias, a.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if a.route_norm:
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, chosen, weights * a.route_scale

    def init_weights(self):
        trunc_normal_(self.gate.weight, 0.02)
        nn.init.zeros_(self.expert_bias)


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux`` receives gradient ``scale``, as if
    ``scale * aux`` had been added to the loss (works inside pipeline stages,
    whose loss the caller never sees)."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full((), ctx.scale), None


def unchanged(t: torch.Tensor) -> torch.Tensor:
    return t


def sequence_aux_loss(scores: torch.Tensor, chosen: torch.Tensor, n_experts: int,
                      batch: int, sequence_sum=unchanged) -> torch.Tensor:
    """Sum over the batch's sequences of T x sum_e f_e P_e, where f_e = E/(k T) x
    tokens of the sequence routed to e and P_e = their mean normalised score: a
    per-token sum, normalised like the cross-entropy sum.

    ``sequence_sum`` sums per-sequence counts over the ranks that each hold part
    of every sequence (set by context parallel; unchanged otherwise): f_e and T
    are then the whole sequence's, and this rank's share of the sum takes its
    own tokens' scores, so the shares add up to the whole."""
    probs = (scores / scores.sum(-1, keepdim=True)).view(batch, -1, n_experts)
    picks = chosen.view(batch, -1)
    k = chosen.shape[-1]
    counts = torch.zeros(batch, n_experts + 1, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, picks, torch.ones_like(picks, dtype=probs.dtype))
    counts[:, -1] = probs.shape[1]
    counts = sequence_sum(counts)
    routed, seq_len = counts[:, :-1], counts[:, -1:]
    f = routed * n_experts / (k * seq_len)
    return (f * probs.sum(1)).sum()


class MoE(nn.Module):
    """Routed experts (+ shared experts) in place of one feed-forward.

    While training it accumulates ``tokens_per_expert`` and ``aux_loss_sum`` for
    the trainer's statistics and balancing (``reset_stats`` clears them).
    ``aux_loss_scale``: the factor the trainer applies to its loss sum (None:
    1 / the batch's tokens, i.e. a mean). ``count_tokens``: whether training
    forwards add to the statistics (off for forwards that are no real batch).
    """

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = Router(args)
        self.experts = GroupedExperts(args.dim, args.moe_hidden_dim, args.n_experts)
        self.shared_experts = (FeedForward(args.dim, args.moe_hidden_dim * args.n_shared_experts)
                               if args.n_shared_experts else None)
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros((), dtype=torch.float64), persistent=False)
        self.aux_loss_scale: float | None = None
        self.count_tokens = True
        self.sequence_sum = unchanged  # context parallel: a sum over the sequence's ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, dim = x.shape
        flat = x.reshape(-1, dim)
        scores, chosen, weights = self.router(flat)
        k = chosen.shape[-1]
        counts = torch.bincount(chosen.flatten(), minlength=self.args.n_experts)
        order = chosen.flatten().argsort(stable=True)
        routed = self.experts(flat[order // k], counts)
        # back to (token, choice) order, weighted, summed over the k choices
        out = routed[order.argsort()].view(-1, k, dim)
        y = (out * weights.to(x.dtype).unsqueeze(-1)).sum(1)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        if self.training and torch.is_grad_enabled():
            y = self._account(y, scores, chosen, counts, batch)
        return y.view(batch, seq_len, dim)

    def _account(self, y, scores, chosen, counts, batch) -> torch.Tensor:
        if self.count_tokens:
            self.tokens_per_expert += counts
        if self.args.aux_loss_coef == 0:
            return y
        aux = self.args.aux_loss_coef * sequence_aux_loss(scores, chosen, self.args.n_experts,
                                                          batch, self.sequence_sum)
        if self.count_tokens:
            self.aux_loss_sum += aux.detach().to(self.aux_loss_sum.dtype)
        scale = self.aux_loss_scale if self.aux_loss_scale is not None else 1 / y.shape[0]
        return _AddAuxLossGrad.apply(y, aux, scale)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing from one step's load over the whole batch
        (summed over all data ranks): raise the bias of underloaded experts."""
        speed = self.args.bias_update_speed
        if speed > 0:
            load = tokens_per_expert.to(self.router.expert_bias.dtype)
            self.router.expert_bias += speed * torch.sign(load.mean() - load)

    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.aux_loss_sum.zero_()

    def init_weights(self, out_std: float):
        self.router.init_weights()
        self.experts.init_weights(out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(out_std)
        self.reset_stats()


class MoEBlock(TransformerBlock):
    """The shared pre-norm block whose feed-forward is an MoE layer (named ``moe``) after the
    first ``n_dense_layers``."""

    def make_ffn(self, layer_id: int, args: MoEArgs) -> tuple[str, nn.Module]:
        return ("moe", MoE(args)) if args.is_moe(layer_id) else super().make_ffn(layer_id, args)


class MoETransformer(Transformer):
    block_class = MoEBlock


def moe_modules(model: nn.Module) -> dict[str, MoE]:
    """The MoE layers this model (or pipeline stage) holds, by FQN."""
    return {f"layers.{i}.moe": block.moe for i, block in model.layers.items()
            if hasattr(block, "moe")}


def not_counting(block: nn.Module):
    """The block's routers stop counting tokens: a recomputed forward is not a new batch."""
    return counting_off([m for m in block.modules() if isinstance(m, MoE)])


def set_sequence_sum(model: nn.Module, sequence_sum) -> None:
    """How the auxiliary losses sum per-sequence counts over the ranks of a sequence."""
    for layer in moe_modules(model).values():
        layer.sequence_sum = sequence_sum


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The trainer's factor on its summed loss, applied to the auxiliary losses too."""
    for layer in moe_modules(model).values():
        layer.aux_loss_scale = scale


def active_params(args: MoEArgs) -> int:
    """Parameters one token's forward multiplies by: llama's count with each MoE
    layer's feed-forward replaced by its router, k experts and the shared ones."""
    dense = non_embedding_params(args)
    n_moe = sum(args.is_moe(i) for i in range(args.n_layers))
    per_expert = 3 * args.dim * args.moe_hidden_dim
    moe_ffn = (args.dim * args.n_experts
               + (args.top_k + args.n_shared_experts) * per_expert)
    return dense + n_moe * (moe_ffn - 3 * args.dim * args.ffn_hidden_dim)


def flops_per_token(args: MoEArgs, seq_len: int) -> float:
    """6 x active parameters plus attention, as for Llama (causal mask not discounted)."""
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6 * active_params(args) + attention
