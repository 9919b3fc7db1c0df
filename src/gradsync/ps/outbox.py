"""A server's outbox: its messages to workers posted in order, at most ``room`` answers moving at once,
and completed by a thread of its own while the server's thread reads the next message.

Vocabulary
    letter   the sends of one message to one worker (an answer: header, payload, rows; or a BYE),
             posted together and in order
    moving   letters posted and not yet completed, oldest first
    held     letters not yet posted, oldest first: an answer while ``room`` answers are moving, and
             every letter sent after it
    room     answers moving at once (None: no limit)

Why a thread. gloo reports a send complete only once it is waited for, and a wait blocks. A server
that waited for its oldest answer before posting another read no header meanwhile: no push's
receive was posted and its download idled (a quarter of the server's time, measured in
docs/studies/ps-server.md, "An outbox for the answers"). Here the server's thread only posts: an answer
beyond ``room`` is held, and this outbox's thread, which waits for the moving letters oldest
first, posts it when one completes. The server's thread stays free to read headers and post push
receives, so pushes come in while answers go out.

Settling. A worker sends its next message only after it read every answer (client.py), so when one
arrives the server settles that worker's letters (``settle``): it takes the moving ones the thread is
not waiting for and waits for them itself (they are complete: the wait returns at once), and waits
for the one the thread holds, if any. A letter settled this way frees its room at once.

Failures. A send that fails in the thread is kept with its worker; ``check`` and ``settle`` raise it
as PeerError in the server's thread, and nothing more is posted. Every wait has a timeout.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from gradsync.comm.transport import Handle, PeerError, Transport


@dataclass
class Part:
    """One send of a letter: the tensor and how the transport labels and routes it."""
    tensor: torch.Tensor
    op: str
    tag: int
    control: bool = False


@dataclass(eq=False)
class _Letter:
    worker: int
    parts: list[Part]
    answer: bool
    handles: list[Handle] = field(default_factory=list)


class Outbox:
    """Posts ``send``s to workers through ``transport``, at most ``room`` answers moving at once."""

    def __init__(self, transport: Transport, room: int | None, timeout: float, name: str = "gradsync-outbox") -> None:
        if room is not None and room < 1:
            raise ValueError(f"outbox room must be at least 1 answer, or None for no limit (got {room})")
        self.transport = transport
        self.room = room
        self.timeout = timeout
        self._changed = threading.Condition()
        self._moving: deque[_Letter] = deque()
        self._held: deque[_Letter] = deque()
        self._busy: _Letter | None = None   # the letter the thread is waiting for
        self._failure: tuple[int, PeerError] | None = None
        self._closing = False
        self.most_sends = 0     # sends posted and not yet completed, at most
        self.most_answers = 0   # answers moving at once, at most
        self.answers_held = 0   # answers that waited for room
        self._thread = threading.Thread(target=self._complete, name=name, daemon=True)
        self._thread.start()

    # -- the server's thread ----------------------------------------------------------------------
    def send(self, worker: int, parts: list[Part], answer: bool = True) -> None:
        """Post a letter to ``worker`` now, or hold it: an answer while ``room`` answers are moving, any
        letter while an earlier one is held (letters are posted in the order they were sent)."""
        letter = _Letter(worker, parts, answer)
        with self._changed:
            self._raise_failure()
            if self._held or not self._has_room(letter):
                self._held.append(letter)
                self.answers_held += answer
                self._post_held()
            else:
                self._post(letter)

    def check(self) -> None:
        """Raise the failure of a send the thread waited for, if any."""
        with self._changed:
            self._raise_failure()

    def settle(self, worker: int) -> None:
        """Wait until every letter to ``worker`` has completed (see the module docstring)."""
        deadline = time.monotonic() + self.timeout
        while True:
            with self._changed:
                self._raise_failure()
                mine = [letter for letter in self._moving if letter.worker == worker and letter is not self._busy]
                for letter in mine:
                    self._moving.remove(letter)
                if not mine:
                    if not self._owes(worker):
                        return
                    if not self._changed.wait(timeout=max(0.0, deadline - time.monotonic())):
                        self._raise_timeout(worker)
                    continue
            try:
                for letter in mine:
                    for handle in letter.handles:
                        handle.wait(timeout=max(0.0, deadline - time.monotonic()))
            except PeerError as exc:
                with self._changed:
                    self._failure = self._failure or (worker, exc)
                    self._changed.notify_all()
                raise
            with self._changed:
                self._post_held()

    def close(self) -> None:
        """Complete every letter, then stop the thread (raises a failure it met)."""
        deadline = time.monotonic() + self.timeout
        with self._changed:
            while (self._moving or self._held) and self._failure is None:
                if not self._changed.wait(timeout=max(0.0, deadline - time.monotonic())):
                    self._raise_timeout(None)
            self._closing = True
            self._changed.notify_all()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.check()

    def abandon(self) -> None:
        """Stop posting (the server is aborting): the thread ends after the wait it is in."""
        with self._changed:
            self._closing = True
            self._held.clear()
            self._changed.notify_all()

    # -- helpers, called holding the lock ---------------------------------------------------------
    def _answers_moving(self) -> int:
        return sum(letter.answer for letter in self._moving)

    def _has_room(self, letter: _Letter) -> bool:
        return not letter.answer or self.room is None or self._answers_moving() < self.room

    def _owes(self, worker: int) -> bool:
        return any(letter.worker == worker for letter in (*self._moving, *self._held))

    def _post(self, letter: _Letter) -> None:
        letter.handles = [self.transport.isend(p.tensor, letter.worker, p.op, control=p.control, tag=p.tag)
                          for p in letter.parts]
        self._moving.append(letter)
        self.most_sends = max(self.most_sends, sum(len(m.handles) for m in self._moving))
        self.most_answers = max(self.most_answers, self._answers_moving())
        self._changed.notify_all()

    def _post_held(self) -> None:
        while self._held and not self._closing and self._failure is None and self._has_room(self._held[0]):
            self._post(self._held.popleft())

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure[1]

    def _raise_timeout(self, worker: int | None) -> None:
        who = "every worker" if worker is None else f"worker rank {worker}"
        raise PeerError(f"rank {self.transport.rank}: ps/outbox: the answers to {who} did not complete within "
                        f"{self.timeout:.0f} s; the worker may have died or stalled",
                        rank=self.transport.rank, peer=worker, op="ps/outbox")

    # -- the outbox's thread ----------------------------------------------------------------------
    def _complete(self) -> None:
        """Wait for the moving letters, oldest first; post held answers as room frees."""
        while True:
            with self._changed:
                while not self._moving and not self._closing:
                    self._changed.wait()
                if not self._moving:
                    return
                letter = self._busy = self._moving[0]
            failure = None
            try:
                for handle in letter.handles:
                    handle.wait()
            except PeerError as exc:
                failure = (letter.worker, exc)
            with self._changed:
                self._busy = None
                if letter in self._moving:
                    self._moving.remove(letter)
                if failure is not None:
                    self._failure = self._failure or failure
                    self._changed.notify_all()
                    return
                self._post_held()
                self._changed.notify_all()
