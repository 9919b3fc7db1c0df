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

Why the tracebacks are cut: a torch Future that failed holds its exception from C++, where Python's
collector cannot see the cycle exception -> traceback -> frames -> Future; cut, the old world's
process group, sockets and mappings are freed with the error rather than at some later collection.
"""

from __future__ import annotations

from typing import Callable

from gradsync.comm.transport import PeerError


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
