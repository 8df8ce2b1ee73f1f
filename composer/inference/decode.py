"""A trained model answering prompts: the job's model on the job's layout with its
weights from a DCP step or a Hugging Face folder, a KV cache in place of its attention
cores, and greedy or sampled decoding. What ``composer.tools.generate``,
``composer.tools.eval`` and the trainer's validation samples share.

The cache is a wrapper around each attention core (``ModelSpec.parallel.attention_cores``,
the hook context parallel uses), so any family with cores gets one without a change to
the model: it keeps the keys and values of the positions seen and hands the core the
mask of a query block at the end of them. A model whose forward cannot take one token
at a time (sequence or context parallel cut the sequence over ranks) decodes without
the cache instead, the whole sequence right-padded to a width the layout can cut
(causal attention: the pads change no position before them).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from composer.checkpoint.dcp import Checkpointer, everything, find_resume, problem
from composer.checkpoint.hf import load_hf_parts
from composer.converters.base import added_keys, saved_keys
from composer.models.common.mask import additive_mask
from composer.parallel.context import local_positions
from composer.parallel.materialize import full_tensor

log = logging.getLogger("composer")

# what a model that answers does not need of a training job
INFERENCE = ["--parallelism.sequence_parallel", "false", "--parallelism.loss_parallel", "false",
             "--compile.enable", "false", "--activation_checkpoint.mode", "none",
             "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
             "--validation.enable", "false"]


def checkpoint_args(checkpoint: str | None) -> list[str]:
    """The overrides that start a model from ``checkpoint``: a Hugging Face folder
    becomes its initial weights; a DCP step (or a checkpoint folder: its newest complete
    step) is loaded after them (``load_step``), so none."""
    if checkpoint and (Path(checkpoint) / "config.json").is_file():
        return ["--checkpoint.initial_load_path", checkpoint]
    return []


def dcp_step(checkpoint: str | None) -> Path | None:
    """The DCP step ``checkpoint`` names (a step, or a folder of steps: its newest
    complete one); ValueError for anything else."""
    if not checkpoint or (Path(checkpoint) / "config.json").is_file():
        return None
    path = Path(checkpoint)
    if path.is_dir() and problem(path) is None:
        return path
    newest = find_resume(path, -1, quiet=True) if path.is_dir() else None
    if newest is None:
        raise ValueError(f"--checkpoint {checkpoint}: not a Hugging Face folder (config.json), a "
                         f"complete DCP step, nor a folder holding one")
    return newest


def load_weights(plan: Any, parts: list[nn.Module], step: Path | None) -> None:
    """The plan's initial weights (a Hugging Face folder or a DCP step), then the
    entries of ``step`` that the job's checkpoints hold (with LoRA: its adapters)."""
    added = added_keys(plan.converters)
    if plan.initial is not None:
        if (plan.initial / "config.json").is_file():
            load_hf_parts(parts, plan.initial, plan.spec, plan.args, added)
        else:
            _load(parts, plan.initial, lambda key: not added(key))
    for converter in plan.converters:
        converter.weights_loaded(parts)
    if step is not None:
        _load(parts, step, saved_keys(plan.converters) or everything)


def _load(parts: list[nn.Module], step: Path, keys) -> None:
    Checkpointer(step.parent, parts, [], keys=keys).load(step, {}, model_only=True, keys=keys)


class CachedAttention(nn.Module):
    """An attention core that keeps the keys and values it has seen: a call with q of
    n new positions and their k, v attends over every position so far, each new query
    to the keys at or before it."""

    def __init__(self, core: nn.Module):
        super().__init__()
        self.core = core
        self.k = self.v = None

    def forward(self, q, k, v, mask=None, **options):
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        past = k.shape[2] - q.shape[2]
        if past == 0:
            return self.core(q, k, v, mask, **options)
        rows = torch.arange(q.shape[2], device=q.device)[:, None] + past
        allowed = rows >= torch.arange(k.shape[2], device=q.device)[None, :]
        return self.core(q, k, v, additive_mask(allowed, q.dtype), **options)


@contextlib.contextmanager
def kv_cache(model: nn.Module, spec: Any) -> Iterator[None]:
    """``model``'s attention cores wrapped in ``CachedAttention`` (empty caches) for
    the duration; the cores are put back after."""
    if spec.parallel.attention_cores is None:
        raise ValueError(f"model {spec.name!r} names no attention cores "
                         f"(ModelSpec.parallel.attention_cores), where a KV cache goes")
    fqns = spec.parallel.attention_cores(model)
    cores = {fqn: model.get_submodule(fqn) for fqn in fqns}
    for fqn, core in cores.items():
        model.set_submodule(fqn, CachedAttention(core))
    try:
        yield
    finally:
        for fqn, core in cores.items():
            model.set_submodule(fqn, core)


