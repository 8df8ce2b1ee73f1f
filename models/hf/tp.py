"""Tensor parallel for a transformers model, as data: transformers' own plan of the model
(``tp_plan``: the config's ``base_model_tp_plan`` under the base model's prefix, the
causal-LM class's ``_tp_plan`` for the head, the input embeddings sharded on the
vocabulary) translated to composer's styles (``composer.parallel.tensor.STYLES``), and
with sequence parallel the entries composer adds, found from the model's structure:
transformers' plans carry none."""
from __future__ import annotations

from torch import nn

from composer.models.hf.experts import Routed
from composer.models.hf.layout import PREFIX
from composer.spec import NoSequenceParallel, names_match

# transformers' style (transformers.distributed.tensor_parallel) -> composer's
TRANSLATED = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gathered",
    "rowwise_split_input": "rowwise_split_input",
    "packed_colwise": "packed_colwise",
    "embedding_rowwise": "embedding",
    "replicated_with_grad_allreduce": "head_norm",
    "moe_tp_experts": "experts",
    # weights transformers keeps whole on every rank, beside cut ones its own code syncs:
    # composer runs the module holding them whole (``WHOLE``), which needs no sync
    "mla_kv_a_proj": "whole",  # latent attention's shared kv projection
    "local_params": "whole",  # a module whose bare parameters (sinks, a gate's bias) are cut
    "replicate": "whole",
    "embedding_colwise": "whole",  # an embedding cut on its hidden features
}
WHOLE = "whole"
# the head's (the causal-LM class's own entries): its logits stay sharded with loss parallel
HEAD = {"colwise_gather_output": "output"}
# composer's styles whose module writes the residual stream (sequence-sharded with SP)
WRITES_STREAM = ("rowwise", "rowwise_split_input")
# composer's styles whose module, inside a block, sums its output over tp: the block runs
# on the whole sequence and keeps its slice (with SP)
SUMS_OUTPUT = ("experts",)
# composer's styles whose module's output is whole on every rank (gathered after the cut)
WHOLE_OUTPUT = ("colwise_gathered",)


def translated_plan(model: nn.Module) -> dict[str, str]:
    """transformers' plan of ``model.lm`` in composer's styles: its entries that name a
    module with weights here (a parameter's entry is part of its module's style, e.g.
    stacked experts');
    ValueError naming the pattern and style of one composer cannot honour."""
    lm = model.lm
    head = type(lm)._tp_plan or {}
    # a module without weights has nothing to cut (a pipeline stage's stand-in for a
    # module another stage holds)
    names = [name for name, m in model.named_modules() if next(m.parameters(), None) is not None]
    out = {}
    for key, style in lm.tp_plan.items():
        if not any(names_match(name, PREFIX + key) for name in names):
            continue
        table = HEAD if key in head else TRANSLATED
        if style not in table:
            raise ValueError(f"{PREFIX}{key}: transformers' tensor-parallel style {style!r} has "
                             f"no translation in composer; allowed: {', '.join(table)}")
        if table[style] == "experts":
            _check_experts(model, PREFIX + key, style)
        out[PREFIX + key] = table[style]
    return out


def _check_experts(model: nn.Module, pattern: str, style: str) -> None:
    """ValueError naming the pattern where composer cannot cut its experts as the plan says."""
    for name, module in model.named_modules():
        if names_match(name, pattern):
            why = module.tp_refusal() if isinstance(module, Routed) else "they are not stacked"
            if why:
                raise ValueError(f"{pattern}: transformers' tensor-parallel style {style!r} "
                                 f"cannot be honoured: {why}")


def _stream_style(fqn: str, module: nn.Module, plan: dict[str, str]) -> str | None:
    """composer's style, with sequence parallel, for a module the residual stream passes
    through: one holding experts that sum their output over tp runs whole and keeps its
    slice (``gathered``), one holding linears that write the stream takes it whole
    (``replicate_input``), one whose parameters are all vectors works on each position
    alone (a norm: ``norm``), one the plan cuts nothing of (transformers 5.25's Qwen3-MoE
    plan leaves its experts whole) or only in linears whose output it gathers whole (a
    gated delta net's projections) runs whole on every rank and keeps its slice
    (``gathered``); one without parameters is left as it is."""
    inside = [name for name, _ in module.named_modules(prefix=fqn)][1:]

    def holds(styles: tuple[str, ...]) -> bool:
        return any(names_match(name, key) for name in inside for key, style in plan.items()
                   if style in styles)

    if holds(SUMS_OUTPUT):
        return "gathered"
    if holds(WRITES_STREAM):
        return "replicate_input"
    params = list(module.parameters())
    if not params:
        return None
    if all(p.dim() == 1 for p in params):
        return "norm"
    if not holds(tuple(set(plan.values()) - set(WHOLE_OUTPUT))):
        return "gathered"
    raise NoSequenceParallel(f"sequence parallel: {fqn} ({type(module).__name__}) is neither a "
                             f"norm nor a module whose linears the tensor-parallel plan makes "
                             f"write the residual stream; set parallelism.sequence_parallel = "
                             f"false")


