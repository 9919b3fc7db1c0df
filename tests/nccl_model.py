"""A model of NCCL's point-to-point, for showing on a CPU which message orders can deadlock there.

NCCL runs each rank's sends and receives in the order they were posted, one after the other on one
stream; a message moves only while both of its ends are running, and past NCCL's buffers a send
cannot finish before its receive has started. The model keeps exactly that and nothing else:

    rank r's queue   the groups r posted, in order; the group at its head is "running"
    a group          one message end (isend, irecv) or, posted by ``exchange`` as NCCL's
                     batch_isend_irecv posts them, a send and a receive together
    a message        the k-th send from r to p matches the k-th receive at p from r; it moves (its
                     bytes copied) when both ends' groups are running; a group ends when all its
                     messages have moved, and the next group of that rank starts
    no buffering     so a send never ends before its receive has started (the worst case, reached
                     by messages larger than NCCL's buffers)

ModelTransport is a Transport (comm/transport) over this fabric for ranks that are threads of one
process; ``pairs`` is what its pairs_exchanges answers. A wait that cannot end raises TimeoutError
after ``timeout`` seconds: in the model, a deadlock.
"""

from __future__ import annotations

import collections
import threading
import time

import torch

from gradsync.comm.transport import Handle, Transport


class _End:
    __slots__ = ("sending", "tensor", "key", "group", "moved")

    def __init__(self, sending: bool, tensor: torch.Tensor, key: tuple, group: "_Group") -> None:
        self.sending, self.tensor, self.key, self.group, self.moved = sending, tensor, key, group, False


class _Group:
    __slots__ = ("ends", "done")

    def __init__(self) -> None:
        self.ends: list[_End] = []
        self.done = False


class Fabric:
    """The ranks' queues and the messages between them (see the module docstring)."""

    def __init__(self, world_size: int, timeout: float = 5.0) -> None:
        self.world_size, self.timeout = world_size, timeout
        self.changed = threading.Condition()
        self.queues = [collections.deque() for _ in range(world_size)]
        self.counts: collections.Counter = collections.Counter()   # (sending, rank, peer) -> ends posted
        self.ends: dict[tuple, _End] = {}                          # (src, dst, k, sending) -> end

    def post(self, rank: int, messages: list[tuple[bool, torch.Tensor, int]]) -> _Group:
        """Queue one group of (sending, tensor, peer) at ``rank``."""
        group = _Group()
        with self.changed:
            for sending, tensor, peer in messages:
                k = self.counts[(sending, rank, peer)]
                self.counts[(sending, rank, peer)] += 1
                src, dst = (rank, peer) if sending else (peer, rank)
                end = _End(sending, tensor, (src, dst, k), group)
                self.ends[(src, dst, k, sending)] = end
                group.ends.append(end)
            self.queues[rank].append(group)
            self._progress()
        return group

    def _running(self, group: _Group) -> bool:
        return any(queue and queue[0] is group for queue in self.queues)

    def _progress(self) -> None:
        """Move every message whose two ends are running; end the groups all of whose messages moved."""
        while True:
            moved = False
            for queue in self.queues:
                for end in queue[0].ends if queue else ():
                    other = self.ends.get((*end.key, not end.sending))
                    if not end.moved and other is not None and self._running(other.group):
                        sender, receiver = (end, other) if end.sending else (other, end)
                        receiver.tensor.copy_(sender.tensor)
                        end.moved = other.moved = True
                        moved = True
            for queue in self.queues:
                while queue and all(end.moved for end in queue[0].ends):
                    queue.popleft().done = True
                    moved = True
            if not moved:
                break
        self.changed.notify_all()

    def wait(self, group: _Group, rank: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        with self.changed:
            while not group.done:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank}: {what} never ended: in the NCCL model, a deadlock")
                self.changed.wait(0.05)


class _ModelHandle(Handle):
    __slots__ = ("fabric", "group", "rank", "peer", "what")

    def __init__(self, fabric: Fabric, group: _Group, rank: int, peer: int, what: str) -> None:
        self.fabric, self.group, self.rank, self.peer, self.what = fabric, group, rank, peer, what

    def done(self) -> bool:
        return self.group.done

    def wait(self, timeout: float | None = None) -> int:
        self.fabric.wait(self.group, self.rank, self.what)
        return self.peer


class ModelTransport(Transport):
    """Rank ``rank`` of ``fabric`` (see the module docstring)."""

    def __init__(self, fabric: Fabric, rank: int, pairs: bool) -> None:
        self.fabric, self.rank, self.world_size, self.pairs = fabric, rank, fabric.world_size, pairs

    def isend(self, tensor, dst, op, *, control=False, tag=0):
        return _ModelHandle(self.fabric, self.fabric.post(self.rank, [(True, tensor, dst)]), self.rank, dst, op)

    def irecv(self, tensor, src, op, *, control=False, tag=0):
        return _ModelHandle(self.fabric, self.fabric.post(self.rank, [(False, tensor, src)]), self.rank, src, op)

    def pairs_exchanges(self, tensor) -> bool:
        return self.pairs

    def exchange(self, send, dst, recv, src, op):
        if not self.pairs:
            return super().exchange(send, dst, recv, src, op)
        # as TorchTransport.exchange: one group, an empty tensor left out (its peer's end is empty too)
        messages = [(sending, tensor, peer) for sending, tensor, peer in ((True, send, dst), (False, recv, src))
                    if tensor.numel()]
        return _ModelHandle(self.fabric, self.fabric.post(self.rank, messages), self.rank, src, op)


def run_ranks(world_size: int, pairs: bool, job, timeout: float = 5.0) -> list:
    """``job(transport)`` on ``world_size`` threads over one fabric: their results in rank order;
    raises the first rank's exception (a TimeoutError where the model deadlocks)."""
    fabric = Fabric(world_size, timeout)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def rank_main(rank: int) -> None:
        try:
            results[rank] = job(ModelTransport(fabric, rank, pairs))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors[rank] = exc
    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    for error in errors:
        if error is not None:
            raise error
    return results
