"""What a step feeds the model: this rank's loaders, and each batch cut to the
columns this rank computes (context parallel) with the model's keyword
arguments (packed documents and their positions)."""
from __future__ import annotations

import torch

from composer.config import Data, JobConfig
from composer.data import DataLoader
from composer.data.loader import document_positions
from composer.job.data import config_errors
from composer.mesh import ParallelDims
from composer.parallel.context import local_positions
from composer.trainer.validation import Validation


def build_loaders(d: Data, tokenizer, local_batch_size: int, data_rank: int, data_degree: int,
                  validation: bool) -> tuple[DataLoader, DataLoader | None]:
    """This rank's training (and, with ``validation``, validation) loader of the data
    ``d`` describes: the data is tokenised here, and a dataset that cannot give one
    window is the CLI's one line."""

    def loader(split: str) -> DataLoader:
        with config_errors(f"data.dataset={d.dataset!r}: "):
            return DataLoader(d.dataset, tokenizer, d.seq_len, local_batch_size, data_rank,
                              data_degree, split=split, val_fraction=d.val_fraction,
                              text_field=d.text_field, format=d.format,
                              sft_packing=d.sft_packing, document_mask=d.document_mask,
                              streaming=d.streaming, columns=d.columns)

    return loader("train"), loader("validation") if validation else None


def build_data(cfg: JobConfig, tokenizer, dims: ParallelDims, rank: int, accum_steps: int,
               validation: bool) -> tuple[DataLoader, Validation, BatchCut]:
    """This rank's training loader, its validation and the cut of a batch to its columns."""
    train, held_out = build_loaders(cfg.data, tokenizer, cfg.training.local_batch_size,
                                    dims.data_rank(rank), dims.data_degree, validation)
    return train, Validation(held_out, cfg.validation.steps * accum_steps, cfg.validation.freq,
                             cfg.training.steps), BatchCut(cfg.data.seq_len, dims.cp,
                                                           dims.coords(rank)["cp"],
                                                           cfg.data.reset_positions)


class BatchCut:
    """A loader's batch -> (inputs, targets, model keyword arguments) of the
    columns this rank computes: all of them, or under context parallel its two
    chunks of every sequence. The arguments hold the documents of the whole
    sequence and, with ``data.reset_positions``, each column's position in its
    document."""

    def __init__(self, seq_len: int, cp: int, cp_rank: int, reset_positions: bool):
        self.reset_positions = reset_positions
        self.columns = local_positions(seq_len, cp, cp_rank) if cp > 1 else None

    def __call__(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        inputs, targets, *documents = batch
        kwargs = {}
        if documents:
            kwargs["documents"] = documents[0]
            if self.reset_positions:
                kwargs["positions"] = document_positions(documents[0])
        if self.columns is None:
            return inputs, targets, kwargs
        if "positions" in kwargs:
            kwargs["positions"] = kwargs["positions"][:, self.columns]
        return inputs[:, self.columns], targets[:, self.columns], kwargs
