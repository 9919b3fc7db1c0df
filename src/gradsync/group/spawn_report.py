"""The launcher's one-screen account of a failed job: which rank failed first and how (its
traceback, or the signal that killed it), what the other ranks reported, and where in their code the
ranks it stopped were, read from the stacks faulthandler dumped as they died ("rank 1 was in
all_reduce <- allreduce_ring <- wait")."""

from __future__ import annotations

import signal
from pathlib import Path

class SpawnError(RuntimeError):
    """A rank raised or died. ``rank`` is the first rank that failed; ``tracebacks`` maps rank -> text."""

    def __init__(self, message: str, rank: int, tracebacks: dict[int, str]) -> None:
        super().__init__(message)
        self.rank = rank
        self.tracebacks = tracebacks


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


_TRANSPORT_DIR = "gradsync/comm/transport/"
_ALGORITHM_FILES = ("allreduce_", "reduce_scatter_", "all_gather_")


def transport_internal(path: str) -> bool:
    """A frame of a transport's own machinery (anything under comm/transport/ but the intra-host
    algorithms' files): a stack names the collective that waited, not these."""
    return _TRANSPORT_DIR in path and not Path(path).name.startswith(_ALGORITHM_FILES)


def stopped_where(stack_path: Path) -> str | None:
    """Where a rank's main thread was, from its faulthandler dump: the innermost frames of gradsync
    and of the user's code (not the launcher, multiprocessing, torch or transport internals),
    innermost first."""
    try:
        text = stack_path.read_text()
    except OSError:
        return None
    # faulthandler writes each thread's frames innermost first; the main thread is the last block
    blocks = [b for b in text.split("\n\n") if "File " in b]
    if not blocks:
        return None
    frames = []
    for line in blocks[-1].splitlines():
        line = line.strip()
        if not line.startswith("File "):
            continue
        path = line.split('"')[1]
        if any(part in path for part in ("gradsync/group/launch.py", "/multiprocessing/", "/threading.py",
                                         "/site-packages/torch/", "<frozen", "<string>")) or transport_internal(path):
            continue
        name = line.rsplit(" in ", 1)[-1]
        short = path.rsplit("gradsync/", 1)[-1] if "/gradsync/" in path else Path(path).name
        frames.append(f"{name} ({short}:{line.split('line ')[1].split(' ')[0]})")
    if not frames:
        return None
    return " <- ".join(frames[:4]) + (" <- ..." if len(frames) > 4 else "")


def first_line(traceback_text: str) -> str:
    # A rank stopped while writing its error file leaves it empty or partial.
    lines = traceback_text.strip().splitlines()
    return lines[0] if lines else "an error (its report was cut short when the rank was stopped)"


EARLY_LINES = 12
"""How many of the ranks' last early lines (forkserver.early_output) a rank that left no report gets quoted."""
GUARD_HINT = ("gs.spawn(...) runs again in each rank: a rank imports the script that defines fn, and that "
              "script calls spawn at its top level. Put the call under `if __name__ == \"__main__\":`, as Python's "
              "multiprocessing requires")


def _before_fn(early: str) -> tuple[str, str]:
    """What to say of a rank that exited with an error code and no report (it failed before it ran fn), and
    the ranks' last lines before they started."""
    lines = [line for line in early.strip().splitlines() if line.strip()][-EARLY_LINES:]
    said = " before it ran fn" + (f" ({GUARD_HINT})" if any("bootstrapping phase" in line for line in lines) else "")
    quoted = "\nthe ranks' last lines before they started:\n" + "\n".join(f"  {line}" for line in lines) if lines else ""
    return said, quoted


def spawn_error(exit_codes: dict[int, int | None], failed: int, out_dir: Path, early: str = "") -> SpawnError:
    if failed == -1:
        return SpawnError("spawn: the ranks did not finish within join_timeout; all were stopped", -1, {})
    tracebacks = {rank: (out_dir / f"{rank}.error").read_text()
                  for rank in exit_codes if (out_dir / f"{rank}.error").exists()}
    # Prefer the root cause: a rank that died (no traceback) beats one that raised because its peer died.
    died = [r for r, code in exit_codes.items() if code not in (None, 0) and r not in tracebacks]
    primary = failed if failed not in tracebacks or not died else died[0]
    if primary in tracebacks:
        what = f"rank {primary} raised {first_line(tracebacks[primary])}"
    else:
        what = f"rank {primary} {describe_exit(exit_codes[primary])}"
    quoted = ""
    if primary not in tracebacks and (exit_codes[primary] or 0) > 0 and not (out_dir / f"{primary}.stack").exists():
        said, quoted = _before_fn(early)   # no stack file: it never reached spawn's rank function
        what += said
    others = [f"  rank {r}: {first_line(tb)}" for r, tb in sorted(tracebacks.items()) if r != primary]
    message = f"spawn: {what}; the other ranks were stopped." + quoted
    if others:
        message += "\nother ranks reported:\n" + "\n".join(others)
    doing = [f"  rank {r}: {where}" for r in sorted(exit_codes) if r != primary and r not in tracebacks
             for where in [stopped_where(out_dir / f"{r}.stack")] if where]
    if doing:
        message += "\nwhen stopped, the other ranks were in:\n" + "\n".join(doing)
    if primary in tracebacks:
        message += f"\n\nrank {primary} traceback:\n{tracebacks[primary]}"
    return SpawnError(message, primary, tracebacks)
