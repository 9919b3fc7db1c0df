"""Rank functions for tests/test_train.py (module level, so the test worlds' ranks can import them)."""

import torch
from torch import nn

import gradsync as gs


def resume_where_only_rank_0_has_the_checkpoint(out_dirs: list[str]):
    """Each rank looks for its checkpoint in its own --out (``out_dirs[rank]``; only rank 0's holds one)
    and rank 0 asks to resume: every rank returns what train/resume.agreed raised (type, message)."""
    from gradsync.train import resume
    from gradsync.train.config import TrainConfig

    w = gs.world()
    cfg = TrainConfig(workers=w.world_size, out=out_dirs[w.rank], resume=w.rank == 0)
    try:
        resume.agreed(cfg)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return type(exc).__name__, str(exc)
    return "no error", ""


def last_step_gradients(n: int, global_batch: int, position: int, seed: int = 0):
    """The step that starts at ``position`` of an epoch of ``n`` samples (data.EpochCursor), on this
    world's ranks with gs.DistributedDataParallel and the training loop's own loss weighting
    (train/step.py, weighed and share_scale, a 'step' strategy), float64; returns (the step's sample ids,
    the averaged gradients)."""
    from gradsync.data import EpochCursor
    from gradsync.train.step import share_scale, weighed

    w = gs.world()
    x, y = last_step_data(n, seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    ddp = gs.DistributedDataParallel(model)
    cursor = EpochCursor(n, global_batch, seed=seed)
    order = cursor.order(0)
    share = cursor.share(order, position, w.world_size, w.rank)
    step_size = cursor.step_size(position)
    scale = share_scale("step", w.world_size, w.world_size, step_size, len(share))
    ((ids, weight),) = weighed(share, 1, scale, filler=order[position])
    (torch.nn.functional.cross_entropy(ddp(x[ids]), y[ids]) * weight).backward()
    return order[position:position + step_size], [p.grad.clone() for p in model.parameters()]


def last_step_data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(n, 5, dtype=torch.float64, generator=g), torch.randint(0, 3, (n,), generator=g)


def ps_resume(out: str):
    """This world's ranks resume the parameter-server job in ``out`` (ps-async, 1 server); returns the
    error each rank got (type, message)."""
    from gradsync.train.config import TrainConfig
    from gradsync.train.loop import train_rank

    try:
        train_rank(TrainConfig(strategy="ps-async", workers=gs.world().world_size, servers=1, batch_size=16,
                                  steps=60, out=out, resume=True, quiet=True))
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return type(exc).__name__, str(exc)
    return "no error", ""


def train_logging_samples(config: dict, log_dir: str):
    """The training loop's own rank function (train/loop.py train_rank) on this world, with
    GRADSYNC_SAMPLE_LOG=``log_dir`` (each rank appends "epoch id id ..." per step it trains); returns
    rank 0's summary (None elsewhere)."""
    import os

    from gradsync.train.config import TrainConfig
    from gradsync.train.loop import train_rank

    os.environ["GRADSYNC_SAMPLE_LOG"] = log_dir
    try:
        return train_rank(TrainConfig(workers=gs.world().world_size, **config))["summary"]
    finally:
        del os.environ["GRADSYNC_SAMPLE_LOG"]