def pick(logits: torch.Tensor, temperature: float, top_p: float,
         generator: torch.Generator | None) -> int:
    """The next token from one position's logits: the most likely at temperature 0, else
    a draw from softmax(logits / temperature) cut to its top-p nucleus (the fewest most
    likely tokens whose probabilities sum to at least ``top_p``)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs
    sorted_probs[before >= top_p] = 0
    drawn = torch.multinomial(sorted_probs.cpu(), 1, generator=generator)
    return int(order[drawn.to(order.device)])


class Decoder:
    """Greedy or sampled decoding from one model (a whole model, on any layout whose
    forward takes whole sequences). ``pad_to``: None decodes with a KV cache; a width
    decodes without one, each step's whole sequence right-padded to it (sequence or
    context parallel, whose forward takes only sequences of that width). ``cp_group``:
    under context parallel, the group whose ranks each feed the model their columns of
    the window (``local_positions``) and share the logits."""

    def __init__(self, model: nn.Module, spec: Any, device: torch.device,
                 max_len: int | None = None, pad_to: int | None = None, seed: int = 0,
                 cp_group=None):
        self.model, self.spec, self.device = model, spec, device
        self.max_len, self.pad_to, self.cp_group = max_len, pad_to, cp_group
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, stop: set[int] | frozenset = frozenset(),
                 stop_text: tuple[list[str], Callable] | None = None) -> list[int]:
        """The new tokens after ``prompt``: ``max_new_tokens`` of them, or up to and
        including the first one in ``stop``, or up to the one whose text completes a
        string of ``stop_text`` = (strings, decode)."""
        width = self.pad_to or self.max_len
        if width is not None and len(prompt) + max_new_tokens > width:
            raise ValueError(f"{len(prompt)} prompt tokens and {max_new_tokens} new ones pass "
                             f"the model's {width} positions")
        step = self._uncached if self.pad_to else self._cached
        out: list[int] = []
        with (contextlib.nullcontext() if self.pad_to else kv_cache(self.model, self.spec)):
            for _ in range(max_new_tokens):
                token = pick(step(prompt, out), temperature, top_p, self.generator)
                out.append(token)
                if token in stop or (stop_text is not None and any(
                        s and s in stop_text[1](out) for s in stop_text[0])):
                    break
        return out

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """The logits [len(tokens), vocab] of one sequence, no cache."""
        if self.pad_to is None:
            return _float(full_tensor(self.model(torch.tensor([tokens], device=self.device)))[0])
        return self._padded(tokens)[:len(tokens)]

    def _cached(self, prompt: list[int], out: list[int]) -> torch.Tensor:
        """The logits after the newest token, feeding only what the cache has not seen."""
        start = len(prompt) + len(out) - 1 if out else 0
        new = (prompt + out)[start:]
        positions = torch.arange(start, start + len(new), device=self.device)
        logits = self.model(torch.tensor([new], device=self.device), positions=positions)
        return _float(full_tensor(logits)[0, -1])

    def _uncached(self, prompt: list[int], out: list[int]) -> torch.Tensor:
        return self._padded(prompt + out)[len(prompt) + len(out) - 1]

    def _padded(self, seq: list[int]) -> torch.Tensor:
        """The logits of the window ``seq`` right-padded to ``pad_to`` (a context-parallel
        rank feeds its columns, and the ranks share theirs)."""
        if len(seq) > self.pad_to:
            raise ValueError(f"{len(seq)} tokens pass the window of {self.pad_to}")
        tokens = torch.tensor([seq + [0] * (self.pad_to - len(seq))], device=self.device)
        if self.cp_group is None:
            return _float(full_tensor(self.model(tokens))[0])
        cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        mine = full_tensor(self.model(tokens[:, local_positions(self.pad_to, cp, rank)]))[0]
        pieces = [torch.empty_like(mine) for _ in range(cp)]
        dist.all_gather(pieces, mine.contiguous(), group=self.cp_group)
        every = torch.cat([local_positions(self.pad_to, cp, r) for r in range(cp)])
        whole = torch.empty_like(torch.cat(pieces))
        whole[every.to(whole.device)] = torch.cat(pieces)
        return _float(whole)


def _float(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.dtype == torch.float64 else logits.float()


__all__ = ["INFERENCE", "CachedAttention", "Decoder", "checkpoint_args", "dcp_step", "kv_cache",
           "load_weights", "pick"]
