"""Functions the stream-order tests (test_stream_order.py) run on every rank of a world whose CPU
tensors are staged (GRADSYNC_HOST_STAGING=cpu), with stream_order.Recorder standing in for CUDA."""

import contextlib
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.comm import cuda_runtime
from gradsync.ddp.powersgd import PowerSGDState, powersgd_hook
from stream_order import Recorder, watching


@contextlib.contextmanager
def _recording(recorder: Recorder):
    """``recorder`` is the CUDA runtime, and this thread's operations are watched."""
    real = cuda_runtime.CUDA
    cuda_runtime.CUDA = recorder
    try:
        with watching(recorder):
            yield
    finally:
        cuda_runtime.CUDA = real


def _summary(recorder: Recorder) -> dict:
    return {"races": recorder.races[:6], "race_count": len(recorder.races), "copies": recorder.copies}


def ddp_steps(hook: str, steps: int = 4) -> dict:
    """The DDP wrapper with ``hook`` ("none", "fp16", "bf16", "powersgd", or "mixed": mixed precision
    in bfloat16, reduced in float32) for ``steps`` steps of a small MLP, two buckets, its
    communication thread watched too: the races found, and how many staging copies ran."""
    recorder = Recorder()
    with _recording(recorder):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        options = {"bucket_cap_mb": 0.0005}   # a bucket a layer, or so: several hand-offs a backward
        if hook in ("fp16", "bf16"):
            options["comm_hook"] = hook
        if hook == "mixed":
            options["mixed_precision"] = SimpleNamespace(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                         buffer_dtype=None)
        model = gs.DistributedDataParallel(module, **options)
        if hook == "powersgd":   # compressed from the third step: warm-up, then P = MQ, Q = M^T P
            model.register_comm_hook(PowerSGDState(rank=1, start_iter=2), powersgd_hook)
        model.reducer._executor.submit(watching(recorder).__enter__).result()   # its communication thread
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(16, 8)
        for _ in range(steps):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
        [p.detach().sum() for p in module.parameters()]
        model.close()
    return _summary(recorder)


def backend_operations(wait_elsewhere: bool) -> dict:
    """Operations of the "gradsync" backend issued on a stream of the caller's own (as FSDP and
    torch.cuda.stream(s) do), each input written on it just before the call and each output read on
    it after wait() (``wait_elsewhere``: waited for and read on another stream): the races found."""
    recorder = Recorder()
    group = dist.new_group(backend="gradsync")
    with _recording(recorder):
        group._thread.submit(lambda: watching(recorder).__enter__(), "watch").get_future().wait()
        issuing, reading = recorder.new_stream(None), recorder.new_stream(None)
        n = gs.world().world_size

        def call(issue, result):
            with recorder.use(issuing):
                work = issue()
            while not work.is_completed():   # run by the group's thread, not by this one in wait()
                time.sleep(0.001)
            with recorder.use(reading if wait_elsewhere else issuing):
                work.wait()
                result().sum()
        a, b = torch.empty(10), torch.empty(3, 5)
        call(lambda: (a.fill_(1.0), b.fill_(2.0), group.allreduce([a, b]))[-1], lambda: b)
        # (each call its own tensors: the caller's stream that issues is not the one that waited)
        d, c = torch.empty(10), torch.empty(6, dtype=torch.float64)   # flattened together on the group's thread
        call(lambda: (d.fill_(1.0), c.fill_(3.0), group.allreduce_coalesced([d, c]))[-1], lambda: c)
        pieces, piece = torch.empty(6 * n), torch.empty(6)
        call(lambda: (pieces.fill_(3.0), dist.reduce_scatter_tensor(piece, pieces, group=group, async_op=True))[-1],
             lambda: piece)
        shard, full = torch.empty(4), torch.empty(4 * n)
        call(lambda: (shard.fill_(4.0), dist.all_gather_into_tensor(full, shard, group=group, async_op=True))[-1],
             lambda: full)
        sent = torch.empty(7)
        call(lambda: (sent.fill_(5.0), dist.broadcast(sent, 0, group=group, async_op=True))[-1], lambda: sent)
        with recorder.use(reading if wait_elsewhere else issuing):   # where the results were waited for
            right = bool(torch.equal(b, torch.full((3, 5), 2.0 * n)) and torch.equal(piece, torch.full((6,), 3.0 * n))
                         and torch.equal(c, torch.full((6,), 3.0 * n, dtype=torch.float64))
                         and torch.equal(full, torch.full((4 * n,), 4.0)) and torch.equal(sent, torch.full((7,), 5.0)))
    dist.destroy_process_group(group)
    return {**_summary(recorder), "right": right}


def collective_on_a_side_stream() -> dict:
    """gs.all_reduce called on a stream of the caller's own, its input written there just before: the
    races found (the staging copies must wait for that stream, not for another)."""
    recorder = Recorder()
    with _recording(recorder):
        side = recorder.new_stream(None)
        with recorder.use(side):
            t = torch.empty(1000).fill_(2.0)
            gs.all_reduce(t)
            ok = bool(torch.equal(t, torch.full((1000,), 2.0 * gs.world().world_size)))
    return {**_summary(recorder), "right": ok}


def regions_registered(fail: bool, numel: int) -> dict:
    """All-reduces through host staging over shared regions (two shapes, twice each), then the world
    shut down (and made again, for the next case): what was page-locked and unlocked, in order,
    against when the regions closed; the warnings about a refused registration; whether the sums
    were right."""
    import warnings

    from gradsync.comm import host_staging
    from gradsync.comm.world_transport import default_transport

    host_staging._WARNED[0] = False   # once a process: this case's own
    recorder = Recorder(register_code=1 if fail else 0)
    transport = default_transport()
    real_close = transport.regions.close

    def close():
        recorder.registered.append("regions closed")
        real_close()
    transport.regions.close = close
    right = []
    with warnings.catch_warnings(record=True) as caught, _recording(recorder):
        warnings.simplefilter("always")
        for size in (numel, numel + 7, numel, numel + 7):
            t = torch.full((size,), float(gs.world().rank + 1))
            gs.all_reduce(t)
            right.append(bool(torch.equal(t, torch.full((size,), float(sum(range(1, gs.world().world_size + 1)))))))
        gs.shutdown()   # closes the transport: its staging, then its regions
    gs.init()
    warned = [str(w.message) for w in caught if "cudaHostRegister" in str(w.message)]
    return {"registered": recorder.registered, "warned": warned, "right": right}
