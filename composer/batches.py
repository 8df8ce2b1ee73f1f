"""What a step feeds the model: this rank's loaders, and each batch cut to the
columns this rank computes (context parallel) with the model's keyword
arguments (packed documents and their positions)."""
from __future__ import annotations

import torch

from composer.data import DataLoader
from composer.data.loader import document_positions
from composer.parallel.context import local_positions
from composer.plan import Plan, config_errors


def build_loaders(plan: Plan) -> tuple[DataLoader, DataLoader | None]:
    """This rank's training (and validation) loader: the data is tokenised here,
    and a dataset that cannot give one window is the CLI's one line."""
    cfg, d = plan.cfg, plan.cfg.data

    def loader(split: str) -> DataLoader:
        with config_errors(f"data.dataset={d.dataset!r}: "):
            return DataLoader(d.dataset, plan.tokenizer, d.seq_len, cfg.training.local_batch_size,
                              plan.dims.data_rank(plan.rank), plan.dims.data_degree, split=split,
                              val_fraction=d.val_fraction, text_field=d.text_field,
                              format=d.format, sft_packing=d.sft_packing,
                              document_mask=d.document_mask, streaming=d.streaming,
                              columns=d.columns)

    return loader("train"), loader("validation") if plan.validation else None


class BatchCut:
    """A loader's batch -> (inputs, targets, model keyword arguments) of the
    columns this rank computes: all of them, or under context parallel its two
    chunks of every sequence. The arguments hold the documents of the whole
    sequence and, with ``data.reset_positions``, each column's position in its
    document."""

    def __init__(self, plan: Plan):
        dims = plan.dims
        self.reset_positions = plan.cfg.data.reset_positions
        self.columns = (local_positions(plan.cfg.data.seq_len, dims.cp,
                                        dims.coords(plan.rank)["cp"])
                        if dims.cp > 1 else None)

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
