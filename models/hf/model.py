"""A transformers causal LM as it is, built from its config on the meta device with
transformers' own classes, in the calling convention composer's trainer uses:
``model(tokens, documents=None, positions=None) -> logits``.

The transformers model sits under ``lm``, so our names are transformers' own under
``lm.`` (the Hugging Face layout, ``layout.py``, drops and adds that prefix). Every
attention module gets a ``core`` (``attention.py``) that does the attention, and the
model a ``document_mask`` module that turns packed documents into the mask the cores
take: modules of their own, so that a pass can put others in their place. A pipeline
stage (``pipeline.py``) is this model with ``PassThrough``s in place of the units it
lacks.

A model whose attention passes what composer's attention cannot honour (found when it
is built, so at validation, before any process group: one token runs through the meta
model up to its first attention call, whose arguments are checked there), or that does
not call transformers' attention interface at all, runs with transformers' own eager
attention and the causal mask transformers builds for it: ``unrouted`` says why, and
packed documents and context parallel, which need composer's attention, are refused.
"""
from __future__ import annotations

import inspect
import logging

import torch
from torch import nn

from composer.models.hf import attention, experts, pipeline
from composer.models.hf.layout import causal_lm
from composer.spec import PassThrough

log = logging.getLogger(__name__)


def attention_modules(layer: nn.Module) -> list[nn.Module]:
    """The attention modules of a decoder layer: transformers names their classes
    ``...Attention`` (latent attention's, some ``...MLA``)."""
    return [m for m in layer.modules() if type(m).__name__.endswith(("Attention", "MLA"))]


def decoder_layers(lm: nn.Module) -> str:
    """The name in ``lm`` of its decoder layers, wherever the model keeps them (``layers``,
    ``h``, ``blocks``, ``decoder.layers``, ...): of its non-empty nn.ModuleLists, one as
    long as the config's layer count, the one holding most parameters (a layer's own lists,
    its experts', sit inside it); ValueError where it has none."""
    count = getattr(lm.config.get_text_config(), "num_hidden_layers", None)
    lists = [(name, m) for name, m in lm.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    lists = [item for item in lists if len(item[1]) == count] or lists
    if not lists:
        raise ValueError(f"{type(lm).__name__}: it holds no nn.ModuleList of decoder layers, "
                         f"where composer's passes find its blocks")
    return max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))[0]


def counts_positions(lm: nn.Module) -> bool:
    """Whether the module holding the input embedding takes the token ids and the positions
    (BERT's and RoBERTa's ``embeddings``): it counts the positions itself where none are
    given, its own way. A model of its own (a multimodal model's text model) counts
    them from its input's length, which a pass may have cut: it is given them."""
    from transformers import PreTrainedModel
    embedding = lm.get_input_embeddings()
    owner = next(m for m in lm.modules() if any(c is embedding for c in m.children()))
    taken = inspect.signature(owner.forward).parameters
    return (not isinstance(owner, PreTrainedModel)
            and {"input_ids", "position_ids"} <= set(taken))


class _Reached(Exception):
    """The first attention call took its arguments: the check is done."""


def _no_padding_check(input_ids, attention_mask) -> None:
    """In place of transformers' check of a batch's first and last token for padding
    (``warn_if_padding_and_no_attention_mask``): a host sync each step (and impossible
    on the meta device) for a warning composer's batches never need, since they hold
    no padding that a mask does not already keep out of the loss."""


def _as_from_pretrained(lm: nn.Module, dtype: torch.dtype) -> None:
    """``lm`` as ``from_pretrained`` holds it: a parameter the model makes in float32 by
    hand (XLNet's) in the wider ``dtype`` asked, but what the model keeps in float32
    (``_keep_in_fp32_modules``); and without the per-step padding check."""
    from transformers import PreTrainedModel
    kept = [k for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")
            for k in getattr(lm, attr, None) or ()]
    for owner, module in lm.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if (param.is_floating_point() and param.itemsize < dtype.itemsize
                    and not any(k in f"{owner}.{name}" for k in kept)):
                module.register_parameter(name, nn.Parameter(param.detach().to(dtype),
                                                             param.requires_grad))
        if isinstance(module, PreTrainedModel):
            module.warn_if_padding_and_no_attention_mask = _no_padding_check


class _OwnTable(Exception):
    """transformers picks the model's attention class by implementation name from a
    table of its own, which has no entry for composer's."""


