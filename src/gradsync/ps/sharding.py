"""Partition a model's parameters across S servers so that every server carries about P/S elements.

Vocabulary
    P       total parameter elements;  S  servers;  target = P / S
    piece   a contiguous slice (param index, start, length) of one flattened parameter
    shard   the pieces one server owns, concatenated into one flat vector in the order listed

Placement (longest-processing-time greedy, with splitting):
    split_bound = max(1, P // (10 * S))
    1. A tensor with more than split_bound elements is cut into S near-equal pieces, piece i on
       server i (the first numel mod S pieces get one more element).
    2. The remaining whole tensors go, largest first, onto the currently lightest server.
Greedy placement keeps max load - min load <= the largest whole tensor <= split_bound, so every
server is within P/(10S) elements of the others, i.e. within 10% of the mean load.

Example: S=2, tensors of 1000, 30, 10, 3 elements (P=1043, split_bound=52): the 1000 splits 500/500;
then 30 -> server 0, 10 -> server 1, 3 -> server 1: loads 530 and 513.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    param: int
    """Index of the parameter in the model's parameter list."""
    start: int
    """First element of the piece in the flattened parameter."""
    length: int
    """Elements in the piece."""


@dataclass(frozen=True)
class ShardPlan:
    pieces: list[list[Piece]]
    """pieces[s]: what server s owns, in the order of its flat shard."""

    @property
    def shard_numels(self) -> list[int]:
        return [sum(p.length for p in pieces) for pieces in self.pieces]


def plan_shards(numels: list[int], num_servers: int) -> ShardPlan:
    """Place tensors of ``numels`` elements on ``num_servers`` servers (see module docstring)."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    total = sum(numels)
    split_bound = max(1, total // (10 * num_servers))
    pieces: list[list[Piece]] = [[] for _ in range(num_servers)]
    loads = [0] * num_servers
    whole = []
    for index, numel in enumerate(numels):
        if numel > split_bound and num_servers > 1:
            base, extra = divmod(numel, num_servers)
            start = 0
            for server in range(num_servers):
                length = base + (1 if server < extra else 0)
                if length:
                    pieces[server].append(Piece(index, start, length))
                    loads[server] += length
                start += length
        elif numel:
            whole.append(index)
    for index in sorted(whole, key=lambda i: (-numels[i], i)):
        server = min(range(num_servers), key=lambda s: (loads[s], s))
        pieces[server].append(Piece(index, 0, numels[index]))
        loads[server] += numels[index]
    return ShardPlan(pieces)


def gather_shard(tensors: list[torch.Tensor], pieces: list[Piece], out: torch.Tensor) -> torch.Tensor:
    """Copy the listed pieces of ``tensors`` (flattened) into the flat ``out``; a None tensor gives zeros."""
    offset = 0
    for piece in pieces:
        source = tensors[piece.param]
        target = out[offset:offset + piece.length]
        if source is None:
            target.zero_()
        else:
            target.copy_(source.detach().reshape(-1)[piece.start:piece.start + piece.length])
        offset += piece.length
    return out


def scatter_shard(flat: torch.Tensor, pieces: list[Piece], tensors: list[torch.Tensor]) -> None:
    """Write the flat shard back into the listed pieces of ``tensors`` (in place, no autograd)."""
    offset = 0
    with torch.no_grad():
        for piece in pieces:
            tensors[piece.param].view(-1)[piece.start:piece.start + piece.length].copy_(
                flat[offset:offset + piece.length])
            offset += piece.length
