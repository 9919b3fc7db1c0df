"""Single-copy reads: copy bytes straight out of another local process's memory.

Shared segments (segment.py) need every byte copied in by its owner before others can read it. Linux
also lets a process read another's private memory in one kernel copy, given the right to trace it
(same user, and no Yama restriction or seccomp filter in the way): that is cross-memory attach
(CMA), what Open MPI's shared-memory collectives use for large messages. The source stays where it
is (a torch tensor anywhere in the peer's heap); only its address and the peer's pid must be known.

    read(pid, address, into)      copies into.numel() * into.element_size() bytes from ``address``
                                  in process ``pid`` into the contiguous tensor ``into``
                                  (process_vm_readv); raises SingleCopyError naming what failed

The calls drop the GIL (ctypes), so a communication thread reading does not stall the training
thread. ``probe(pid, address, expected)`` tells at set-up whether reads from a peer
work here (segment.py agrees on the answer across ranks, so every rank takes the same algorithm).
GRADSYNC_SHM_SINGLE_COPY=0 turns single-copy reads off.

Not every page can be read so: the kernel refuses (EFAULT) memory a driver mapped as device memory
(VM_IO / VM_PFNMAP), as some NVIDIA drivers map CUDA's pinned host memory (torch's pin_memory, host
staging's private buffers). ``readable(tensor)`` tells an owner before it offers a tensor: it reads
the tensor's first and last byte out of its own process the same way. An owner whose tensor is not
readable publishes no address, and the collective takes its staged twin on every rank
(reduce_scatter_single_copy.py, all_gather_single_copy.py).
"""

from __future__ import annotations

import ctypes
import errno
import os

import torch

ENV = "GRADSYNC_SHM_SINGLE_COPY"
FROM_BYTES = 256 << 10
"""Reduce-scatter inputs and all-gather shards of at least this many bytes are read where they lie;
smaller ones go through the staging halves (one barrier fewer). (The all-reduce always stages:
allreduce_two_shot.py says why.)"""


class SingleCopyError(OSError):
    """A single-copy read failed (the peer is gone, or the kernel refused it)."""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _bind(name: str):
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_ssize_t
    call.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                     ctypes.c_ulong, ctypes.c_ulong]
    return call


_READV = _bind("process_vm_readv")


def enabled() -> bool:
    """False when GRADSYNC_SHM_SINGLE_COPY is 0 or process_vm_readv is missing here."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on", ""):
        raise ValueError(f"{ENV}={value!r}: use 1 (single-copy reads where the kernel allows them) or 0 (never)")
    return _READV is not None and value not in ("0", "false", "off")


def read_bytes(pid: int, address: int, destination: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``address`` in ``pid`` to ``destination`` in this process
    (process_vm_readv), resuming after a partial transfer."""
    done = 0
    local, remote = _Iovec(), _Iovec()
    while done < nbytes:
        local.base, local.length = destination + done, nbytes - done
        remote.base, remote.length = address + done, nbytes - done
        got = _READV(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            code = ctypes.get_errno() if got < 0 else errno.EIO
            raise SingleCopyError(code, f"process_vm_readv with pid {pid} at {address + done:#x} "
                                        f"({nbytes - done} bytes left): {os.strerror(code)}")
        done += got


def read(pid: int, address: int, into: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor ``into`` with the bytes at ``address`` in process ``pid``."""
    read_bytes(pid, address, into.data_ptr(), into.numel() * into.element_size())


def readable(tensor: torch.Tensor) -> bool:
    """Whether a local peer could read the CPU ``tensor`` where it lies (see the module docstring)."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return True
    byte = ctypes.create_string_buffer(1)
    try:
        for address in (tensor.data_ptr(), tensor.data_ptr() + nbytes - 1):
            read_bytes(os.getpid(), address, ctypes.addressof(byte), 1)
    except SingleCopyError:
        return False
    return True


def probe(pid: int, address: int, expected: bytes) -> str | None:
    """None when ``len(expected)`` bytes at ``address`` in ``pid`` read back as ``expected``, else why not."""
    if not enabled():
        return f"{ENV}=0" if _READV is not None else "process_vm_readv is not available"
    buffer = ctypes.create_string_buffer(len(expected))
    try:
        read_bytes(pid, address, ctypes.addressof(buffer), len(expected))
        if buffer.raw != expected:
            return f"process_vm_readv from pid {pid} read other bytes than expected"
    except SingleCopyError as exc:
        return str(exc)
    return None
