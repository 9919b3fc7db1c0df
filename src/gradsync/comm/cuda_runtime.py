"""The CUDA calls host staging makes (host_staging.py), in one object: streams, events, copies,
page-locking.

Why one object: the order of these calls is what makes staging right or wrong (a copy that starts
before the kernel that wrote its source has run reads stale bytes, silently), and that order can be
checked without a GPU only if every call passes through one place a test can stand in for
(tests/stream_order.py replaces ``CUDA`` with a recorder that replays the calls against a model of
streams and finds every unordered pair of accesses). Nothing here decides anything; host_staging.py
does.

Page-locking a shared region (``register``): cudaHostRegister with cudaHostRegisterPortable, so the
pages are pinned for every CUDA context of the process (not only the one current on the calling
thread), called with the tensor's own device current (on a thread whose current device is cuda:0 a
call would otherwise make a context on GPU 0 for this rank). Its return code is checked: where CUDA
refuses (a region already registered, a locked-memory limit), the region stays pageable, the copies
through it are synchronous, and the caller warns once. A failed runtime call stays CUDA's "last
error" on its thread, which torch's next kernel-launch check would raise as its own, so it is read
away (cudaGetLastError), as torch's caching allocator does after a failed cudaMalloc.
"""

from __future__ import annotations

import ctypes
import functools

import torch

HOST_REGISTER_PORTABLE = 1
"""cudaHostRegisterPortable (cuda_runtime_api.h): pinned for every CUDA context of the process."""


class CudaRuntime:
    """The CUDA runtime as host staging uses it (see the module docstring)."""

    def is_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on a GPU (staging copies it through host memory)."""
        return tensor.is_cuda

    def current_stream(self, device: torch.device):
        """The calling thread's current stream on ``device``."""
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device):
        return torch.cuda.Stream(device)

    def event(self):
        return torch.cuda.Event()

    def use(self, stream):
        """A context in which ``stream`` (and its device) is current on this thread."""
        return torch.cuda.stream(stream)

    def on(self, device: torch.device):
        """A context in which ``device`` is current on this thread."""
        return torch.cuda.device(device)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor``: its memory is not handed out
        again before what ``stream`` has queued so far has run."""
        tensor.record_stream(stream)

    def synchronize(self, device: torch.device) -> None:
        """Block until everything queued on ``device`` by this process has run."""
        torch.cuda.synchronize(device)

    def copy(self, destination: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
        """``destination.copy_(source)`` on the current stream (non_blocking=False: returns when done)."""
        destination.copy_(source, non_blocking=non_blocking)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked private host memory (torch's pinned-memory allocator)."""
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def register(self, host: torch.Tensor, device: torch.device) -> int:
        """Page-lock ``host`` (a shared region) for copies to and from ``device``: 0, or CUDA's error code."""
        if not host.numel():
            return 0
        with torch.cuda.device(device):
            code = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(),
                                                             HOST_REGISTER_PORTABLE))
        if code:
            _clear_last_error()
        return code

    def unregister(self, host: torch.Tensor) -> int:
        """Undo ``register`` (before the memory is unmapped): 0, or CUDA's error code."""
        if not host.numel():
            return 0
        code = int(torch.cuda.cudart().cudaHostUnregister(host.data_ptr()))
        if code:
            _clear_last_error()
        return code

    def future(self, devices: list[torch.device]) -> torch.futures.Future:
        """A Future whose completion records an event on the completing thread's current streams of
        ``devices``, and whose waiters' current streams wait for it (torch's CUDA-aware Future)."""
        return torch.futures.Future(devices=devices)


@functools.lru_cache(maxsize=1)
def _cudart():
    """The libcudart torch loaded (found in this process's mappings), or None."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart" in line.rsplit("/", 1)[-1]), None)
        return ctypes.CDLL(path) if path is not None else None
    except OSError:
        return None


def _clear_last_error() -> None:
    """Read away the calling thread's last CUDA error (see the module docstring); nothing where
    torch's libcudart cannot be found."""
    library = _cudart()
    if library is not None and hasattr(library, "cudaGetLastError"):
        library.cudaGetLastError()


CUDA = CudaRuntime()
"""The runtime host staging calls (tests may replace it: see the module docstring)."""
