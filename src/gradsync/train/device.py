"""Where a rank trains (--device), what the run records of it, and a digest of the parameters wherever
they live."""

from __future__ import annotations

import os
import zlib

import torch
from torch import nn

import gradsync as gs


def train_device(cfg, sparse_rows: bool = False) -> torch.device:
    """Where this rank trains (--device): cuda is the GPU local rank mod GPU count (ranks that share one go
    through host memory: comm/host_staging.py); auto is cuda when torch sees a GPU, except where sparse
    tables' rows travel to a parameter server (``sparse_rows``): they are gathered and applied on the CPU."""
    if cfg.device == "cpu" or (cfg.device == "auto" and (sparse_rows or not torch.cuda.is_available())):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is "
                           "False); use --device cpu or auto")
    try:
        local_rank = gs.world().local_rank
    except RuntimeError:   # a live replacement before it joins: its launcher's local rank
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def device_record(device: torch.device) -> dict:
    """What metrics.jsonl says of where this rank trained: the device, how many local ranks share this GPU,
    and how CUDA tensors travel (host staging or NCCL: device_path.py). Not collective."""
    if device.type != "cuda":
        return {"device": "cpu"}
    w, gpus = gs.world(), torch.cuda.device_count()
    sharing = sum(1 for local in range(w.local_world_size) if local % gpus == w.local_rank % gpus)
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device), "ranks_per_gpu": sharing,
            "cuda_path": w.cuda_path}


def param_digest(model: nn.Module) -> int:
    """CRC32 of every parameter's bytes in order, read on the CPU (a CUDA parameter is copied there)."""
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc
