"""DistributedSampler: each rank's share of the dataset indices, the same rules as torch's.

Vocabulary
    n            dataset length
    R            number of replicas (ranks)
    num_samples  indices per rank per epoch: ceil(n/R), or floor(n/R) with drop_last
    total_size   R * num_samples

Per epoch: a permutation of 0..n-1 from a generator seeded with seed + epoch (the same on every
rank, so the shards are disjoint), padded by wrapping around (drop_last=False) or truncated
(drop_last=True) to total_size, then rank r takes positions r, r+R, r+2R, ...  Every rank gets
exactly num_samples indices, so every rank runs the same number of steps and no collective is left
waiting. Example: n=10, R=4, no shuffle: total 12, rank 0 gets [0, 4, 8], rank 3 gets [3, 7, 1].
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from gradsync.group import runtime


class DistributedSampler(torch.utils.data.Sampler[int]):
    """Disjoint, epoch-reshuffled shards of a dataset's indices (see module docstring)."""

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas is None or rank is None:
            my_rank, n_ranks = runtime.rank_and_size()  # a program's own world is read, not joined
            num_replicas = n_ranks if num_replicas is None else num_replicas
            rank = my_rank if rank is None else rank
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must satisfy 0 <= rank < num_replicas={num_replicas}, got {rank!r}")
        n = len(dataset)
        if n < num_replicas:
            raise ValueError(f"the dataset has {n} samples, fewer than the {num_replicas} replicas; "
                             f"every replica needs at least one sample")
        self.dataset_len = n
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.num_samples = n // num_replicas if drop_last else math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's permutation; call before each epoch so shards reshuffle."""
        self.epoch = epoch

    def indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        if self.drop_last:
            order = order[:self.total_size]
        else:
            while len(order) < self.total_size:
                order += order[:self.total_size - len(order)]
        return order[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        return self.num_samples


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's permutation of 0..n-1: the one DistributedSampler draws (seed + epoch), unpadded."""
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


class EpochCursor:
    """An epoch as a sequence of global batches, resumable after any step on any number of ranks.

    Vocabulary
        order     the epoch's permutation of the n sample ids (epoch_order)
        position  P: how many samples of the order the job has consumed this epoch
        G         global batch: samples per optimizer step over all ranks
        W         ranks; rank r's share of a step is every W-th sample of it, starting at r

    One step consumes order[P : P + min(G, n - P)]: full steps, then one shorter step with the rest,
    so an epoch trains on every sample exactly once. A rank's micro-batch m is share[m*b : (m+1)*b].
    Example: n=10, G=4, W=2: steps cover [0,4), [4,8), [8,10); in the last, rank 0 gets order[8],
    rank 1 order[9]. For full steps this is exactly DistributedSampler's split (rank r takes
    positions r, r+W, ... of the order), so a run that never resumes sees the same batches.

    What a step reads depends only on P and G, not on how many ranks consumed the first P samples:
    a checkpoint stores P, and a job resumed on another W continues with exactly the samples not
    yet seen.
    """

    def __init__(self, n: int, global_batch: int, seed: int = 0, shuffle: bool = True) -> None:
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"global_batch must be an integer >= 1, got {global_batch!r}")
        self.n, self.global_batch, self.seed, self.shuffle = n, global_batch, seed, shuffle

    def order(self, epoch: int) -> list[int]:
        return epoch_order(self.n, self.seed, epoch, self.shuffle)

    def steps_from(self, position: int) -> int:
        """Steps left in the epoch after ``position`` samples: ceil((n - P) / G)."""
        return -(-(self.n - position) // self.global_batch)

    def step_size(self, position: int) -> int:
        """Samples the step starting at ``position`` consumes over all ranks (G, or the rest)."""
        return min(self.global_batch, self.n - position)

    def share(self, order: list[int], position: int, num_replicas: int, rank: int) -> list[int]:
        """Rank ``rank``'s sample ids of the step starting at ``position``."""
        return order[position:position + self.step_size(position)][rank::num_replicas]
