"""Replica agreement: every rank holds the same model, and rank 0's values are everyone's.

    verify_same_model(module, who)   every rank lists the same parameters and buffers (name, shape,
                                     dtype, requires_grad) in the same order; otherwise
                                     ReplicaMismatchError naming the rank and the first difference
    broadcast_coalesced(tensors)     rank 0's values onto every rank, one broadcast per dtype
    first_mismatch(tensors)          (rank, index) of the first tensor whose bytes differ from rank 0

Each runs on gradsync's world; ``gather=`` / ``broadcast=`` run it on other ranks instead (DDP's
subgroup: ddp/replica_group.py), given functions with the signatures of comm's all_gather and broadcast.

Used by every strategy that starts from one model: DistributedDataParallel, ParameterServer,
ShardedOptimizer. Hashes are CRC-32 of a text or of raw bytes; the texts themselves travel only to
explain a mismatch.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from gradsync.comm.agree import DTYPES
from gradsync.comm.collectives import all_gather, broadcast


class ReplicaMismatchError(RuntimeError):
    """Ranks hold different models or different parameter values."""


def crc(data: bytes) -> int:
    return zlib.crc32(data) & 0x7FFFFFFF


def _gather_uneven(mine: torch.Tensor, gather=all_gather) -> list[torch.Tensor]:
    """Every rank's 1-D ``mine``, in rank order (lengths may differ; the dtype must agree)."""
    counts = gather(torch.tensor([mine.numel()], dtype=torch.int64)).tolist()
    return list(gather(mine).split(counts))


def gather_ints(values: list[int], gather=all_gather) -> list[list[int]]:
    """Every rank's list of integers, in rank order (lists may differ in length)."""
    return [part.tolist() for part in _gather_uneven(torch.tensor(values, dtype=torch.int64), gather)]


def gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's bytes, in rank order (lengths may differ)."""
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return [part.numpy().tobytes() for part in _gather_uneven(mine)]


def gather_strings(lines: list[str], gather=all_gather) -> list[list[str]]:
    """Every rank's list of strings (used only to explain a mismatch, so simplicity beats speed)."""
    texts = gather_ints([ord(c) for c in "\n".join(lines)], gather)  # any int64 list travels the same way
    return ["".join(map(chr, codes)).split("\n") if codes else [] for codes in texts]


def first_difference(per_rank: list[list[int]]) -> tuple[int, int] | None:
    """(rank, index) of the first entry where some rank differs from rank 0."""
    reference = per_rank[0]
    for rank, values in enumerate(per_rank[1:], start=1):
        for index in range(max(len(reference), len(values))):
            mine = values[index] if index < len(values) else None
            if mine != (reference[index] if index < len(reference) else None):
                return rank, index
    return None


def model_signature(module: nn.Module) -> list[str]:
    params = [f"param {n} {tuple(p.shape)} {str(p.dtype).replace('torch.', '')} requires_grad={p.requires_grad}"
              for n, p in module.named_parameters()]
    buffers = [f"buffer {n} {tuple(b.shape)} {str(b.dtype).replace('torch.', '')}"
               for n, b in module.named_buffers()]
    return params + buffers


def verify_same_model(module: nn.Module, who: str, gather=all_gather) -> None:
    """Raise ReplicaMismatchError unless every rank built the same model (``who`` names the caller)."""
    lines = model_signature(module)
    difference = first_difference(gather_ints([crc(line.encode()) for line in lines], gather))
    if difference is None:
        return
    rank, index = difference
    texts = gather_strings(lines, gather)
    ours = texts[0][index] if index < len(texts[0]) else "(nothing)"
    theirs = texts[rank][index] if index < len(texts[rank]) else "(nothing)"
    raise ReplicaMismatchError(
        f"rank {rank} gives {who} a different model than rank 0: entry #{index} is '{theirs}' on rank {rank} "
        f"but '{ours}' on rank 0. Every rank must build the same model (same parameters, shapes, "
        f"dtypes, order) before wrapping it.")


@torch.no_grad()
def broadcast_coalesced(tensors: list[torch.Tensor], broadcast=broadcast, src: int = 0) -> None:
    """Rank ``src``'s values of ``tensors`` onto every rank: one broadcast per dtype, not one per tensor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() and t.dtype in DTYPES:
            by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        broadcast(flat, src=src)
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


@torch.no_grad()
def first_mismatch(tensors: list[torch.Tensor], gather=all_gather) -> tuple[int, int] | None:
    """(rank, index) of the first tensor whose bytes differ between rank 0 and some rank, or None."""
    hashes = [crc(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()) for t in tensors]
    return first_difference(gather_ints(hashes, gather))
