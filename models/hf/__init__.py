"""Any transformers causal LM, as it is: ``model.name = "hf"`` with the folder given
once as ``model.hf_path``. The model is transformers' own (``model.py``), built from
the folder's config on the meta device; composer's attention is registered with
transformers' attention registry (``attention.py``); its weights keep transformers'
names (``layout.py``); its tensor-parallel plan is transformers' own, translated
(``tp.py``); pipeline stages are cut where transformers' own pipeline plan says
(``pipeline.py``). transformers is an optional dependency, imported only when this
family builds or reads a folder (``pip install 'composer-parallel[hf]'``)."""
from __future__ import annotations

from torch import nn

from composer.models.hf.attention import Core
from composer.models.hf.experts import moe_modules, not_counting, set_sequence_sum
from composer.models.hf.layout import PREFIX, HFLayout
from composer.models.hf.model import HFCausalLM, attention_modules
from composer.models.hf.pipeline import pipeline_units
from composer.models.hf.tp import tp_divisible, tp_plan
from composer.spec import Adapters, ModelSpec, ParallelHooks, PassThrough


def blocks(model: HFCausalLM) -> list[nn.Module]:
    return list(model.layers)


def attention_cores(model: nn.Module) -> list[str]:
    """The core of every attention module (what context parallel wraps); ValueError
    naming the first decoder-layer module that mixes positions outside attention (a
    layer without attention, or a 1-D convolution: an SSM's or a linear attention's),
    which neither a document mask nor context parallel reaches, or whose attention does not
    go through transformers' attention interface, where composer's mask is given."""
    if model.unrouted:
        raise ValueError(model.unrouted)
    for index, layer in enumerate(model.layers):
        fqn = f"{PREFIX}{model.layers_name}.{index}"
        convolutions = [name for name, m in layer.named_modules() if isinstance(m, nn.Conv1d)]
        if convolutions:
            raise ValueError(f"{fqn}.{convolutions[0]} ({type(layer).__name__}) mixes positions "
                             f"outside attention")
        if not attention_modules(layer) and not isinstance(layer, PassThrough):
            raise ValueError(f"{fqn} ({type(layer).__name__}) has no attention module that "
                             f"composer's mask reaches")
    return [name for name, module in model.named_modules() if isinstance(module, Core)]


def heads(config) -> dict[str, int]:
    text = config.get_text_config()
    return {"n_heads": text.num_attention_heads,
            "n_kv_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads}


spec = ModelSpec(
    name="hf",
    flavors={},  # the sizes come from model.hf_path's config.json
    build=HFCausalLM,
    blocks=blocks,
    tp_plan=tp_plan,
    parallel=ParallelHooks(
        tp_divisible=tp_divisible,
        pipeline_units=pipeline_units,
        pipeline_pass_through=True,
        attention_cores=attention_cores,
        attention_mask="document_mask",
        heads=heads,
        moe_modules=moe_modules,
        set_sequence_sum=set_sequence_sum,
        recompute_context=not_counting,
        compile_fullgraph=False,  # an MoE's routing sizes are data-dependent
    ),
    adapters=Adapters(logits_modules=("lm_head",),
                      lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                      hf_adapter=HFLayout),
)

__all__ = ["HFCausalLM", "HFLayout", "attention_cores", "attention_modules", "pipeline_units",
           "spec", "tp_divisible", "tp_plan"]
