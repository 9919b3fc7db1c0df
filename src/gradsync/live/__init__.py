"""Live fault tolerance: when ranks die, the survivors agree on a new world and train on, without a
restart and without reading a checkpoint.

    membership.py   who is in each generation, agreed through the rendezvous store (the quorum)
    ddp.py          LiveDDP: DistributedDataParallel whose world is rebuilt from the survivors, the
                    step in flight redone by them
    policy.py       what a smaller (or grown back) world does to the global batch and the learning rate
    growth.py       a replacement rank joins at a step boundary: the protocol, the members' decision
    transfer.py     the training state sent from rank 0 to a joiner over the transport
    heartbeat.py    how a member on another host is found dead: its counter in the store stops
    failures.py     whether an error was a member's death; a collective run again after one
    catch_up.py     survivors left one collective apart by a death meet in the first one again
    ps.py           LivePS: the parameter server whose workers may die (a dead server ends the job)

Run it under gs.spawn(fn, nprocs, fault_tolerance="live") (the launcher then lets the survivors run
on instead of stopping them, and hosts the store they meet through; with replacements=K it starts
up to K replacement ranks, which join the running world) or `gradsync train --fault-tolerance live`
(--max-restarts K for the replacements).
"""

from gradsync.live.ddp import LiveDDP, Recovery
from gradsync.live.policy import BATCH_POLICIES, resized

__all__ = ["LiveDDP", "Recovery", "BATCH_POLICIES", "resized"]
