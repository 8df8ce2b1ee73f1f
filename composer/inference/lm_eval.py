"""lm-eval on composer's model: ``ComposerLM``, lm-eval's ``TemplateLM`` backed by the
model as it is laid out for training (one process, FSDP, tensor parallel; sequence and
context parallel through whole padded windows), registered with lm-eval as
``composer``; and ``evaluate``, which runs tasks on it. No Hugging Face export.

Requests are lm-eval's: log-likelihoods of continuations (and rolling ones of whole
texts) and greedy generation until a stop sequence, each scored as lm-eval's own
``hf`` backend scores it (the same truncation to the model's length, the same stop
handling, through lm-eval's helpers). Under data parallel lm-eval's evaluator hands each
data-parallel rank its share of the documents, padded to equal counts, and gathers
the results; ranks that share a batch in training (tensor, context parallel) share one
here. Where the model's collectives need every data-parallel rank in each forward (FSDP),
each generation runs its full ``max_gen_toks`` and is cut at its stop sequence after.

lm-eval is an optional dependency (``pip install 'composer-parallel[eval]'``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import random
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from composer.inference.decode import Decoder

log = logging.getLogger("composer")

MAX_GEN_TOKS = 256  # lm-eval's default for a request that names none


@register_model("composer")
class ComposerLM(TemplateLM):
    """lm-eval's view of a composer model: ``decoder`` (``composer.inference.decode.Decoder``,
    the model on its layout), the job's ``tokenizer``, ``max_length`` positions, and the
    data-parallel ``group`` (None: one data-parallel rank), over which lm-eval splits
    the documents. Build one from a job with ``composer.tools.eval``."""

    def __init__(self, decoder: Decoder, tokenizer: Any, max_length: int, group=None):
        super().__init__()
        self.decoder, self.composer_tokenizer, self._max_length = decoder, tokenizer, max_length
        self.group = group
        self._rank = dist.get_rank(group) if group is not None else 0
        self._world_size = dist.get_world_size(group) if group is not None else 1
        self._device = decoder.device

    @property
    def eot_token_id(self) -> int:
        return self.composer_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.composer_tokenizer.bos_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.composer_tokenizer, "path", "byte"))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs
                   ) -> list[int]:
        """The text's ids, no special tokens added (as lm-eval's hf backend encodes)."""
        return self.composer_tokenizer.encode(string)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.composer_tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        return [self._score(context, continuation) for _, context, continuation in requests]

    @torch.no_grad()
    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """(sum of the continuation's log-probabilities, whether greedy decoding would
        write it), the input cut on the left to ``max_length`` as lm-eval's hf does."""
        tokens = (context + continuation)[-(self.max_length + 1):][:-1]
        logits = self.decoder.logits(tokens)[-len(continuation):]
        logprobs = F.log_softmax(logits, dim=-1)
        target = torch.tensor(continuation, device=logprobs.device)
        picked = logprobs.gather(-1, target[:, None])[:, 0]
        return float(picked.sum()), bool((logprobs.argmax(-1) == target).all())

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (text,) in (request.args for request in requests):
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            out.append(sum(self._score(context, continuation)[0]
                           for context, continuation in windows))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        return [self._generate(context, kwargs, eos)
                for context, kwargs in (request.args for request in requests)]

    def _generate(self, context: str, gen_kwargs: dict, eos: str) -> str:
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), MAX_GEN_TOKS)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        new = kwargs.pop("max_gen_toks")
        if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
            raise ValueError("composer's lm-eval model generates greedily (do_sample=false)")
        if new >= self.max_length:
            raise ValueError(f"a request asks for {new} new tokens; the model's length here is "
                             f"{self.max_length}")
        prompt = self.tok_encode(context)[-(self.max_length - new):]
        # where every data-parallel rank must run each forward, all run the same number
        lockstep = self.world_size > 1
        stop = frozenset() if lockstep else frozenset({self.eot_token_id})
        tokens = self.decoder.generate(prompt, new, stop=stop,
                                       stop_text=None if lockstep else (until, self.tok_decode))
        return postprocess_generated_text(self.tok_decode(tokens), until, None)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return tensor
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self.group)
        return torch.stack(out)

    def gather_object(self, obj, dst: int = 0):
        if self.group is None:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out if self.rank == dst else None

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


@functools.cache
def task_manager(names: tuple[str, ...], include_path: str | None):
    """lm-eval's ``TaskManager`` that knows ``names``: the tasks of ``include_path`` alone
    where they are all there (indexing lm-eval's own thousands takes seconds), else
    lm-eval's with them. ValueError naming a task neither knows."""
    from lm_eval.tasks import TaskManager
    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(names) <= set(local.all_tasks):
            return local
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is no lm-eval task"
                         f"{' (nor in ' + include_path + ')' if include_path else ''}")
    return manager


def evaluate(lm: ComposerLM, tasks: list[str], include_path: str | None = None,
             limit: int | None = None, log_samples: bool = False) -> dict | None:
    """lm-eval's ``simple_evaluate`` of ``tasks`` on ``lm``: its results dict on the first
    data-parallel rank, None on the others."""
    from lm_eval import simple_evaluate
    model = lm.decoder.model
    training = model.training
    model.eval()
    try:
        with random_states_kept():  # lm-eval seeds the global generators
            return simple_evaluate(model=lm, tasks=list(tasks), limit=limit,
                                   log_samples=log_samples, bootstrap_iters=0,
                                   task_manager=task_manager(tuple(tasks), include_path))
    finally:
        model.train(training)


@contextlib.contextmanager
def random_states_kept():
    """Python's, numpy's and torch's global random states as they were before: an
    evaluation in training leaves the run's random stream where it was."""
    import numpy
    states = random.getstate(), numpy.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        numpy.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


__all__ = ["ComposerLM", "evaluate"]
