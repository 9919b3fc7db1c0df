"""A world of N ranks that stays up between test cases.

Starting a world costs seconds on this machine (N interpreters importing torch), so property tests
run hundreds of cases inside one world: ``pool.run(fn, *args)`` calls fn(*args) on every rank and
returns the per-rank results in rank order. A failing case (an exception on any rank, or no answer
within ``case_timeout`` seconds) raises in the test and retires the world; the next ``run`` starts a
fresh one, so one bad case never poisons the next.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

import torch

from gradsync.group.launch import _die_with_parent

CASE_TIMEOUT = 60.0


class RankFailure(RuntimeError):
    """A case raised on some rank; ``errors`` maps rank -> (exception type name, message)."""

    def __init__(self, errors: dict[int, tuple[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"rank {r}: {t}: {m}" for r, (t, m) in sorted(errors.items())))


def _serve(rank: int, n: int, port: int, conn, timeout: float, env: dict) -> None:
    _die_with_parent()
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "GRADSYNC_EXTERNAL_STORE": "1"})
    torch.set_num_threads(1)
    import gradsync as gs

    try:
        gs.init(timeout=timeout)
    except BaseException as exc:  # noqa: BLE001 - answer the first case with why this rank has no world
        conn.recv()
        conn.send(("error", (type(exc).__name__, f"init failed: {exc}")))
        return
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args = message
        try:
            conn.send(("ok", fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - report everything to the test
            conn.send(("error", (type(exc).__name__, f"{exc}\n{traceback.format_exc()}")))
    gs.shutdown()
    # Skip the interpreter's own finalisation: with torch loaded it costs a few tenths of a second of
    # CPU per rank, which for the session's thirty-odd ranks on two cores is over ten seconds.
    os._exit(0)


class WorldPool:
    """N ranks waiting for cases; see module docstring."""

    def __init__(self, n: int, timeout: float = 20.0, env: dict | None = None, rank_env: dict | None = None):
        self.n = n
        self.env = dict(env or {})
        self.rank_env = dict(rank_env or {})  # rank -> extra variables for that rank only
        self.timeout = timeout
        self._procs: list = []
        self._conns: list = []

    def _start(self) -> None:
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, self.n + 1, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        for rank in range(self.n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, self.n, self._store.port, child, self.timeout,
                                     {**self.env, **self.rank_env.get(rank, {})}),
                               daemon=True)
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)

    def ask_to_close(self) -> None:
        """Tell every rank to leave (close() then waits; several pools can be asked first, then closed)."""
        for conn, proc in zip(self._conns, self._procs):
            try:
                if proc.is_alive():
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass

    def run(self, fn, *args, case_timeout: float = CASE_TIMEOUT) -> list:
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn, args))
        replies, errors = [], {}
        for rank, conn in enumerate(self._conns):
            if not conn.poll(case_timeout):
                self.close()
                raise TimeoutError(f"rank {rank} gave no answer within {case_timeout} s")
            try:
                status, value = conn.recv()
            except EOFError:  # the rank's process is gone (killed, or it crashed)
                self._procs[rank].join(5)
                status, value = "error", ("died", f"the process exited with code {self._procs[rank].exitcode}")
            replies.append(value)
            if status == "error":
                errors[rank] = value
        if errors:
            self.close()
            raise RankFailure(errors)
        return replies

    def close(self, deadline: float | None = None) -> None:
        """Ask the ranks to leave and wait until ``deadline`` (time.monotonic(); default 3 s from now)
        for them to exit; kill those still there."""
        self.ask_to_close()
        deadline = time.monotonic() + 3.0 if deadline is None else deadline
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._conns = [], []
