"""A user's own tasks, written here as a user writes them and nowhere in gradsync: a regression MLP, a
nanoGPT-style model that returns (logits, loss), a Hugging Face-style model taking dict batches and
returning an output with .loss, and a bag-of-words classifier with a sparse embedding. gradsync train
names them `own_task:regressor --data own_task:regression` (tests/ is on every rank's path).

Also the oracle, independent of gradsync: ``reference`` trains the same model in one process with torch
alone, step by step on the sample ids a run logged (GRADSYNC_SAMPLE_LOG) at the learning rates it
recorded: the mean loss over exactly the step's samples, torch's own clip_grad_norm_, torch's optimizer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.utils.data import TensorDataset

import gradsync as gs

FEATURES = 6


# -- the tasks --------------------------------------------------------------------------------------
def regressor(width: int = 16, dtype: str = "float64") -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh(), nn.Linear(width, 1)).to(getattr(torch, dtype))


def regression(n: int = 240, seed: int = 0, dtype: str = "float64"):
    """y = tanh(x . w / 2) + noise; 80% train, 20% test; targets (n, 1) like the model's outputs."""
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(n, FEATURES, generator=g, dtype=getattr(torch, dtype))
    w = torch.randn(FEATURES, generator=g, dtype=x.dtype)
    y = torch.tanh(x @ w / 2).unsqueeze(1) + 0.05 * torch.randn(n, 1, generator=g, dtype=x.dtype)
    cut = int(0.8 * n)
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


class TinyGPT(nn.Module):
    """nanoGPT's calling convention: forward(idx, targets) -> (logits, loss)."""

    def __init__(self, vocab: int = 11, width: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(torch.tanh(self.embed(idx)))
        loss = None if targets is None else nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                        targets.reshape(-1))
        return logits, loss


def tiny_gpt() -> nn.Module:
    return TinyGPT().double()


def counting(n: int = 200, length: int = 8, seed: int = 0):
    """Sequences that count up mod 11 from a random start: (idx, targets = idx shifted by one)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 11, (n, 1), generator=g)
    seq = (start + torch.arange(length + 1)) % 11
    cut = int(0.8 * n)
    return TensorDataset(seq[:cut, :-1], seq[:cut, 1:]), TensorDataset(seq[cut:, :-1], seq[cut:, 1:])


class DictModel(nn.Module):
    """Hugging Face's calling convention: forward(features=..., labels=...) -> an output with .loss and .logits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, features, labels=None):
        logits = self.net(features)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SimpleNamespace(loss=loss, logits=logits)


def dict_model() -> nn.Module:
    return DictModel().double()


class DictSamples(torch.utils.data.Dataset):
    """Samples as dicts, collated by torch's default_collate into a dict batch."""

    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "labels": self.y[i]}


def dict_data(n: int = 200, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(n, FEATURES, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    cut = int(0.8 * n)
    return {"train": DictSamples(x[:cut], y[:cut]), "test": DictSamples(x[cut:], y[cut:])}


def huber(outputs, targets):
    """A loss function of the user's (--loss own_task:huber)."""
    return nn.functional.smooth_l1_loss(outputs, targets)


class BagOfWords(nn.Module):
    """A sparse embedding table (the parameter server moves only the rows a step reads) and a classifier."""

    def __init__(self, vocab: int = 500, width: int = 8) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, width, mode="mean", sparse=True)
        self.out = nn.Linear(width, 2)

    def forward(self, words):
        return self.out(self.bag(words))


def bag_of_words() -> nn.Module:
    return BagOfWords().double()


def documents(n: int = 160, words: int = 5, seed: int = 0):
    """Documents of word ids from a vocabulary of 500; the label: whether the first word is below 250."""
    g = torch.Generator().manual_seed(seed + 3)
    ids = torch.randint(0, 500, (n, words), generator=g)
    y = (ids[:, 0] < 250).long()
    cut = int(0.8 * n)
    return TensorDataset(ids[:cut], y[:cut]), TensorDataset(ids[cut:], y[cut:])


def rmsprop(params):
    """An optimizer of the user's (--optimizer own_task:rmsprop)."""
    return torch.optim.RMSprop(params, lr=0.01, alpha=0.9)


# -- a rank's run and the oracle --------------------------------------------------------------------
def train_logged(config: dict, log_dir: str) -> dict:
    """gradsync train's own rank function on this world, every rank logging the sample ids of each step."""
    from gradsync.train.config import TrainConfig
    from gradsync.train.loop import train_rank

    os.environ["GRADSYNC_SAMPLE_LOG"] = log_dir
    try:
        return train_rank(TrainConfig(workers=gs.world().world_size, **config))
    finally:
        del os.environ["GRADSYNC_SAMPLE_LOG"]


def logged_steps(log_dir: Path, ranks: int) -> list[list[int]]:
    """The sample ids of every step: line k of each rank's log is its share of step k."""
    per_rank = {}
    for path in Path(log_dir).glob("samples.*"):
        per_rank[int(path.name.rsplit(".r", 1)[1])] = [list(map(int, line.split()))[1:]
                                                       for line in path.read_text().splitlines()]
    assert len(per_rank) == ranks, sorted(per_rank)
    steps = {len(lines) for lines in per_rank.values()}
    assert len(steps) == 1, steps
    return [[i for rank in sorted(per_rank) for i in per_rank[rank][k]] for k in range(steps.pop())]


def learning_rates(out: Path) -> list[float]:
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["lr"] for r in records if r["event"] == "step"]


def reference(build, train_set, steps: list[list[int]], lrs: list[float], optimizer, loss_of, seed: int = 0,
              clip: float | None = None) -> tuple[dict, dict]:
    """One process, torch alone: the model ``build()`` makes after seeding, ``optimizer(params)``, and per step
    the mean of ``loss_of(model, batch)`` over the step's samples, clipped by torch's clip_grad_norm_;
    returns the (initial, final) parameters."""
    torch.manual_seed(seed)
    model = build()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = optimizer(model.parameters())
    for ids, lr in zip(steps, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        batch = torch.utils.data.default_collate([train_set[i] for i in ids])
        loss_of(model, batch).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return initial, {name: p.detach().clone() for name, p in model.named_parameters()}


def update_error(trained: dict, initial: dict, oracle: dict) -> float:
    """||trained - oracle|| / ||oracle - initial||: how far a run's update is from the oracle's, relative to the
    update itself (the weights alone barely move in a short run)."""
    apart = sum(float((trained[n].double() - oracle[n].double()).square().sum()) for n in oracle)
    moved = sum(float((oracle[n].double() - initial[n].double()).square().sum()) for n in oracle)
    return (apart / moved) ** 0.5
