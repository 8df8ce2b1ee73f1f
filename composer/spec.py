"""What a model tells the parallelize passes (and everything else) about itself.

A model file stays free of distributed code; everything a pass, a converter,
the trainer or the Hugging Face I/O needs to know about a model (its blocks,
its sizes, its cost, its TP plan as data, its checkpoint names) comes through
a ModelSpec, whose hooks are grouped by who asks: ``ParallelHooks`` (the
passes), ``TrainingHooks`` (the trainer, metrics, planner) and ``Adapters``
(the converters, the Hugging Face I/O).

Imports: nothing of composer.
"""
from __future__ import annotations

import contextlib
import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn


class StateDictAdapter:
    """One model family's Hugging Face checkpoint layout, for one model's arguments.

    Our state-dict keys <-> Hugging Face tensor names, the per-tensor
    conversions, and ``config.json`` <-> model arguments. One of our tensors may
    be stored as several (stacked experts, one tensor per expert) or share its
    storage with another (a tied output is the embedding). A family's subclass goes
    in ``Adapters.hf_adapter``; ``export_hf`` and ``load_hf_into`` use it.

    >>> import torch
    >>> from composer import StateDictAdapter
    >>> class Prefixed(StateDictAdapter):  # Hugging Face's names: ours under "model."
    ...     model_type = "prefixed"
    ...     def config(self, dtype): return {"model_type": self.model_type, "hidden": self.args}
    ...     def hf_keys(self, ours): return [f"model.{ours}"]
    ...     def to_hf(self, ours, tensor): return {f"model.{ours}": tensor}
    ...     def from_hf(self, ours, get): return get(f"model.{ours}")
    ...     def stored_as(self, ours): return f"model.{ours}"  # a rename only
    >>> adapter = Prefixed(8)  # the model's arguments
    >>> list(adapter.to_hf("weight", torch.zeros(2))), adapter.config(torch.float32)
    (['model.weight'], {'model_type': 'prefixed', 'hidden': 8})
    """

    model_type: str = ""  # config.json's model_type this adapter reads

    def __init__(self, args: Any):
        self.args = args

    @classmethod
    def args_from_config(cls, config: dict) -> Any:
        """The model arguments of a ``config.json``; ValueError for what the
        model cannot express."""
        raise NotImplementedError

    @classmethod
    def args_from_folder(cls, folder: Path, trust_remote_code: bool = False) -> Any:
        """The model arguments of a Hugging Face folder (``model.hf_path``): its
        ``config.json`` read by ``args_from_config``. ``trust_remote_code``: whether
        code the folder ships may run (a family that can run such code reads it)."""
        return cls.args_from_config(json.loads((Path(folder) / "config.json").read_text()))

    def config(self, dtype: torch.dtype) -> dict:
        """``config.json`` for these arguments, with weights in ``dtype``."""
        raise NotImplementedError

    def hf_keys(self, ours: str) -> list[str]:
        """The Hugging Face tensors that hold our tensor ``ours``; ValueError if none."""
        raise NotImplementedError

    def to_hf(self, ours: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Our whole tensor ``ours`` as its Hugging Face tensors (``hf_keys`` order)."""
        raise NotImplementedError

    def from_hf(self, ours: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Our whole tensor ``ours``, read from its Hugging Face tensors by ``get(name)``."""
        raise NotImplementedError

    def stored_as(self, ours: str) -> str | None:
        """The one Hugging Face tensor that holds our tensor ``ours`` unchanged (a
        rename only), so that a rank may read just its slice of it; None where a
        conversion makes it (permuted, split, stacked...) and it is read whole."""
        return None


class PassThrough(nn.Module):
    """What a pipeline stage holds in place of a unit it lacks, for a model whose
    forward calls every unit (``ParallelHooks.pipeline_pass_through``): no weights,
    and the hidden states it is called with (its first argument) come back as they came.

    >>> import torch
    >>> from composer.spec import PassThrough
    >>> h = torch.ones(2, 3)
    >>> PassThrough()(h, attention_mask=None) is h
    True
    """

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


def held(model: nn.Module, names: list[str]) -> list[str]:
    """The FQNs among ``names`` that ``model`` holds: a pipeline stage's ``PassThrough``
    stand-ins, and what they stand in for, hold none. A name that is wrong otherwise still
    raises (``get_submodule``'s AttributeError).

    >>> from torch import nn
    >>> from composer.spec import PassThrough, held
    >>> model = nn.ModuleList([nn.Sequential(nn.Linear(2, 2)), PassThrough()])
    >>> held(model, ["0.0", "1.0"])
    ['0.0']
    """
    out = []
    for name in names:
        parts = name.split(".")
        prefixes = (".".join(parts[:i]) for i in range(1, len(parts) + 1))
        if not any(isinstance(model.get_submodule(p), PassThrough) for p in prefixes):
            out.append(name)
    return out


@dataclass(frozen=True)
class DecoderSizes:
    """The sizes of any decoder that the planner's communication and time model reads:
    the residual stream's width, the blocks, the attention's q and kv heads and their
    width, the vocabulary."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int


@dataclass(frozen=True)
class TransformerShape(DecoderSizes):
    """The sizes of a pre-norm decoder (RMSNorm, rotary attention with grouped
    kv heads, SwiGLU or mixture-of-experts feed-forward) that the planner's
    memory, communication and time model reads. ``moe_from`` is the first block
    with experts (None: no experts); an expert and the shared experts are
    SwiGLUs ``expert_hidden`` and ``shared_hidden`` wide (0: none)."""

    ffn_hidden: int
    head_norm: bool = False  # an RMSNorm on every q and k head (Qwen3)
    moe_from: int | None = None
    n_experts: int = 0
    top_k: int = 0
    expert_hidden: int = 0
    shared_hidden: int = 0

    def is_moe(self, layer: int) -> bool:
        return self.moe_from is not None and layer >= self.moe_from


@dataclass
class ParallelHooks:
    """What the parallelize passes ask of a model beyond its blocks and TP plan;
    the defaults suit a dense model (no experts, no context or pipeline parallel).

    tp_divisible: model arguments -> {size name: size} of every size that
        tensor parallel splits (heads, vocabulary, hidden features), so a bad
        degree is caught before any collective.
    tp_optional: keys of the tensor-parallel plan that may match no module
        (layers some flavors lack); every other key must match one.
    pipeline_units: module -> FQNs of the modules a pipeline cut may fall
        between, in forward order (the blocks among them); ValueError, naming why,
        for a model that cannot be cut. A stage keeps some; the forward runs as
        written (``pipeline_pass_through``). None: no pipeline parallel.
    pipeline_pass_through: whether a stage holds a ``PassThrough`` in place of each
        unit it lacks (the default: any forward works, whether it keeps its blocks in
        an nn.ModuleList, nn.Sequential or nn.ModuleDict, and whatever it does around
        its units: a stage hands its input to its first unit and returns its last
        unit's output, ``composer.parallel.stages.cut_between``). False: a block leaves
        its nn.ModuleDict and another unit becomes None, for a forward that skips
        missing ones (composer's own models); a unit in an nn.ModuleList is then
        refused (removing it would renumber the blocks after it).
    moe_modules: module -> {FQN: MoE layer} it holds. An MoE layer has
        ``experts`` (stacked weights [n_experts, ...], called as
        ``experts(tokens sorted by expert, tokens per expert)``), all that
        ``parallelize`` needs for expert parallel; the trainer's checks, router statistics
        and balancing also read ``tokens_per_expert``, ``aux_loss_sum``,
        ``update_expert_bias`` and ``reset_stats``. None: no experts.
    attention_cores: module -> FQNs of its attention cores: modules without
        weights called as ``core(q, k, v, mask, **options)`` on [batch, heads,
        seq, head_dim] (kv heads may be fewer) that return causal attention, or
        where ``mask`` is not None exactly what it allows (then queries and keys
        may differ in number). A core with ``takes_spans`` set also takes
        ``composer.models.common.mask``'s ``Documents`` and ``LowerRight`` (masks
        that hold no query x key entry, which context parallel's all-gather then
        hands it; others get an additive mask), and one with a ``flex`` attribute
        FlexAttention BlockMasks (``model.attention``, which sets ``flex`` on the
        cores and the mask module). Context parallel wraps each in its own, which
        calls it with the mask of what a rank holds and the options as they came,
        but for two it must know: ``window`` (an int: each query sees only the
        keys fewer than that many positions before it; folded into the mask where
        a rank holds part of the sequence) and ``sinks`` (one tensor entry per q
        head; cut to a rank's heads). The model's forward must then take
        ``positions`` (the sequence positions of its input's columns). ValueError,
        naming it, where the model also mixes positions outside its cores (an SSM
        layer): neither documents nor context parallel reach there. None: no
        context parallel.
    attention_mask: FQN of the module (without weights) the model's forward
        calls once as ``mask = module(documents, h)`` (``h`` its hidden
        states, whose dtype and device the mask takes) to build the ``mask`` every
        core is given; ``documents`` ([batch, seq], each position's document
        number, or None) come from the forward's ``documents`` argument, and
        ``positions`` may then be per sequence ([batch, seq]). Context parallel
        puts its own module there. None: the model takes no documents
        (``data.document_mask``, ``data.reset_positions``) and no context parallel.
    heads: model arguments -> {name: count} of the attention heads (q and kv),
        which context parallel's all-to-all method divides over cp ranks.
    set_sequence_sum: (model, fn) -> None, for models whose forward needs
        statistics of whole sequences (an MoE sequence-wise auxiliary loss):
        ``fn(t)`` sums a tensor of per-sequence statistics over the ranks that
        each hold part of every sequence (context parallel). None: the model
        needs none.
    recompute_context: block -> a context manager that activation
        checkpointing holds while it recomputes the block's forward in backward
        (e.g. routers that must not count their tokens twice).
    compile_fullgraph: whether each block compiles as one graph (False where
        blocks break it, e.g. data-dependent expert routing).

    >>> from torch import nn
    >>> from composer import ParallelHooks
    >>> hooks = ParallelHooks(tp_divisible=lambda args: {"n_heads": args["n_heads"]},
    ...                       pipeline_units=lambda model: [f"layers.{k}" for k in model.layers])
    >>> model = nn.Module()
    >>> model.layers = nn.ModuleDict({"0": nn.Linear(2, 2), "1": nn.Linear(2, 2)})
    >>> hooks.tp_divisible({"n_heads": 4}), hooks.pipeline_units(model), hooks.moe_modules
    ({'n_heads': 4}, ['layers.0', 'layers.1'], None)
    """

    tp_divisible: Callable[[Any], dict[str, int]] = field(default=lambda args: {})
    tp_optional: tuple[str, ...] = ()
    pipeline_units: Callable[[nn.Module], list[str]] | None = None
    pipeline_pass_through: bool = True
    moe_modules: Callable[[nn.Module], dict[str, nn.Module]] | None = None
    attention_cores: Callable[[nn.Module], list[str]] | None = None
    attention_mask: str | None = None
    heads: Callable[[Any], dict[str, int]] = field(default=lambda args: {})
    set_sequence_sum: Callable[[nn.Module, Callable], None] | None = None
    recompute_context: Callable[[nn.Module], ContextManager] = (
        lambda block: contextlib.nullcontext())
    compile_fullgraph: bool = True


@dataclass
class TrainingHooks:
    """What the trainer, its metrics and the planner ask of a model: its cost,
    its sizes and the scale of the loss terms its forward adds.

    flops_per_token: (model arguments, seq_len) -> training FLOPs per token
        (forward + backward); optional for a custom model (MFU is then null).
    shape: model arguments -> its TransformerShape, what the planner
        (``composer.planner``) predicts memory, traffic and time from. None: the
        planner measures the model instead, on fake tensors (``composer.planner.trace``).
    set_loss_scale: (model, scale) -> None, for models whose forward adds loss
        terms of its own (an MoE auxiliary loss): the factor the trainer
        applies to its summed loss, so those terms are scaled alike.

    >>> from composer import TrainingHooks
    >>> hooks = TrainingHooks(flops_per_token=lambda params, seq_len: 6 * params)
    >>> hooks.flops_per_token(1000, 32)
    6000
    """

    flops_per_token: Callable[[Any, int], float] = lambda args, seq_len: 0.0
    shape: Callable[[Any], TransformerShape] | None = None
    set_loss_scale: Callable[[nn.Module, float], None] = lambda model, scale: None


@dataclass
class Adapters:
    """What the converters (float8, LoRA, QLoRA) and the Hugging Face
    checkpoint I/O ask of a model: which modules they treat specially and how
    its weights map to Hugging Face's.

    logits_modules: last names of the modules that produce the logits (float8
        keeps them in high precision; a tied one cannot take a merged adapter).
    lora_targets: last names of the linears LoRA adapts by default.
    hf_adapter: model arguments -> its StateDictAdapter (the class). None: no
        Hugging Face import/export.

    >>> from composer import Adapters
    >>> adapters = Adapters(logits_modules=("lm_head",), lora_targets=("query", "value"))
    >>> adapters.lora_targets, adapters.hf_adapter
    (('query', 'value'), None)
    """

    logits_modules: tuple[str, ...] = ("output",)
    lora_targets: tuple[str, ...] = ()
    hf_adapter: type[StateDictAdapter] | None = None


@contextlib.contextmanager
def not_counting(layers: list) -> Iterator[None]:
    """The MoE ``layers`` stop counting tokens inside (``count_tokens`` false), as they
    were after: a recomputed forward (``ParallelHooks.recompute_context``) is no new
    batch."""
    before = [layer.count_tokens for layer in layers]
    for layer in layers:
        layer.count_tokens = False
    try:
        yield
    finally:
        for layer, flag in zip(layers, before):
            layer.count_tokens = flag


class NoSequenceParallel(ValueError):
    """What a spec's ``tp_plan`` raises, with sequence parallel asked, where the model's
    plan cannot cut the residual stream on the sequence (its message says where and why):
    ``parallelism.sequence_parallel = "auto"`` then turns it off; ``true`` is refused
    with this line."""


def names_match(name: str, pattern: str) -> bool:
    """Whether the module (or parameter) FQN ``name`` is one a tensor-parallel plan key
    names (``*`` matches any one name)."""
    names, parts = name.split("."), pattern.split(".")
    return len(names) == len(parts) and all(fnmatch.fnmatchcase(n, p) for n, p in zip(names, parts))


@dataclass
class ModelSpec:
    """How to build, cut and cost one family of models. A plain model needs
    only the first four fields; the hooks are grouped by who asks for them.

    flavors: flavor name -> model arguments (any object ``build`` accepts).
    build: model arguments -> module; called under ``torch.device("meta")``,
        so it must not touch parameter values (``init_weights()`` does that).
    blocks: module -> the repeated units (transformer blocks) that FSDP,
        activation checkpointing and compile wrap one by one.
    tp_plan: {module FQN pattern: style}; ``*`` matches one name. A style is a
        name that ``composer.parallel.tensor`` resolves (``"colwise"``,
        ``"rowwise"``, ``"embedding"``, ``"output"``, ``"norm"``,
        ``"replicate_input"``, ``"gathered"``, ...: its ``STYLES``), or a DTensor
        ParallelStyle; or a function (sequence_parallel, loss_parallel) -> such
        a plan, or, where the plan depends on the model, (sequence_parallel,
        loss_parallel, model) -> such a plan (the model on the meta device, or a
        pipeline stage of it). None: no tensor parallel.
    parallel: what the parallelize passes ask (``ParallelHooks``).
    training: what the trainer, its metrics and the planner ask (``TrainingHooks``).
    adapters: what the converters and the Hugging Face I/O ask (``Adapters``).

    >>> from torch import nn
    >>> from composer import ModelSpec
    >>> spec = ModelSpec(name="mlp", flavors={"tiny": 8, "wide": 64},
    ...                  build=lambda dim: nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(),
    ...                                                  nn.Linear(4 * dim, dim)),
    ...                  blocks=lambda model: [model])
    >>> spec.num_params(spec.flavors["tiny"]), spec.build_meta(8)[0].weight.device.type
    (552, 'meta')
    """

    name: str
    flavors: dict[str, Any]
    build: Callable[[Any], nn.Module]
    blocks: Callable[[nn.Module], list[nn.Module]]
    tp_plan: dict | Callable[..., dict] | None = None
    parallel: ParallelHooks = field(default_factory=ParallelHooks)
    training: TrainingHooks = field(default_factory=TrainingHooks)
    adapters: Adapters = field(default_factory=Adapters)

    def block_names(self, model: nn.Module) -> list[str]:
        names = {id(m): name for name, m in model.named_modules()}
        return [names[id(b)] for b in self.blocks(model)]

    def held_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The blocks ``model`` (the whole model or a pipeline stage) holds: ``blocks``
        without the ``PassThrough``s a stage holds in place of the other stages' blocks."""
        return [b for b in self.blocks(model) if not isinstance(b, PassThrough)]

    def build_meta(self, args: Any) -> nn.Module:
        with torch.device("meta"):
            return self.build(args)

    def num_params(self, args: Any) -> int:
        """Parameter count of a flavor, without allocating it (tied weights count once)."""
        return sum(p.numel() for p in self.build_meta(args).parameters())
