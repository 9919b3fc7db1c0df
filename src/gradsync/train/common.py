"""What every training strategy shares: the loss, the optimizer, the learning-rate warm-up, the
exact distributed evaluation and a digest of the parameters."""

from __future__ import annotations

import os
import zlib

import torch
from torch import nn

import gradsync as gs
from gradsync.train.config import TrainConfig


def loss_of(model_name: str, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if model_name == "charlm":
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    if model_name == "word2vec":   # logits: the context's score, then the negatives' (train/word2vec.py)
        from gradsync.train.word2vec import negative_sampling_loss

        return negative_sampling_loss(logits)
    return nn.functional.cross_entropy(logits, target)


def optimizer_spec(cfg: TrainConfig, lr: float) -> tuple[type, dict]:
    """(optimizer class, keyword arguments) for the model."""
    if cfg.model == "charlm":
        return torch.optim.AdamW, {"lr": lr, "weight_decay": 0.01}
    if cfg.model == "word2vec":   # Adagrad: per-row step sizes for rare and frequent tokens alike
        return torch.optim.Adagrad, {"lr": lr}
    return torch.optim.SGD, {"lr": lr, "momentum": 0.9}


def build_optimizer(cfg: TrainConfig, params, lr: float):
    """The full optimizer, or for --strategy zero1 the ShardedOptimizer around it."""
    cls, kwargs = optimizer_spec(cfg, lr)
    if cfg.strategy == "zero1":
        return gs.ShardedOptimizer(params, cls, **kwargs)
    return cls(params, **kwargs)


def clip_gradients(cfg: TrainConfig, model: nn.Module, optimizer) -> float | None:
    """--clip-grad for ddp, zero1 and local, after the step's last backward: the averaged gradient's
    total 2-norm before clipping (None without the flag). ddp's .grad already is the average, so torch's
    clip_grad_norm_ sees what one process would; zero1's .grad is local until ShardedOptimizer reduces,
    so its own clip_grad_norm_ reduces first. (The parameter server clips inside: loop_ps.py.)"""
    if cfg.clip_grad is None:
        return None
    if cfg.strategy == "zero1":
        return float(optimizer.clip_grad_norm_(cfg.clip_grad))
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad))


def lr_at(step: int, peak: float, warmup_steps: int) -> float:
    """Linear warm-up from peak/warmup to peak over the first ``warmup_steps`` steps, then flat."""
    return peak if step >= warmup_steps else peak * (step + 1) / warmup_steps


def train_device(cfg: TrainConfig) -> torch.device:
    """Where this rank trains (--device): cuda is the GPU local rank mod GPU count (ranks that share one
    go through host memory: comm/host_staging.py); auto is cuda when torch sees a GPU, except for
    word2vec, whose sparse tables train on the CPU."""
    if cfg.device == "cpu" or (cfg.device == "auto" and (cfg.model == "word2vec" or not torch.cuda.is_available())):
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
    """What metrics.jsonl says of where the job trained: the device, how many local ranks share this GPU,
    and how CUDA tensors travel (host staging or NCCL: device_path.py)."""
    if device.type != "cuda":
        return {"device": "cpu"}
    w, gpus = gs.world(), torch.cuda.device_count()
    sharing = sum(1 for local in range(w.local_world_size) if local % gpus == w.local_rank % gpus)
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device), "ranks_per_gpu": sharing,
            "cuda_path": w.cuda_path}


def on(device: torch.device, batch: tuple) -> tuple:
    """A batch's tensors on ``device`` (asynchronous where the source is pinned)."""
    return tuple(t.to(device, non_blocking=True) for t in batch)


@torch.no_grad()
def evaluate(cfg: TrainConfig, model: nn.Module, test_set, ranks: list[int] | None = None) -> dict:
    """The ``ranks`` (default: all) score disjoint slices of the test set; the counts are summed exactly
    over every rank (a rank outside ``ranks`` adds zeros)."""
    w = gs.world()
    ranks = list(range(w.world_size)) if ranks is None else ranks
    model.eval()
    indices = list(range(ranks.index(w.rank), len(test_set), len(ranks))) if w.rank in ranks else []
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    device = next(model.parameters()).device
    for start in range(0, len(indices), 256):
        x, y = on(device, test_set[indices[start:start + 256]])
        logits = model(x)
        totals[0] += float(loss_of(cfg.model, logits, y)) * y.numel()
        totals[1] += float((logits.argmax(-1) == y).sum())
        totals[2] += y.numel()
    gs.all_reduce(totals, op="sum")
    model.train()
    return {"test_loss": float(totals[0] / totals[2]), "accuracy": float(totals[1] / totals[2])}


def param_digest(model: nn.Module) -> int:
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc
