"""The classic DDP loop with gradsync: init, sampler, wrap, train.

Run it either way:
    python examples/ddp_digits.py --workers 2                       # gradsync starts the ranks
    torchrun --nproc-per-node 2 examples/ddp_digits.py              # torchrun starts them
"""

import argparse
import os

import torch
from torch import nn

import gradsync as gs
from gradsync.train.datasets import digits
from gradsync.train.models import DigitsCNN


def main(epochs: int = 5) -> float:
    w = gs.init()                                              # reads torchrun's environment
    torch.manual_seed(0)
    train_set, test_set = digits()
    sampler = gs.DistributedSampler(train_set, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(train_set, batch_size=32, sampler=sampler, drop_last=True)
    model = gs.DistributedDataParallel(DigitsCNN())            # rank 0's weights everywhere
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02 * w.world_size, momentum=0.9)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)                               # a new shuffle each epoch
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()   # buckets all-reduced during backward
            optimizer.step()
    model.check_replicas()                                     # every rank holds the same weights
    with torch.no_grad():
        x, y = test_set.tensors
        accuracy = (model.module(x).argmax(1) == y).float().mean().item()
    if w.rank == 0:
        print(f"{w.world_size} ranks, test accuracy {accuracy:.2%}")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    if "RANK" in os.environ:
        main(args.epochs)
    else:
        gs.spawn(main, nprocs=args.workers, args=(args.epochs,))
