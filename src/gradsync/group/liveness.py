"""Whether a process of this host is alive, as /proc says: the one test every waiting rank, live
member and test uses for "has that process died".

A zombie counts as dead. It has exited: it runs no code, holds no memory and will never send or
answer again; only its exit status waits for its parent to collect it, which may be much later (a
launcher busy elsewhere) or never (a parent that does not wait). os.kill(pid, 0) still succeeds on a
zombie, so a rank waiting on a peer through it would wait out its whole timeout for a process that
is already gone. States Z (zombie) and X (dead, being reaped) are dead; a pid with no /proc entry
is dead. Linux only, as the rest of gradsync's process handling.
"""

from __future__ import annotations

DEAD_STATES = (b"Z", b"X")
"""/proc/PID/stat states of a process that has exited (proc(5): zombie, dead)."""


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists and has not exited (a zombie has: module docstring)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # "pid (comm) state ...": comm may hold spaces and parentheses, so split at the last ") "
            state = stat.read().rsplit(b") ", 1)[1][:1]
    except (OSError, IndexError):
        return False
    return state not in DEAD_STATES