def _layer_entries(layers: str, model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The stream styles of the decoder layers' children: one ``*`` entry per child name
    where every layer agrees, one per layer where they differ."""
    styles: dict[str, dict[str, str | None]] = {}
    for index, layer in model.get_submodule(layers).named_children():
        for name, child in layer.named_children():
            fqn = f"{layers}.{index}.{name}"
            styles.setdefault(name, {})[fqn] = _stream_style(fqn, child, plan)
    out = {}
    for name, per_layer in styles.items():
        if len(set(per_layer.values())) == 1:
            per_layer = {f"{layers}.*.{name}": next(iter(per_layer.values()))}
        out.update({key: style for key, style in per_layer.items() if style})
    return out


def sequence_entries(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The entries sequence parallel adds to ``plan``: the stream styles of the children
    of the module holding the decoder layers (its final norm; its input embedding, where
    the plan does not cut it, keeps its slice: ``sliced``) and of the decoder layers'
    children."""
    layers = PREFIX + model.layers_name
    base = layers.rpartition(".")[0]
    embedding = model.lm.get_input_embeddings()
    out = {}
    for name, child in model.get_submodule(base).named_children():
        fqn = f"{base}.{name}"
        if fqn == layers or fqn in plan:
            continue
        # the stream starts at the input embedding, from token ids every rank holds whole
        holds_embedding = any(m is embedding for m in child.modules())
        out[fqn] = "sliced" if holds_embedding else _stream_style(fqn, child, plan)
    return {**{k: v for k, v in out.items() if v}, **_layer_entries(layers, model, plan)}


def _covered(name: str, plan: dict[str, str]) -> bool:
    """Whether a plan key names the module ``name`` or one holding it."""
    parts = name.split(".")
    return any(names_match(".".join(parts[:n]), key) for n in range(1, len(parts) + 1)
               for key in plan)


def _mixed(model: nn.Module, plan: dict[str, str]) -> list[str]:
    """The decoder layers' children that hold a matrix the plan leaves whole beside a
    linear it makes write the residual stream (an MoE's router and experts beside cut
    shared experts; latent attention's whole kv projection beside its cut output): whole,
    the one's output would meet the other's partial or sequence-cut one."""
    layers = model.get_submodule(PREFIX + model.layers_name)
    out = []
    for index, layer in layers.named_children():
        for child_name, child in layer.named_children():
            fqn = f"{PREFIX}{model.layers_name}.{index}.{child_name}"
            names = [n for n, m in child.named_modules(prefix=fqn)
                     if any(p.dim() > 1 for p in m.parameters(recurse=False))]
            writes = any(names_match(n, key) for n in names for key, style in plan.items()
                         if style in WRITES_STREAM)
            if writes and any(not _covered(n, plan) for n in names):
                out.append(fqn)
    return out


def _run_whole(model: nn.Module, plan: dict[str, str]) -> list[str]:
    """The modules that run whole on every rank: those the plan keeps ``WHOLE`` (with
    their owner, a decoder layer's child, where it also holds cut ones) and the decoder
    layers' children holding a matrix the plan leaves whole beside cut ones."""
    cut = {key: style for key, style in plan.items() if style != WHOLE}
    layers = f"{PREFIX}{model.layers_name}."
    out = _mixed(model, cut)
    for name, _ in model.named_modules():
        if any(names_match(name, key) for key, style in plan.items() if style == WHOLE):
            owner = ".".join(name[len(layers):].split(".")[:2]) if name.startswith(layers) else ""
            out.append(layers + owner if owner.count(".") == 1 else name)
    return out


def tp_plan(sequence_parallel: bool, loss_parallel: bool, model: nn.Module) -> dict[str, str]:
    """The HF family's plan of ``model`` (``ModelSpec.tp_plan``): transformers' own,
    translated, less its entries inside a module that runs whole (``_run_whole``)."""
    if sequence_parallel and model.unrouted:
        raise NoSequenceParallel(f"sequence parallel: {model.unrouted}: it runs transformers' "
                                 f"own attention, whose mask transformers would build from a "
                                 f"rank's slice of the sequence; set "
                                 f"parallelism.sequence_parallel = false")
    plan = translated_plan(model)
    whole = _run_whole(model, plan)
    plan = {key: style for key, style in plan.items() if style != WHOLE
            and not any(names_match(name, key) for name, _ in model.named_modules()
                        if any(name == fqn or name.startswith(f"{fqn}.") for fqn in whole))}
    return {**plan, **sequence_entries(model, plan)} if sequence_parallel else plan


def tp_divisible(config) -> dict[str, int]:
    """The sizes tensor parallel splits: heads, kv heads, vocabulary, hidden features."""
    text = config.get_text_config()
    names = ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size",
             "moe_intermediate_size")
    # a size given per layer (a list: Gemma-3n's intermediate sizes) is checked per entry
    return {f"{name}[{i}]" if isinstance(value, list) else name: v
            for name in names if (value := getattr(text, name, None))
            for i, v in (enumerate(value) if isinstance(value, list) else [(0, value)])}
