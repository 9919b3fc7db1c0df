"""Sparse tables in a training run: the rows a step reads, and dense tables where rows do not travel.

A sparse table is the weight of an nn.Embedding or nn.EmbeddingBag built with sparse=True. Under the
parameter server (ps-sync, ps-async, ssp) only its rows that a step reads are pulled and only the rows
it touched are pushed (ps/sparse_wire.py), so before a step a worker must know which rows its
micro-batches will look up. A model may say it (a method ``rows_needed(inputs) -> {table name: ids}``,
as the built-in word2vec's); otherwise RowsFinder runs the model's forward on the step's batches
without gradients, with a hook on each table recording the ids it is given: one extra forward a step,
the price of not asking the model.

The other strategies all-reduce gradients whole (ddp, zero1, diloco) or step alone (local): there the
tables are made dense (``make_dense``), as torch DDP trains an embedding without sparse=True.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def sparse_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Table name (its weight's name in named_parameters) -> the embedding module, for each sparse table."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(m.weight)]: m for m in model.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and id(m.weight) in names}


def make_dense(model: nn.Module) -> list[str]:
    """Turn every sparse table dense; the names of those that were sparse."""
    tables = sparse_modules(model)
    for module in tables.values():
        module.sparse = False
    return sorted(tables)


class RowsFinder:
    """``finder(batches, forward) -> {table name: ids}``: the rows of every sparse table that ``forward(batch)``
    reads over ``batches`` (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.tables = sparse_modules(model)

    def __call__(self, batches: list, forward: Callable) -> dict[str, torch.Tensor]:
        asked = getattr(self.model, "rows_needed", None)
        if asked is not None:
            return {name: torch.cat([asked(batch[0])[name] for batch in batches]) for name in self.tables}
        seen: dict[str, list[torch.Tensor]] = {name: [] for name in self.tables}

        def record(name: str):
            def hook(module, args):
                seen[name].append(args[0].detach().reshape(-1).to(torch.int64).cpu())
            return hook

        handles = [module.register_forward_pre_hook(record(name)) for name, module in self.tables.items()]
        try:
            with torch.no_grad():
                for batch in batches:
                    forward(batch)
        finally:
            for handle in handles:
                handle.remove()
        return {name: torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64) for name, ids in seen.items()}
