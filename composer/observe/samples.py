"""Samples at each validation (``validation.generate``): the model continues a few
prompts greedily, so a run shows what it writes as well as its loss.

Every rank decodes every prompt (the model's collectives run on all of them); rank 0
logs each sample and appends it to ``<dump folder>/samples.jsonl`` as ``{"step",
"prompt", "tokens", "text"}``. Layouts whose forward takes one token at a time use a KV
cache; sequence or context parallel and compiled blocks take whole windows of
``data.seq_len``, so each step there runs the padded window (``composer.inference.decode``).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from composer.inference.decode import Decoder
from composer.observe.base import Observer

log = logging.getLogger("composer")


class ValidationSamples(Observer):
    def __init__(self, view, decoder: Decoder, prompts: list[str], new_tokens: int):
        self.view, self.decoder, self.prompts, self.new_tokens = view, decoder, prompts, new_tokens
        self.path = Path(view.cfg.job.dump_folder) / "samples.jsonl"

    def report(self, step: int, row: dict) -> None:
        if "val_loss" not in row:
            return
        tokenizer, model = self.view.plan.tokenizer, self.decoder.model
        stop = set() if tokenizer.eos_id is None else {tokenizer.eos_id}
        bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        training = model.training
        model.eval()
        try:
            samples = [(prompt, self.decoder.generate(bos + tokenizer.encode(prompt),
                                                      self.new_tokens, stop=stop))
                       for prompt in self.prompts]
        finally:
            model.train(training)
        if self.view.plan.rank != 0:
            return
        with open(self.path, "a") as out:
            for prompt, tokens in samples:
                text = tokenizer.decode(tokens)
                log.info("sample at step %d: %r -> %r", step, prompt, text)
                out.write(json.dumps({"step": step, "prompt": prompt, "tokens": tokens,
                                      "text": text}, ensure_ascii=False) + "\n")


def samples_observer(view) -> ValidationSamples | None:
    """Samples where ``validation.generate`` names prompts and the run validates (the
    plan checked the layout and the lengths: ``composer.job.data.check_samples``)."""
    plan, cfg = view.plan, view.cfg
    if not cfg.validation.generate or not plan.validation:
        return None
    p, width = cfg.parallelism, cfg.data.seq_len
    whole_windows = (p.sequence_parallel and plan.dims.tp > 1) or plan.dims.cp > 1 or \
        cfg.compile.enable
    cp_group = plan.dims.mesh("cp").get_group() if plan.dims.cp > 1 else None
    decoder = Decoder(view.parts[0], plan.spec, plan.device, width,
                      pad_to=width if whole_windows else None, cp_group=cp_group)
    return ValidationSamples(view, decoder, list(cfg.validation.generate),
                             cfg.validation.generate_tokens)
