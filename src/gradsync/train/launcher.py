"""How `gradsync train` starts its ranks: under torchrun (or any launcher that sets RANK, WORLD_SIZE and
MASTER_PORT) this process is one rank; otherwise --workers local processes (gs.spawn), and with
--max-restarts a failed job starts again from its last checkpoint, or in live mode a replacement joins.

Ctrl-C is this job's while it runs (train/preempt.py) and the caller's again when it returns; a
second Ctrl-C stops the ranks at once, and the half-written temporary files of the ranks stopped while
writing are removed.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import gradsync as gs
from gradsync.group import device_path
from gradsync.group.job_signals import hold_signals
from gradsync.group.launch import NotNeeded
from gradsync.observe import trace
from gradsync.train.loop import train_rank
from gradsync.train.preempt import stop_signals
from gradsync.train.resume import CHECKPOINT_NAME
from gradsync.train.strategies import strategy


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_PORT" in os.environ


def run(cfg) -> list[dict]:
    """Run the job (module docstring); every rank's result, in rank order (a live member that died: None)."""
    interrupt = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    try:
        return _run(cfg)
    finally:
        if interrupt is not None:
            signal.signal(signal.SIGINT, interrupt)


def _run(cfg) -> list[dict]:
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    hold_signals(stop_signals(cfg))   # a preemption during start-up stops the job after its first step
    live = cfg.fault_tolerance == "live"
    if under_torchrun() or strategy(cfg.strategy).one_process:
        if live and strategy(cfg.strategy).serves:
            raise RuntimeError(f"--strategy {cfg.strategy} --fault-tolerance live runs under gradsync's own launcher "
                               f"(gradsync train --workers N), not under torchrun")
        if live and cfg.max_restarts:
            raise RuntimeError("--fault-tolerance live --max-restarts starts replacement ranks from gradsync's own "
                               "launcher (gradsync train --workers N); under torchrun a lost node is not replaced: "
                               "drop --max-restarts (and keep torchrun's own --max-restarts at 0)")
        if live:   # a live world's CUDA tensors go through host memory: a death needs no NCCL abort
            device_path.mark_live()
        gs.init(timeout=cfg.timeout)
        try:
            results = [train_rank(cfg)]
        except NotNeeded as done:   # live: a member left out by a partition came back to a finished run
            print(f"gradsync train: {done}", file=sys.stderr, flush=True)
            results = [None]
        finally:
            gs.shutdown()
        if cfg.trace and results[0] is not None:
            trace.write(Path(cfg.out) / f"trace.rank{int(os.environ.get('RANK', 0))}.json", results[0]["events"])
        return results
    if live:
        results = gs.spawn(train_rank, nprocs=cfg.workers, args=(cfg,), timeout=cfg.timeout, fault_tolerance="live",
                           replacements=cfg.max_restarts, forward_signals=stop_signals(cfg))
        print(f"gradsync train: {workers_summary(results)}", file=sys.stderr, flush=True)
        return results
    try:
        results = _spawn_with_restarts(cfg)
    except KeyboardInterrupt:   # a second Ctrl-C: the ranks were stopped at once, maybe mid-write
        _remove_partial_writes(Path(cfg.out))
        raise
    if cfg.trace:
        trace.write(Path(cfg.out) / "trace.json", [e for r in results for e in r["events"]])
    return results


def _spawn_with_restarts(cfg) -> list[dict]:
    """gs.spawn, and after a failure up to ``cfg.max_restarts`` more attempts, each resuming from the
    newest checkpoint this job wrote (an older one in --out, from another run, is never used)."""
    started = time.time()
    checkpoint_path = Path(cfg.out) / CHECKPOINT_NAME
    for attempt in range(cfg.max_restarts + 1):
        try:
            return gs.spawn(train_rank, nprocs=cfg.workers, args=(cfg,), timeout=cfg.timeout,
                            forward_signals=stop_signals(cfg))
        except gs.SpawnError as exc:
            if attempt == cfg.max_restarts:
                raise
            ours = checkpoint_path.exists() and checkpoint_path.stat().st_mtime >= started
            cfg = dataclasses.replace(cfg, resume=ours or cfg.resume)
            print(f"gradsync train: {str(exc).splitlines()[0]}\ngradsync train: restart {attempt + 1} of "
                  f"{cfg.max_restarts}, from {'the last checkpoint' if cfg.resume else 'the beginning'}",
                  file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _remove_partial_writes(out: Path) -> None:
    """The temporary files (checkpoint.save's .NAME.tmp-PID) of ranks that were stopped while writing."""
    for partial in out.glob(".*.tmp-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            partial.unlink(missing_ok=True)
        except PermissionError:   # alive, another user's
            pass


def workers_summary(results: list[dict | None]) -> str:
    """One line for the launcher of a live job: which members finished and what the recoveries cost."""
    finished = [r for r in results if r is not None]
    changes = finished[0]["recoveries"] if finished else []
    seconds = [r["seconds"] for r in changes if not r["joined"]]
    joins = [r for r in changes if r["joined"]]
    return (f"live: {len(finished)} of {len(results)} members finished; {len(seconds)} recovery(ies)"
            + (f", median {statistics.median(seconds):.3f} s from the error to the rebuilt world" if seconds else "")
            + (f"; {len(joins)} replacement(s) joined" if joins else ""))
