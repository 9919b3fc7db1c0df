"""Sparse tables of a model (nn.Embedding / nn.EmbeddingBag with sparse=True) and a server's block of one.

Vocabulary (row_sharding.py, sparse_optim.py)
    table    a sparse parameter, R x D, named as in ``model.named_parameters()``
    block    the rows r = s, s+S, ... that server s holds, R_s x D, updated in place
    rows     local row ids within the block;  g  gradient rows, one per id

A worker's sparse gradient is coalesced (coalesce_rows: duplicate ids summed, ids sorted) before it
leaves, so a push carries each touched row once. In sync mode the server keeps each worker's rows for
the version and sums them, in worker order, when the last worker has pushed (TableBlock.take_mean):

    g_mean[r] = (sum over workers w that touched r of g_w[r]) / W

which is what one process with the W workers' batches concatenated computes for a mean loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gradsync.ps import row_sharding
from gradsync.ps.sparse_optim import SparseRows


@dataclass(frozen=True)
class TableSpec:
    index: int
    """Position among the model's sparse tables (the ROWS header's table word)."""
    name: str
    """The parameter's name in model.named_parameters()."""
    rows: int
    """R, rows of the table."""
    dim: int
    """D, elements per row."""
    element_size: int
    """Bytes per element (the model's dtype)."""

    @property
    def row_bytes(self) -> int:
        return self.dim * self.element_size


def find_sparse(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> weight of every nn.Embedding / nn.EmbeddingBag with sparse=True that requires grad."""
    sparse_ids = {id(m.weight) for m in model.modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
    return {name: p for name, p in model.named_parameters() if id(p) in sparse_ids and p.requires_grad}


def coalesce_rows(param: torch.Tensor, spec: TableSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique sorted row ids, their summed gradient rows) of ``param.grad``; empty when it has none."""
    grad = param.grad
    if grad is None:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, spec.dim, dtype=param.dtype)
    if not grad.is_sparse:
        raise RuntimeError(f"sparse table {spec.name} has a dense gradient; the parameter server pushes the rows "
                           f"of a sparse one (build the embedding with sparse=True, and do not replace .grad)")
    grad = grad.coalesce()
    return grad.indices()[0].contiguous(), grad.values().reshape(-1, spec.dim).contiguous()


class TableBlock:
    """Server ``server``'s block of table ``spec``: its rows, their optimizer, sync-mode contributions."""

    def __init__(self, spec: TableSpec, full: torch.Tensor, server: int, servers: int, rule: str,
                 group: dict) -> None:
        self.spec = spec
        self.server = server
        self.servers = servers
        self.block = nn.Parameter(full.detach()[server::servers].clone(), requires_grad=False)
        self.rows_held = self.block.shape[0]
        self.optimizer = SparseRows(rule, self.block.data, group)
        self.contributions: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, worker: int, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Sync mode: keep ``worker``'s rows for this version."""
        self.contributions[worker] = (rows, grad)

    def take_mean(self, pushers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sync mode: (unique rows, mean gradient rows) over this version's pushes, then forget them."""
        parts = [self.contributions[w] for w in sorted(self.contributions)]
        self.contributions.clear()
        rows = torch.cat([p[0] for p in parts]) if parts else torch.empty(0, dtype=torch.int64)
        grads = torch.cat([p[1] for p in parts]) if parts else torch.empty(0, self.spec.dim, dtype=self.block.dtype)
        unique, inverse = torch.unique(rows, return_inverse=True)
        total = torch.zeros(unique.numel(), self.spec.dim, dtype=grads.dtype).index_add_(0, inverse, grads)
        return unique, total / pushers

    def step(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        self.optimizer.step(rows, grad)

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        return row_sharding.to_local(ids, self.servers)
