"""The Qwen3 family, dense (``qwen3``) and mixture-of-experts (``qwen3_moe``):
the models (``model.py``), their Hugging Face layouts (``hf.py``) and the
specs, which reuse Llama's and the MoE family's plans, costs and hooks."""
from __future__ import annotations

import dataclasses

from composer.models import llama, moe
from composer.models.qwen3.hf import Qwen3Adapter, Qwen3MoeAdapter
from composer.models.qwen3.model import (
    Qwen3Args,
    Qwen3Attention,
    Qwen3Block,
    Qwen3MoeArgs,
    Qwen3MoeBlock,
    Qwen3MoeTransformer,
    Qwen3Transformer,
    flavors,
    moe_flavors,
)
from composer.spec import Adapters

# Llama's (or the MoE family's) plan, and the per-head norms: their one weight
# serves all heads while a tensor-parallel rank holds some of them, so each
# rank's gradient is a partial sum over its heads (``head_norm`` sums it over tp).
QK_NORMS = {"layers.*.attention.q_norm": "head_norm", "layers.*.attention.k_norm": "head_norm"}
TP_PLAN = {**llama.TP_PLAN, **QK_NORMS}
MOE_TP_PLAN = {**moe.TP_PLAN, **QK_NORMS}


def _with_head_norms(shape):
    return lambda args: dataclasses.replace(shape(args), head_norm=True)


spec = dataclasses.replace(
    llama.spec,
    name="qwen3",
    flavors=flavors,
    build=Qwen3Transformer,
    tp_plan=TP_PLAN,
    parallel=dataclasses.replace(llama.spec.parallel, tp_divisible=llama.tp_divisible),
    training=dataclasses.replace(
        llama.spec.training,
        flops_per_token=llama.flops_per_token,  # the norms do no matmul work
        shape=_with_head_norms(llama.shape)),
    adapters=Adapters(lora_targets=("wq", "wk", "wv", "wo"), hf_adapter=Qwen3Adapter),
)

# The MoE family's hooks (MoE layers, recompute without counting, the aux
# loss's scale, no full-graph compile) and its tp_optional (no dense layers).
moe_spec = dataclasses.replace(
    moe.spec,
    name="qwen3_moe",
    flavors=moe_flavors,
    build=Qwen3MoeTransformer,
    tp_plan=MOE_TP_PLAN,
    parallel=dataclasses.replace(moe.spec.parallel, tp_divisible=moe.tp_divisible),
    training=dataclasses.replace(moe.spec.training, flops_per_token=moe.flops_per_token,
                                 shape=_with_head_norms(moe.shape)),
    adapters=Adapters(lora_targets=("wq", "wk", "wv", "wo"), hf_adapter=Qwen3MoeAdapter),
)

__all__ = ["MOE_TP_PLAN", "QK_NORMS", "TP_PLAN", "Qwen3Adapter", "Qwen3Args", "Qwen3Attention",
           "Qwen3Block", "Qwen3MoeAdapter", "Qwen3MoeArgs", "Qwen3MoeBlock", "Qwen3MoeTransformer",
           "Qwen3Transformer", "flavors", "moe_flavors", "moe_spec", "spec"]
