"""What the ranks of test_precision.py run, and the task they train: own_task's regression in float32
(autocast casts float32 operands; float64 ones it leaves alone), and a copy of it whose one chosen
training sample has features of 1e5, past float16's largest value (65504): under fp16-mixed the rank
that trains that sample computes inf in its forward, and NaN and inf in its gradient; no other does."""

from __future__ import annotations

import os

import torch
from torch.utils.data import TensorDataset

import gradsync as gs
import own_task

SPIKE = 1e5
"""Past float16's range: autocast's cast of the input to float16 makes it inf."""


def regressor(width: int = 16) -> torch.nn.Module:
    return own_task.regressor(width, dtype="float32")


def regression(n: int = 240, seed: int = 0):
    return own_task.regression(n, seed, dtype="float32")


def spiked_regression(spike: int = -1, n: int = 240, seed: int = 0):
    """regression(), with training sample ``spike``'s features set to SPIKE (-1: none)."""
    train, test = regression(n, seed)
    x, y = train.tensors
    if spike >= 0:
        x = x.clone()
        x[spike] = SPIKE
    return TensorDataset(x, y), test


def train_recording(config: dict, log_dir: str | None = None) -> dict:
    """gradsync train's rank function, with each step's parameters recorded as it commits: the result gets
    "digests", [(step, param_digest after it)], in the order the steps committed (a parameter-server
    worker's are the parameters it pulled for that step); ``log_dir``: GRADSYNC_SAMPLE_LOG."""
    from gradsync.train.config import TrainConfig
    from gradsync.train.device import param_digest
    from gradsync.train.loop import train_rank
    from gradsync.train.strategies.base import StrategyObject

    digests = []
    plain_commit = StrategyObject.commit

    def commit(strategy, progress):
        plain_commit(strategy, progress)
        digests.append((strategy.step, param_digest(strategy.run.model)))

    StrategyObject.commit = commit
    if log_dir is not None:
        os.environ["GRADSYNC_SAMPLE_LOG"] = log_dir
    try:
        result = train_rank(TrainConfig(workers=gs.world().world_size, **config))
    finally:
        StrategyObject.commit = plain_commit
        os.environ.pop("GRADSYNC_SAMPLE_LOG", None)
    return {**result, "digests": digests}
