"""Uneven inputs: torch's Join context manager over gradsync's DistributedDataParallel.

    with torch.distributed.algorithms.join.Join([model]):    # or: with model.join():
        for x, y in this_ranks_batches:                       # some ranks have more than others
            loss_fn(model(x), y).backward(); optimizer.step()

A rank that runs out of batches "joins": inside Join's exit it keeps answering the collectives of
the ranks still training, contributing zero gradients, until every rank has joined; then all take
the model of the last rank to join. The wrapper is torch's Joinable (join_hook, join_device,
join_process_group), and does what torch's DDP does, collective for collective:

    a rank still training, each forward          a joined rank, each of those iterations
    (wrapper.forward)                            (DDPJoinHook.main_hook)
    1. Join.notify_join_context: all_reduce(1)   Join's own all_reduce(0): how many still train
       on join_process_group (torch's)
    2. vote: all_reduce of (1 if this backward   vote (0, 0); the sums say whether to rebuild,
       synchronises, 1 if gradients are on)      whether to shadow the backward, and how many
                                                 contribute
    3. buckets rebuilt, if due and gradients     the same, if any rank has gradients on
       are on (reducer.py)
    4. buffers (broadcast_buffers): from the     candidate -1, then the same broadcast
       highest rank still training: all_reduce
       max of candidate ranks, then broadcast
    5. backward: every bucket through the hook   reducer.shadow_backward(): every bucket through
                                                 the same hook with zero gradients

torch's DDP votes after its rebuild and its buffers, so a joined rank cannot know whether the
others rebuild (they do only with gradients on); voting first, it does.

After the last rank has joined (post_hook): every rank agrees on the highest rank among the last
joiners (all_reduce max) and takes its parameters (and buffers, with broadcast_buffers) in one
broadcast.

Division (built-in hooks, ddp/hooks.py): divide_by_initial_world_size=True (default) divides the
sum by the number of replicas, so each sample weighs the same; False divides by the number of
ranks still training (the vote's sum), as torch's reducer does. Hooks of the program's own divide
as they please (torch's divide by the group size either way).

Steps 2-5 run on the wrapper's own collectives (gradsync's, or the subgroup's: ddp/replica_group.py) and
step 1 on torch's group, so each channel sees the same sequence on every rank. A joined rank keeps
the reduced gradients of step 5 in its .grad: the average of the others' gradients, which an
optimizer joined after the model (``Join([model, optimizer])``, zero.py) then applies.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms.join import JoinHook

from gradsync.ddp.replica_group import ReplicaGroup


def common_rank(group: ReplicaGroup, candidate: bool) -> int:
    """The highest group rank among those that pass ``candidate=True`` (every rank must call)."""
    rank = torch.tensor([group.rank if candidate else -1], dtype=torch.int64)
    group.all_reduce(rank, op="max")
    if int(rank) < 0:
        raise RuntimeError("DistributedDataParallel under Join: no rank is a candidate to hold the authoritative "
                           "model (every rank has joined)")
    return int(rank)


def vote(group: ReplicaGroup, will_sync: bool, grad_enabled: bool) -> tuple[int, int]:
    """(how many ranks will synchronise gradients in this iteration, how many run it with gradients
    on); every rank must call."""
    votes = torch.tensor([int(will_sync), int(grad_enabled)], dtype=torch.int64)
    group.all_reduce(votes, op="sum")
    syncing, with_grad = votes.tolist()
    return syncing, with_grad


class DDPJoinHook(JoinHook):
    """A joined rank's side of the wrapper's collectives (see the module docstring)."""

    def __init__(self, ddp, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        super().__init__()

    def main_hook(self) -> None:
        ddp = self.ddp
        syncing, with_grad = vote(ddp.group, will_sync=False, grad_enabled=False)
        if with_grad:
            ddp.reducer.rebuild_if_due()
        if ddp._syncs_buffers():
            ddp._sync_buffers(src=common_rank(ddp.group, candidate=False))
        if syncing == 0:
            return
        ddp.reducer.divisor = ddp._divisor(syncing)
        ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        ddp._broadcast_state(src=common_rank(ddp.group, candidate=is_last_joiner), buffers=ddp.broadcast_buffers)
