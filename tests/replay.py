"""The oracle for `gradsync train`'s arithmetic on digits: one process and torch alone replay a job's
steps, each the mean cross-entropy over exactly the samples the job's ranks logged for that step
(GRADSYNC_SAMPLE_LOG), SGD with momentum 0.9 at the step's learning rate, from the CNN's initial
weights or from one of the job's checkpoints. Float32 differences grow as training goes on (two
orders of summation drift apart by about 1.2x a step late in a digits run), so a long job is
replayed leg by leg, each from the checkpoint it resumed from. Equivalence (DESIGN.md, contract 2) says N ranks with local batch b equal one process with
the global batch, up to float32 reassociation; a wrong loss weighting, learning rate, lost momentum
or a lost or repeated sample moves the weights far more than that."""

from __future__ import annotations

from pathlib import Path

import torch

from gradsync.train.datasets import digits
from gradsync.train.models import DigitsCNN


def steps_logged(log_dir: Path, names: set[str] | None = None) -> list[list[int]]:
    """The sample ids of every step of one run (its ranks' logs: ``names`` in ``log_dir``, or every log
    there), in step order: line k of each rank's log (samples.PID.rRANK) is that rank's share of step k."""
    per_rank = {}
    for path in log_dir.glob("samples.*"):
        if names is None or path.name in names:
            rank = int(path.name.rsplit(".r", 1)[1])
            per_rank[rank] = [list(map(int, line.split()))[1:] for line in path.read_text().splitlines()]
    lengths = {len(lines) for lines in per_rank.values()}
    assert len(lengths) == 1, f"the ranks logged different numbers of steps: {lengths}"
    return [[i for rank in sorted(per_rank) for i in per_rank[rank][k]] for k in range(lengths.pop())]


def warmed_up(step: int, peak: float, warmup_steps: int) -> float:
    """Linear warm-up from peak/warmup to peak over the first ``warmup_steps`` steps, then flat."""
    return peak * (step + 1) / warmup_steps if step < warmup_steps else peak


def replay(steps: list[tuple[list[int], float]], seed: int = 0, start: dict | None = None) -> tuple[dict, dict]:
    """(initial, final) parameters of the digits CNN after ``steps`` of (sample ids, learning rate),
    from its initial weights or from ``start``, a checkpoint of the job (its weights and its SGD's
    momentum, torch's own state_dict formats)."""
    x, y = digits(seed)[0].tensors
    torch.manual_seed(seed)   # the job's own first draw: gradsync train seeds, then builds the model
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    if start is not None:
        model.load_state_dict(start["model"])
        optimizer.load_state_dict(start["optimizer"])
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # a small CNN: on a machine shared with other work, two threads took 3x as long
    try:
        for ids, lr in steps:
            optimizer.param_groups[0]["lr"] = lr
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[ids]), y[ids]).backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return initial, {name: p.detach().clone() for name, p in model.named_parameters()}


def update_error(trained: dict, initial: dict, oracle: dict) -> float:
    """||trained - oracle|| / ||oracle - initial|| over every parameter: how far the job's update is
    from the oracle's, relative to the update itself (the weights alone barely move in a short run)."""
    apart = sum(float((trained[n] - oracle[n]).double().square().sum()) for n in oracle)
    moved = sum(float((oracle[n] - initial[n]).double().square().sum()) for n in oracle)
    return (apart / moved) ** 0.5
