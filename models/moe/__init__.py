"""A generic decoder-only mixture-of-experts family on the shared attention
(``model.py``), and its spec: the TP plan, the MoE hooks the passes call."""
from __future__ import annotations

import dataclasses

from composer.models import llama
from composer.models.moe.model import (
    MoE,
    MoEArgs,
    MoEBlock,
    MoETransformer,
    active_params,
    flops_per_token,
    grouped_mm,
    moe_modules,
    not_counting,
    sequence_aux_loss,
    set_aux_loss_scale,
    set_sequence_sum,
)
from composer.spec import TrainingHooks, TransformerShape

# Llama's plan for attention, embeddings, output and the dense layers. The MoE
# layer is not cut by tensor parallel: each tp rank runs it on the whole
# (gathered) sequence and keeps its own slice of the result, so its experts stay
# whole for expert parallel.
TP_PLAN = {**llama.TP_PLAN, "layers.*.moe": "gathered"}


def tp_divisible(args: MoEArgs) -> dict[str, int]:
    sizes = llama.tp_divisible(args)
    if args.n_dense_layers == 0:
        del sizes["ffn_hidden_dim"]
    return sizes


def shape(args: MoEArgs) -> TransformerShape:
    return dataclasses.replace(
        llama.shape(args), moe_from=args.n_dense_layers, n_experts=args.n_experts,
        top_k=args.top_k, expert_hidden=args.moe_hidden_dim,
        shared_hidden=args.moe_hidden_dim * args.n_shared_experts)


flavors: dict[str, MoEArgs] = {
    # CPU-sized, and every feature on: a dense first layer, a shared expert,
    # the auxiliary loss and the bias balancing.
    "debug": MoEArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512,
                     multiple_of=64, max_seq_len=2048, n_experts=8, top_k=2, moe_hidden_dim=96,
                     n_shared_experts=1, n_dense_layers=1, route_norm=True, aux_loss_coef=0.01,
                     bias_update_speed=1e-3),
    # A DeepSeek-V3-sized MoE (671B total, 37B active) that is not DeepSeek-V3: Llama's
    # grouped-query attention instead of latent attention, no group-limited routing,
    # no multi-token prediction. For memory and scale experiments.
    "671B_gqa": MoEArgs(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280,
                        norm_eps=1e-6, rope_theta=10000.0, max_seq_len=4096, n_dense_layers=3,
                        dense_hidden_dim=18432, n_experts=256, top_k=8, moe_hidden_dim=2048,
                        n_shared_experts=1, score_func="sigmoid", route_norm=True,
                        route_scale=2.5, aux_loss_coef=1e-4, bias_update_speed=1e-3),
}

spec = dataclasses.replace(
    llama.spec,
    name="moe",
    flavors=flavors,
    build=MoETransformer,
    tp_plan=TP_PLAN,
    parallel=dataclasses.replace(
        llama.spec.parallel,
        tp_divisible=tp_divisible,
        # flavors without dense layers have no feed_forward modules
        tp_optional=("layers.*.feed_forward", "layers.*.feed_forward.w1",
                     "layers.*.feed_forward.w2", "layers.*.feed_forward.w3"),
        moe_modules=moe_modules,
        set_sequence_sum=set_sequence_sum,
        recompute_context=not_counting,
        compile_fullgraph=False,  # routing sizes are data-dependent
    ),
    training=TrainingHooks(flops_per_token=flops_per_token, shape=shape,
                           set_loss_scale=set_aux_loss_scale),
    adapters=dataclasses.replace(llama.spec.adapters, hf_adapter=None),
)

__all__ = ["MoE", "MoEArgs", "MoEBlock", "MoETransformer", "TP_PLAN", "active_params", "flavors",
           "flops_per_token", "grouped_mm", "moe_modules", "sequence_aux_loss", "spec",
           "tp_divisible"]
