"""The job's data against its model, before any process group (plan.py's data half):
the tokenizer fits the model's vocabulary, the sequence its positions, the dataset has
the fields its format reads, documents reach every place the model mixes positions, a
token file is one the model can read, generation prompts fit a window. Nothing is
tokenised here (the trainer's loaders do that). Each check raises a ConfigError naming
the key."""
from __future__ import annotations

import contextlib
import logging
from typing import Any

from torch import nn

from composer.config import ConfigError, JobConfig
from composer.data import build_tokenizer, check_source, set_chat_template
from composer.data.sft import parse_columns
from composer.data.sources import carries_documents
from composer.data.tokens import read_meta, tokenizer_name
from composer.mesh import ParallelDims
from composer.spec import ModelSpec

log = logging.getLogger("composer")


@contextlib.contextmanager
def config_errors(prefix: str = ""):
    """A library's plain ValueError as the CLI's ConfigError (one line, exit 2)."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{prefix}{e}") from None


def unreached(spec: ModelSpec, meta: nn.Module) -> str | None:
    """Why documents and context parallel cannot reach every place the model mixes
    positions (the family's ``attention_cores`` says, e.g. an SSM layer), or None."""
    if spec.parallel.attention_cores is None:
        return None
    try:
        spec.parallel.attention_cores(meta)
    except ValueError as e:
        return str(e)
    return None


def limit_documents(cfg: JobConfig, spec: ModelSpec, meta: nn.Module, auto: bool) -> None:
    """Documents the model cannot keep apart everywhere: ``auto`` turns them off (and
    says why), an explicit ``data.document_mask = true`` is refused."""
    why = unreached(spec, meta) if cfg.data.document_mask is True else None
    if why and auto:
        cfg.data.document_mask = False
        log.info("data.document_mask=auto: off, %s: packed documents attend across their "
                 "boundaries there", why)
    elif why:
        raise ConfigError(f"data.document_mask=true: {why}; allowed: false")


def check_documents(cfg: JobConfig, spec: ModelSpec) -> None:
    d = cfg.data
    if d.reset_positions and not d.document_mask:
        raise ConfigError("data.reset_positions=true: positions restart at document "
                          "boundaries, which need data.document_mask=true")
    if d.streaming and d.format not in ("text", "tokens"):  # a token file always streams
        raise ConfigError(f"data.streaming=true: only data.format='text' streams; "
                          f"{d.format!r} examples are held in memory")
    documents = carries_documents(d.format, d.sft_packing, d.document_mask)
    if documents and spec.parallel.attention_mask is None:
        raise ConfigError(f"data.document_mask=true: model {spec.name!r} takes no document "
                          f"boundaries (ModelSpec.parallel.attention_mask); allowed: false")


def model_vocab(spec: ModelSpec, args: Any, meta: nn.Module) -> int | None:
    """The number of token ids the model takes: its arguments' ``vocab_size``, else
    the rows of its logits module (``ModelSpec.adapters.logits_modules``); None when
    neither says."""
    size = args.get("vocab_size") if isinstance(args, dict) else getattr(args, "vocab_size", None)
    if size is not None:
        return size
    for name, module in meta.named_modules():
        if name.rpartition(".")[2] in spec.adapters.logits_modules:
            return getattr(module, "out_features", None)
    return None


def max_seq_len(args: Any) -> int | None:
    """The most positions the model's arguments allow, where they say (``max_seq_len``)."""
    return args.get("max_seq_len") if isinstance(args, dict) else getattr(args, "max_seq_len",
                                                                          None)


def check_samples(cfg: JobConfig, dims: ParallelDims, tokenizer: Any) -> None:
    """``validation.generate``'s prompts fit a window with their new tokens, and the
    model is one part (composer/observe/samples.py)."""
    v = cfg.validation
    if not v.generate:
        return
    if dims.pp > 1:
        raise ConfigError(f"validation.generate={v.generate!r}: samples need the whole model "
                          f"in one part; allowed with parallelism.pipeline_parallel_degree=1")
    longest = max(len(tokenizer.encode(prompt)) for prompt in v.generate) + 1
    if longest + v.generate_tokens > cfg.data.seq_len:
        raise ConfigError(f"validation.generate_tokens={v.generate_tokens}: with the longest "
                          f"prompt's {longest} tokens it passes data.seq_len={cfg.data.seq_len}; "
                          f"allowed: 1..{max(cfg.data.seq_len - longest, 0)}")


def check_data(cfg: JobConfig, spec: ModelSpec, args: Any, meta: nn.Module) -> Any:
    """The tokenizer (returned) fits the model and the dataset has the fields its
    format reads; nothing is tokenised (the trainer's loaders do that)."""
    d = cfg.data
    check_documents(cfg, spec)
    limit = max_seq_len(args)
    if limit is not None and d.seq_len > limit:
        raise ConfigError(f"data.seq_len={d.seq_len}: longer than the model's maximum; "
                          f"allowed: 1..{limit}")
    with config_errors(f"data.tokenizer={d.tokenizer!r}: "):
        tokenizer = build_tokenizer(d.tokenizer)
    with config_errors(f"data.chat_template={d.chat_template!r}: "):
        set_chat_template(tokenizer, d.chat_template)
    if d.format in ("sft", "preference"):
        log.info("chats render with %s", f"the chat template {tokenizer.chat.source}"
                 if tokenizer.chat else "composer's built-in template (<|role|> headers)" + (
                     ": the tokenizer has none" if d.chat_template == "auto" else ""))
    vocab = model_vocab(spec, args, meta)
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise ConfigError(f"data.tokenizer={d.tokenizer!r}: its {tokenizer.vocab_size} ids do "
                          f"not fit the model's vocab_size {vocab}")
    with config_errors(f"data.columns={d.columns!r}: "):
        parse_columns(d.columns)
    with config_errors(f"data.dataset={d.dataset!r}: "):
        check_source(d.dataset, d.format, d.text_field, d.columns)
    if d.format == "tokens":
        check_token_file(d, tokenizer, vocab)
    return tokenizer


def check_token_file(d: Any, tokenizer: Any, vocab: int | None) -> None:
    """A token file's ids fit the model. Another data.tokenizer than the one that wrote
    it is only warned of: it renders samples and exports, not the tokens trained on."""
    meta = read_meta(d.dataset)
    if vocab is not None and meta["vocab_size"] > vocab:
        raise ConfigError(f"data.dataset={d.dataset!r}: its tokenizer's {meta['vocab_size']} "
                          f"ids do not fit the model's vocab_size {vocab}")
    if meta["tokenizer"] != tokenizer_name(tokenizer):
        log.warning("data.dataset=%r was tokenised with %s, but data.tokenizer=%r (which "
                    "samples and exports use)", d.dataset, meta["tokenizer"], d.tokenizer)
