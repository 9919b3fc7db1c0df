"""Checkpoints that are either whole or refused.

File layout: the 8-byte magic b"GSYNCKP1", the 32-byte SHA-256 of the payload, the payload's
length as 8 little-endian bytes, then the payload (torch.save of a dict of tensors, numbers,
strings). Writing goes to a temporary file in the same directory, is fsynced, then renamed over
the target and the directory fsynced: a crash at any moment leaves the previous checkpoint intact.
Loading checks magic, length and checksum before unpickling anything, with weights_only=True.

Off the training thread: ``snapshot(state)`` copies every tensor (a memory copy, milliseconds), and
a BackgroundWriter serialises, checksums, writes and fsyncs that copy on a thread of its own while
training goes on. Writes are taken one at a time, in order (a new one first waits for the last),
and a failed write raises at the next submit or wait.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
from pathlib import Path

import torch

MAGIC = b"GSYNCKP1"


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt or from an incompatible run."""


def temporary(path: Path, pid: int | None = None) -> Path:
    """The file save() writes for ``path`` (in process ``pid``, default this one) before renaming it."""
    return path.with_name(f".{path.name}.tmp-{os.getpid() if pid is None else pid}")


def temporaries(path: Path) -> list[Path]:
    """Every process's temporary file for ``path`` (a writer stopped mid-write leaves one)."""
    return sorted(path.parent.glob(f".{path.name}.tmp-*"))


def save(path: str | Path, state: dict) -> Path:
    """Write ``state`` to ``path`` atomically (see module docstring)."""
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    tmp = temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + hashlib.sha256(payload).digest() + len(payload).to_bytes(8, "little") + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:   # a write cut short (an error, a second Ctrl-C) leaves no half-written file
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def snapshot(state):
    """A copy of ``state`` (nested dicts, lists, tuples) whose tensors no longer share memory with the
    live ones, so training may change those while the copy is written."""
    if isinstance(state, torch.Tensor):   # on the CPU: a checkpoint loads on any device (load's map_location)
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: snapshot(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(value) for value in state)
    return state


class BackgroundWriter:
    """save() on a thread of its own, one checkpoint at a time; ``seconds``: time spent writing."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, path: str | Path, state: dict) -> None:
        """Write ``state`` (a snapshot: nothing else may change it) to ``path`` in the background."""
        self.wait()
        self._thread = threading.Thread(target=self._write, args=(Path(path), state),
                                        name="gradsync-checkpoint-writer", daemon=True)
        self._thread.start()

    def _write(self, path: Path, state: dict) -> None:
        started = time.perf_counter()
        try:
            save(path, state)
        except BaseException as exc:  # carried to the training thread by wait()
            self._error = exc
        finally:
            self.seconds += time.perf_counter() - started

    def wait(self) -> None:
        """Return once no write is under way; raise if the last one failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"writing a checkpoint in the background failed: {error}") from error


def load(path: str | Path) -> dict:
    """Read a checkpoint written by save(); raise CheckpointError if it is not intact."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    header = len(MAGIC) + 32 + 8
    if len(data) < header or data[:len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path} is not a gradsync checkpoint (bad header)")
    digest, length = data[len(MAGIC):len(MAGIC) + 32], int.from_bytes(data[len(MAGIC) + 32:header], "little")
    payload = data[header:]
    if len(payload) != length:
        raise CheckpointError(f"{path} is truncated: {len(payload)} of {length} payload bytes present")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path} is corrupt: its SHA-256 checksum does not match the contents")
    return torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")   # CUDA or not, it loads here
