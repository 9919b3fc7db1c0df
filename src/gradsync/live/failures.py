"""What a live world does with an error: whether a member's death caused it, its first line with the
tracebacks cut, and a collective run again in the new world after a death.

    caused_by_peer(exc)        a PeerError anywhere in the chain of causes (the transport's word for
                               a peer that died or left)
    first_line_freed(exc)      the error's first line, for the record; its tracebacks, and those of
                               its causes, set to None
    rerun(fn, tries, failure_of, recover)
                               fn(), and after a death (failure_of(exc) says so, or raises exc
                               again) recover(why) and fn() again, at most ``tries`` times, then
                               once more unguarded
    LostContact                this member can no longer reach the job (its store has not answered
                               for the job's timeout): it leaves, exit status EXIT_LOST_CONTACT
    StepUndone                 a recovery during a collective outside a step took back this rank's last
                               step (it had committed a step another survivor had not, or it rejoined
                               with a live peer's state): the caller trains the step again, not the
                               collective
    BelowFloor                 the world the survivors agreed on has fewer members than the floor
                               (min_workers): it trains no further; the caller checkpoints the agreed
                               state and stops (gradsync train: exit status 75, as a preemption)

Why the tracebacks are cut: a torch Future that failed holds its exception from C++, where Python's
collector cannot see the cycle exception -> traceback -> frames -> Future; cut, the old world's
process group, sockets and mappings are freed with the error rather than at some later collection.
"""

from __future__ import annotations

from typing import Callable

from gradsync.comm.transport import PeerError

EXIT_LOST_CONTACT = 69
"""Exit status of a live member that lost contact with its job (EX_UNAVAILABLE in sysexits.h: "a service
is unavailable"): cut off from the job's store for the job's timeout, by a partition or the store's host
going away. Beside 75 (preempted: rerun) and 130 (Ctrl-C); 2 stays the command line's bad flags."""


class LostContact(RuntimeError):
    """This member cannot reach the job: its store has not answered for the job's timeout. The message is
    the one line a member prints as it leaves (the store's address, the members it last saw)."""


class StepUndone(RuntimeError):
    """A collective outside a step (the boundary after a step, an evaluation) met a failure whose recovery
    took back the step this rank had committed: the survivors that had not committed it train it again,
    so this rank must too (its caller goes back to training), rather than run the collective again and
    meet them in a different one."""


class BelowFloor(RuntimeError):
    """The generation the survivors agreed on has fewer members than the floor (``min_workers``); the world
    is rebuilt and the state agreed (every survivor holds the same step), so the caller can checkpoint it."""

    def __init__(self, message: str, members: tuple[int, ...], floor: int) -> None:
        super().__init__(message)
        self.members, self.floor = members, floor


def default_floor(members: int) -> int:
    """The default min_workers of a job that started with ``members`` members: half of them, rounded up.
    torchft's lighthouse forms a quorum only from more than half of the replicas still heartbeating; here
    the job's store is the one arbiter (a side cut off from it cannot train at all, so no two sides ever
    train apart), and the same majority rule is applied to the job as it started: a remnant smaller than
    half of it stops with a checkpoint rather than train on alone (2 -> 1 goes on, 3 -> 1 stops)."""
    return -(-members // 2)


def caused_by_peer(exc: BaseException | None) -> bool:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, PeerError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def first_line_freed(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
    return text


def rerun(fn: Callable[[], object], tries: int, failure_of: Callable[[Exception], str],
          recover: Callable[[str], object]):
    for _ in range(tries):
        try:
            return fn()
        except Exception as exc:
            failure = failure_of(exc)
        recover(failure)   # outside the except clause, so the old world's frames are free
    return fn()
