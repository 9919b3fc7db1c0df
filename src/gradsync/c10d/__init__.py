"""The torch.distributed backend "gradsync": torch's own DDP, FSDP, Lightning and Accelerate on
gradsync's collectives, by one string:

    torch.distributed.init_process_group("gradsync")                # CPU tensors, and CUDA tensors
                                                                    # staged through host memory (as gloo)
    torch.distributed.init_process_group("cpu:gradsync,cuda:nccl")  # CUDA tensors go to NCCL

torch finds the backend by itself once gradsync is installed: pyproject.toml declares register()
under the "torch.backends" entry point, which torch calls when it is imported (unless
TORCH_DEVICE_BACKEND_AUTOLOAD=0; ``import gradsync`` registers it too). This file stays tiny:
registration only; the process group (process_group.py) is imported when torch creates the first
group.
"""

from __future__ import annotations

NAME = "gradsync"


def register() -> None:
    """Make "gradsync" a torch.distributed backend for CPU and CUDA tensors (idempotent)."""
    import torch.distributed as dist

    if not dist.is_available() or NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def _create(options, backend_options=None):
    """torch's backend creator: a ProcessGroup for ``options`` (store, group_rank, group_size,
    timeout, group_id, global_ranks_in_group)."""
    from gradsync.c10d.process_group import create

    return create(options)
