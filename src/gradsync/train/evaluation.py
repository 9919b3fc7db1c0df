"""The test set's score, exact over the ranks: each scores a disjoint slice, the sums are all-reduced.

    test_loss  sum over samples of the loss, over the samples scored (the loss rule's mean x samples)
    accuracy   correct / count from the loss rule's score (train/losses.py); absent where none is read
"""

from __future__ import annotations

import torch
from torch import nn

import gradsync as gs
from gradsync.train.losses import samples_in
from gradsync.train.step import on

EVALUATION_BATCH = 256
"""Samples per forward while scoring."""


@torch.no_grad()
def evaluate(run, model: nn.Module, ranks: list[int] | None = None) -> dict:
    """The ``ranks`` (default: all) score disjoint slices of the test set; the sums are added exactly over
    every rank (a rank outside ``ranks`` adds zeros). {} when the task has no test set."""
    test_set = run.data.test
    if test_set is None:
        return {}
    w = gs.world()
    ranks = list(range(w.world_size)) if ranks is None else ranks
    indices = list(range(ranks.index(w.rank), len(test_set), len(ranks))) if w.rank in ranks else []
    totals = torch.zeros(4, dtype=torch.float64)   # loss sum, samples, correct, count
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    for start in range(0, len(indices), EVALUATION_BATCH):
        batch = on(device, run.task.batch(run.data, test_set, indices[start:start + EVALUATION_BATCH]))
        loss, outputs = run.task.loss(model, batch)
        samples = samples_in(batch)
        totals[0] += float(loss) * samples
        totals[1] += samples
        score = run.task.loss.score(outputs, batch)
        if score is not None:
            totals[2] += score[0]
            totals[3] += score[1]
    gs.all_reduce(totals, op="sum")
    model.train(was_training)
    result = {"test_loss": float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")}
    if totals[3] > 0:
        result["accuracy"] = float(totals[2] / totals[3])
    return result