class HFCausalLM(nn.Module):
    """``AutoModelForCausalLM.from_config(config)`` with composer's attention."""

    def __init__(self, config):
        super().__init__()
        attention.register()
        self.unrouted: str | None = None
        try:
            self._build(config, attention.NAME)
            self.check_attention()
        except (attention.Refused, _OwnTable) as e:
            self.unrouted = str(e)
        if self.unrouted:  # transformers' own attention, with the causal mask it builds
            self._build(config, "eager")

    def _build(self, config, implementation: str) -> None:
        """transformers' model with ``implementation`` as its attention; with composer's,
        every attention module gets a ``core``."""
        config._attn_implementation = implementation
        dtype = torch.get_default_dtype()
        # torch's grouped matmul takes no float64: experts then run one matmul each
        eager = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
        try:
            self.lm = causal_lm(config, attn_implementation=implementation, dtype=dtype,
                                trust_remote_code=bool(getattr(config, "auto_map", None)),
                                **eager)
        except KeyError as e:  # a table of its own, by implementation name (GPT-Neo's, GIT's)
            if e.args != (implementation,):
                raise
            raise _OwnTable(f"transformers' {config.model_type} picks its attention class "
                            f"from a table of its own, not through transformers' attention "
                            f"interface, where composer's attention is registered") from None
        _as_from_pretrained(self.lm, dtype)
        self.layers_name = decoder_layers(self.lm)
        if implementation == attention.NAME:
            for module in attention_modules(self.lm):  # the decoder layers' and any others'
                module.core = attention.Core()
        for name, module in self.lm.named_modules():
            if experts.is_experts(module):
                experts.route(module, experts.param_styles(self.lm, name))
        self.document_mask = attention.DocumentMask(flex=False)
        self.counts_positions = counts_positions(self.lm)
        self.head_units = pipeline.head_units(self.lm)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (the blocks)."""
        return self.lm.get_submodule(self.layers_name)

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens`` [batch, seq] -> logits [batch, seq, vocab]; ``documents``: each
        position's document number (packed documents attend within their own);
        ``positions``: the positions of the columns held, [seq] or [batch, seq]. On a
        pipeline stage without the embedding ``tokens`` are the hidden states [batch,
        seq, dim] of the stage before (transformers' ``inputs_embeds``); a stage without
        the head returns its hidden states (transformers' base model's output)."""
        embedded = tokens.is_floating_point()
        like = tokens if embedded else self.lm.get_input_embeddings().weight
        mask = self.document_mask(documents, like)
        # given unless an embeddings module counts them from the token ids itself (RoBERTa's,
        # offset by its padding index): transformers would count them from the embeddings'
        # output, which holds only a slice of the sequence where a pass cuts it there
        if positions is None and not (self.counts_positions and not embedded):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        if positions is not None and positions.dim() == 1:
            positions = positions[None].expand(tokens.shape[0], -1)
        inputs = {"inputs_embeds" if embedded else "input_ids": tokens}
        kwargs = dict(position_ids=positions, use_cache=False, **inputs)
        if not self.unrouted:
            kwargs["composer_mask"] = mask
        if self.holds_head():
            return self.lm(**kwargs).logits
        return self.lm.base_model(**kwargs).last_hidden_state

    def holds_head(self) -> bool:
        """Whether this model (or pipeline stage) holds the head that writes the logits."""
        return not any(isinstance(self.lm.get_submodule(name), PassThrough)
                       for name in self.head_units)

    def check_attention(self) -> None:
        """``attention.Refused`` naming the first argument transformers passes attention
        that composer's attention cannot honour, or that the model stops on a None before
        attention where it reads transformers' attention mask itself (sparse attention's
        indexer, MPT's ALiBi blocks). One token runs up to the first attention call (on
        the meta device, where the model is built: no numbers), so what a model passes
        is known before its first step. Later calls (layers with attention of another
        class), and models whose meta forward cannot reach an attention call (a
        data-dependent op before it), are checked at the first forward. A forward that
        ends without calling attention sets ``unrouted``."""
        entered = []

        def reached(module, args):
            raise _Reached

        hooks = [m.register_forward_pre_hook(reached) for m in self.modules()
                 if isinstance(m, attention.Core)]
        if not hooks:
            return
        hooks += [m.register_forward_pre_hook(lambda m, args: entered.append(m))
                  for m in attention_modules(self.lm)]
        token = torch.zeros(1, 1, dtype=torch.long,
                            device=self.lm.get_input_embeddings().weight.device)
        try:
            self(token)
            # whole forward, no attention call: its attention computes the weights itself
            self.unrouted = (f"{type(self.lm).__name__}'s attention modules do not call "
                             f"transformers' attention interface")
        except _Reached:
            pass
        except attention.Refused:
            raise
        except Exception as e:  # transformers' code the meta device cannot run
            if isinstance(e, (TypeError, AttributeError)) and "NoneType" in str(e):
                # a None where transformers' attention mask would be: the model reads it
                where = type(entered[-1] if entered else self.lm).__name__
                raise attention.Refused(
                    f"{where} reads transformers' attention mask before its attention, "
                    f"which composer's attention replaces ({type(e).__name__}: {e})") from None
            log.info("%s: its attention arguments are checked at its first forward (the "
                     "meta model stops before its first attention call: %s)",
                     type(self.lm).__name__, e)
        finally:
            for hook in hooks:
                hook.remove()

    def init_weights(self) -> None:
        """transformers' own initialisation of every module (and its rotary tables)."""
        self.lm.initialize_weights()
        self.lm.tie_weights()
        for module in self.modules():
            if isinstance(module, experts.Routed):
                module.reset_stats()
