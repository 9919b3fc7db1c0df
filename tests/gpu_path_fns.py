"""Functions the GPU-path tests (test_gpu_path.py) run on every rank (module level, so child
processes import them)."""

import torch

import gradsync as gs
from cases import contribution, expected_sum


def single_copy_with_an_unreadable_rank(unreadable: int, numel: int):
    """reduce_scatter and all_gather of ``numel`` float64 (past the single-copy threshold) while rank
    ``unreadable``'s tensors cannot be read where they lie (as CUDA's pinned host memory on drivers
    that map it as device memory): (single copy on, whether each result equals the closed form)."""
    from gradsync.comm.transport.shm import single_copy
    from gradsync.comm.world_transport import default_transport

    w = gs.world()
    real = single_copy.readable
    if w.rank == unreadable:
        single_copy.readable = lambda tensor: False
    try:
        want = expected_sum(w.world_size, numel, torch.float64)
        right = []
        for _ in range(2):
            shard = gs.reduce_scatter(contribution(w.rank, numel, torch.float64))
            full = gs.all_gather(shard)
            right.append(torch.equal(full, want))
            # shards of their own size per rank: the all-gather's offer is each owner's alone
            mine = contribution(w.rank, numel // 2 + w.rank * 1000, torch.float64)
            gathered = gs.all_gather(mine)
            right.append(torch.equal(gathered, torch.cat([contribution(r, numel // 2 + r * 1000, torch.float64)
                                                          for r in range(w.world_size)])))
    finally:
        single_copy.readable = real
    return default_transport().single_copy, right
