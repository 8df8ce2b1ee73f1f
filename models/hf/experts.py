"""A transformers MoE's experts in composer's calling convention, so that composer's
expert parallel and tensor parallel act on them as on a built-in family's.

transformers 5 gives every MoE's experts one form (``use_experts_implementation``):
a module of stacked weights ``[n_experts, ...]`` that its block calls as
``experts(hidden [tokens, dim], top_k_index, top_k_weights [tokens, k])``. ``Routed``,
mixed into that class when the model is built, keeps that call and turns it into
composer's: the (token, choice) pairs sorted by expert and counted, then
``forward(tokens sorted by expert, tokens per expert)``, which runs transformers' own
experts code (its ``experts_implementation``) on the experts the module holds, then the
outputs back in token order, weighted and summed over the k choices. Expert parallel
(``composer.parallel.expert``) and the ``experts`` tensor-parallel style wrap that
``forward``; the names and weights stay transformers' own.

The module also keeps the router statistics the trainer reports (tokens per expert);
``moe_modules`` gives composer's view of each MoE block (``MoELayer``).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from composer.spec import names_match
from composer.spec import not_counting as counting_off

# transformers' parameter styles inside a moe_tp_experts module -> (which of a stacked
# weight's [n_experts, out, in] dims it cuts, counted from the end; packed parts)
PARAM_CUTS = {"packed_colwise": (2, 2), "colwise": (2, 1), "rowwise": (1, 1)}


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' stacked experts (the attributes its
    ``use_experts_implementation`` sets)."""
    return all(hasattr(module, name) for name in ("has_gate", "is_transposed", "num_experts"))


class Routed:
    """Mixed into a transformers experts class by ``route``."""

    num_experts: int
    tokens_per_expert: torch.Tensor
    count_tokens: bool

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' call: [tokens, dim] and each token's k experts and weights."""
        k = top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        counts = torch.bincount(chosen, minlength=self.num_experts)
        order = chosen.argsort(stable=True)
        routed = super().__call__(hidden[order // k], counts)
        out = routed[order.argsort()].view(-1, k, hidden.shape[-1])
        if self.training and self.count_tokens and torch.is_grad_enabled():
            self.tokens_per_expert += counts
        return (out * top_k_weights.to(out.dtype).unsqueeze(-1)).sum(1)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """composer's call: tokens sorted by expert, ``counts`` per expert held here (all
        of them, or a rank's share under expert parallel): transformers' experts code
        on them, each token's one expert at weight 1."""
        held = counts.numel()
        experts = torch.repeat_interleave(torch.arange(held, device=tokens.device), counts)
        with _holding(self, held):
            return super().forward(tokens, experts[:, None], tokens.new_ones(len(experts), 1))

    @property
    def tp_cut(self) -> dict[str, tuple[int, int]]:
        """The ``experts`` tensor-parallel style's cut of each parameter: name -> (dim,
        packed parts), from transformers' own plan entries for them (``tp_refusal``
        says first whether they can be cut)."""
        return {name: (self.get_parameter(name).dim() - PARAM_CUTS[style][0],
                       PARAM_CUTS[style][1]) for name, style in self.param_styles.items()}

    def tp_refusal(self) -> str | None:
        """Why composer cannot cut these experts as transformers' plan says, or None."""
        if self.is_transposed:
            return "its stacked weights are stored transposed ([n_experts, in, out])"
        uncut = [name for name, _ in self.named_parameters() if name not in self.param_styles]
        if uncut:
            return f"the plan does not cut {', '.join(uncut)} (each rank would add it)"
        odd = {name: style for name, style in self.param_styles.items()
               if style not in PARAM_CUTS}
        if odd:
            return (f"the plan gives {', '.join(f'{n} {s!r}' for n, s in odd.items())}; "
                    f"allowed: {', '.join(PARAM_CUTS)}")
        return None

    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()


@contextlib.contextmanager
def _holding(module: nn.Module, held: int):
    """transformers' experts code sizes its routing by ``num_experts``: the experts held."""
    total = module.num_experts
    module.num_experts = held
    try:
        yield
    finally:
        module.num_experts = total


_CLASSES: dict[type, type] = {}


def route(module: nn.Module, param_styles: dict[str, str]) -> None:
    """Make transformers' experts ``module`` a ``Routed`` one (on any device).
    ``param_styles``: transformers' tensor-parallel styles of its parameters."""
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Routed{cls.__name__}", (Routed, cls), {})
    module.__class__ = _CLASSES[cls]
    device = next(module.parameters()).device
    module.register_buffer("tokens_per_expert",
                           torch.zeros(module.num_experts, dtype=torch.int64, device=device),
                           persistent=False)
    module.count_tokens = True
    module.param_styles = param_styles


class MoELayer:
    """composer's view of a transformers MoE block (``ParallelHooks.moe_modules``): its
    ``experts`` and their statistics. transformers' routers add no auxiliary loss to the
    logits composer trains on, and balance no biases of composer's."""

    def __init__(self, experts: Routed):
        self.experts = experts
        self.aux_loss_sum = torch.zeros((), dtype=torch.float64)

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return self.experts.tokens_per_expert

    @property
    def count_tokens(self) -> bool:
        return self.experts.count_tokens

    @count_tokens.setter
    def count_tokens(self, enabled: bool) -> None:
        self.experts.count_tokens = enabled

    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        pass

    def reset_stats(self) -> None:
        self.experts.reset_stats()


def moe_modules(model: nn.Module) -> dict[str, MoELayer]:
    """The MoE blocks this model (or pipeline stage) holds, by FQN."""
    return {name.rpartition(".")[0]: MoELayer(m) for name, m in model.named_modules()
            if isinstance(m, Routed)}


def not_counting(block: nn.Module):
    """The block's experts stop counting tokens: a recomputed forward is not a new batch."""
    return counting_off([m for m in block.modules() if isinstance(m, Routed)])


def set_sequence_sum(model: nn.Module, sequence_sum) -> None:
    """transformers' MoE blocks keep no per-sequence statistics: nothing to sum."""


def param_styles(lm: nn.Module, fqn: str) -> dict[str, str]:
    """transformers' plan entries for the parameters of the experts at ``fqn`` (in ``lm``):
    name -> style."""
    names = dict(lm.get_submodule(fqn).named_parameters())
    out = {}
    for key, style in (lm.tp_plan or {}).items():
        owner, _, name = key.rpartition(".")
        if name in names and names_match(fqn, owner):
            out[name] = style
    return out
