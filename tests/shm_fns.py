"""Rank functions for tests/test_shm.py (module level, so spawned ranks can import them)."""

import os
import signal
import time
from pathlib import Path

import torch

import gradsync as gs
from gradsync.comm.transport.shm.hold import current_cpu
from gradsync.comm.transport import PeerError
from gradsync.comm.world_transport import default_transport


def job_names() -> list[str]:
    """This job's names in /dev/shm, seen from inside the running job."""
    job = os.environ["GRADSYNC_JOB_ID"]
    return sorted(p.name for p in Path("/dev/shm").glob(f"gradsync-{job}*"))


def transport_and_names():
    x = torch.arange(10.0) * (gs.world().rank + 1)
    gs.all_reduce(x)
    return type(default_transport()).__name__, job_names(), x


def size_mismatch():
    """Rank 0 sends 2 floats where rank 1 expects 4: rank 1 must say so, not hang or corrupt."""
    transport = default_transport()
    if gs.world().rank == 0:
        transport.isend(torch.ones(2), 1, "test/mismatch").wait()
        return None
    try:
        transport.irecv(torch.empty(4), 0, "test/mismatch").wait()
    except PeerError as exc:
        return str(exc)
    return "no error"


def killed_mid_collective():
    """Rank 1 SIGKILLs itself inside a run of all-reduces. A rank that notices by itself before the
    launcher stops it returns quietly: the launcher's error is what the test checks."""
    w = gs.world()
    x = torch.ones(1 << 20)
    for step in range(1000):
        if w.rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            gs.all_reduce(x, op="avg")
        except PeerError:
            return None
    return None


def shared_memory_refused():
    """algorithm="shared_memory" over TCP must say why it cannot run."""
    try:
        gs.all_reduce(torch.ones(4), algorithm="shared_memory")
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def shared_memory_pieces(stage_numel: int):
    """A tensor of several staging pieces, twice in a row, with the bytes read from other ranks."""
    w = gs.world()
    n = 3 * stage_numel + 5
    results = []
    for _ in range(2):
        x = torch.arange(n, dtype=torch.float64) * (w.rank + 1)
        gs.traffic_reset()
        gs.all_reduce(x, op="avg", algorithm="shared_memory")
        results.append((x, gs.traffic()["bytes_received"], gs.traffic()["bytes_sent"]))
    return results


def detect_death(report_dir: str):
    """Rank 0 waits in an all-reduce that rank 1 never joins; once rank 0 has checked at least once
    that rank 1 is alive (so it is waiting), a thread of rank 0 SIGKILLs rank 1 and records when
    /proc first shows it dead. No launcher is involved (the test pool does not stop the others), so
    rank 0 must notice by itself. Rank 0 writes report.json: every liveness check of rank 1's pid
    (monotonic start time, result), when the death became observable, when the error came, and the
    error. Rank 1 writes its pid and sleeps until killed."""
    import json
    import threading

    from gradsync.comm.transport.shm import waiting

    w = gs.world()
    if w.rank == 1:
        Path(report_dir, "pid").write_text(str(os.getpid()))
        time.sleep(60)
        return None
    pid_file, deadline = Path(report_dir, "pid"), time.monotonic() + 30.0
    while not pid_file.exists() or not pid_file.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 1 wrote no pid within 30 s")
        time.sleep(0.01)
    victim = int(pid_file.read_text())
    checks, observable = [], []
    real_alive = waiting.process_alive

    def recorded_alive(pid):
        started = time.monotonic()
        alive = real_alive(pid)
        if pid == victim:
            checks.append((started, alive))
        return alive

    def kill_once_waiting():
        while not checks:   # no liveness check within the wait: never killed, and the test fails
            if time.monotonic() > deadline + 30.0:
                return
            time.sleep(0.005)
        os.kill(victim, signal.SIGKILL)
        while real_alive(victim):
            time.sleep(0.001)
        observable.append(time.monotonic())

    waiting.process_alive = recorded_alive
    killer = threading.Thread(target=kill_once_waiting, daemon=True)
    killer.start()
    try:
        gs.all_reduce(torch.ones(8))
        error, error_at = "no error", time.monotonic()
    except PeerError as exc:
        error, error_at = str(exc), time.monotonic()
    finally:
        waiting.process_alive = real_alive
    killer.join(10)
    Path(report_dir, "report.json").write_text(json.dumps(
        {"pid": victim, "checks": checks, "observable": observable[0] if observable else None,
         "error_at": error_at, "error": error}))
    return None


def shm_send_while_waiting_on_tcp():
    """Rank 0 posts a shared-memory send larger than the ring, then waits for a tagged (TCP) message
    that rank 1 sends only after receiving all of it: the TCP wait must keep the shm send moving."""
    transport = default_transport()
    big = torch.arange(1 << 20, dtype=torch.float64)   # 8 MiB through a 2 MiB ring
    if gs.world().rank == 0:
        send = transport.isend(big, 1, "test/big")
        reply = torch.zeros(1, dtype=torch.float64)
        transport.irecv(reply, 1, "test/reply", tag=5).wait()
        send.wait()
        return float(reply)
    incoming = torch.empty_like(big)
    transport.irecv(incoming, 0, "test/big").wait()
    transport.isend(incoming.sum().reshape(1), 0, "test/reply", tag=5).wait()
    return None


def reinit_three_times():
    """shutdown() then init() again inside one job: each world gets fresh keys and a fresh transport."""
    out = []
    for generation in range(3):
        if generation:
            gs.shutdown()
            gs.init()
        x = torch.ones(5) * (gs.world().rank + 1)
        gs.all_reduce(x)
        out.append((gs.world().generation, type(default_transport()).__name__, x))
    return out


def in_place_rewritten_at_once(numel: int, rounds: int):
    """All-reduce a shared-region tensor, then overwrite it at once with the next round's values, as
    backward does with a bucket: the in-place all-reduce must not let any rank write its tensor while
    another still reads it. Returns the rounds whose result differs from the closed form."""
    w = gs.world()
    region = default_transport().regions.allocate(numel, torch.float64)
    base = torch.arange(numel, dtype=torch.float64)
    wrong = []
    for i in range(rounds):
        torch.mul(base, w.rank + 1 + i, out=region)
        gs.all_reduce(region, algorithm="shared_memory")
        expected = base * sum(r + 1 + i for r in range(w.world_size))
        if not torch.equal(region, expected):
            wrong.append(i)
    return wrong


def reduce_scatter_region_rewritten_at_once(numel: int, rounds: int):
    """Reduce-scatter a shared-region tensor, then overwrite it at once with the next round's values,
    as the next backward does with ShardedOptimizer's gradients: the in-place reduce-scatter must
    not return while another rank still reads this rank's input. Returns the rounds whose chunk
    differs from the closed form."""
    from gradsync.comm.allreduce_ring import ring_chunks

    w = gs.world()
    region = default_transport().regions.allocate(numel, torch.float64)
    base = torch.arange(numel, dtype=torch.float64)
    chunk = ring_chunks(numel, w.world_size)
    wrong = []
    for i in range(rounds):
        torch.mul(base, w.rank + 1 + i, out=region)
        shard = gs.reduce_scatter(region)
        expected = chunk.view(base, w.rank) * sum(r + 1 + i for r in range(w.world_size))
        if not torch.equal(shard, expected):
            wrong.append(i)
    return wrong


def all_gather_region_rewritten_at_once(numel: int, rounds: int):
    """Write this rank's chunk of a shared-region tensor, all-gather in place, then write the chunk
    again at once, as ShardedOptimizer's next update does: no rank may return while another still
    copies its chunk. Returns the rounds whose result differs from the closed form."""
    from gradsync.comm.allreduce_ring import ring_chunks
    from gradsync.comm.collectives import all_gather_in_place

    w = gs.world()
    region = default_transport().regions.allocate(numel, torch.float64)
    chunks = ring_chunks(numel, w.world_size)
    base = torch.arange(numel, dtype=torch.float64)
    wrong = []
    for i in range(rounds):
        torch.mul(chunks.view(base, w.rank), w.rank + 1 + i, out=chunks.view(region, w.rank))
        all_gather_in_place(region)
        expected = torch.cat([chunks.view(base, r) * (r + 1 + i) for r in range(w.world_size)])
        if not torch.equal(region, expected):
            wrong.append(i)
    return wrong


def all_gather_in_place_of_a_plain_tensor():
    """all_gather_in_place on a tensor outside any shared region: the error's message."""
    from gradsync.comm.collectives import all_gather_in_place

    try:
        all_gather_in_place(torch.zeros(10))
    except ValueError as exc:
        return str(exc)
    return None


def reduce_scatter_region_against_plain(numel: int):
    """Every rank allocates a shared region; rank 1 then reduce-scatters a plain copy instead of it."""
    region = default_transport().regions.allocate(numel, torch.float32)
    region.fill_(1.0)
    gs.reduce_scatter(region.clone() if gs.world().rank == 1 else region)


def affinity_in_and_after_collectives():
    """The calling thread's CPU affinity and core inside each shared-memory collective (seen at its
    barriers' entries and exits) and its affinity after it, with the transport's own_core. Each
    collective is entered from another core than the rank's own (where there is one). Returns
    (own_core, before, [(name, affinities at entries, cores at entries, affinities at exits, after)]).
    "all_reduce, late peer": the last rank enters 50 ms late, so the others sleep in the barrier."""
    transport = default_transport()
    before = os.sched_getaffinity(0)
    entries: list[set[int]] = []
    cores: list[int] = []
    exits: list[set[int]] = []
    plain_barrier = transport.barrier
    last = gs.world().rank == gs.world().world_size - 1

    def barrier(op, spin=False):
        entries.append(os.sched_getaffinity(0))
        cores.append(current_cpu())
        plain_barrier(op, spin)
        exits.append(os.sched_getaffinity(0))

    def late_all_reduce():
        if last:
            time.sleep(0.05)
        gs.all_reduce(torch.ones(1 << 10))

    transport.barrier = barrier
    seen = []
    try:
        for name, run in (("all_reduce", lambda: gs.all_reduce(torch.ones(1 << 18))),
                          ("all_reduce 4 MiB", lambda: gs.all_reduce(torch.ones(1 << 20))),
                          ("broadcast", lambda: gs.broadcast(torch.ones(1 << 10), src=1)),
                          ("reduce_scatter", lambda: gs.reduce_scatter(torch.ones(1 << 12))),
                          ("all_gather", lambda: gs.all_gather(torch.ones(1 << 10))),
                          ("all_reduce, late peer", late_all_reduce)):
            plain_barrier("test/line up")
            elsewhere = [core for core in sorted(before) if core != transport.own_core][:1]
            if elsewhere:   # start the collective on another core than the rank's own
                os.sched_setaffinity(0, elsewhere)
                os.sched_setaffinity(0, before)
            entries.clear(), cores.clear(), exits.clear()
            run()
            seen.append((name, [sorted(a) for a in entries], list(cores), [sorted(a) for a in exits],
                         sorted(os.sched_getaffinity(0))))
    finally:
        del transport.barrier
    return transport.own_core, sorted(before), seen


def repeated_small_all_reduces(rounds: int):
    """Small all-reduces repeated per shape (from the second call each runs its kept plan), every call
    on new integer-valued inputs, against torch.distributed's all-reduce of the same inputs (gloo:
    an independent implementation; integer values make every order of summation exact). Then the
    same shapes as a tensor that needs grad and as a strided view, which do not take the plan.
    Returns (mismatches, the plans' keys)."""
    import torch.distributed as dist
    rank = gs.world().rank
    cases = [("sum", torch.float32, 1), ("sum", torch.float32, 1000), ("avg", torch.float64, 300),
             ("max", torch.float32, 1000), ("bor", torch.int64, 5000), ("sum", torch.int32, 0),
             ("sum", torch.float32, 100_000)]
    native = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "bor": dist.ReduceOp.BOR}
    mismatches = []
    for call in range(rounds):
        for op, dtype, numel in cases:
            generator = torch.Generator().manual_seed(1000 * call + 10 * rank + numel)
            values = torch.randint(0, 64, (numel,), generator=generator).to(dtype)
            expected = values.clone()
            dist.all_reduce(expected, op=native[op])
            if op == "avg":
                expected /= gs.world().world_size
            if call == rounds - 1 and dtype.is_floating_point and numel > 1:   # the same shape, not plain
                needs_grad = values.clone().requires_grad_()
                with torch.no_grad():
                    gs.all_reduce(needs_grad, op=op)
                strided = torch.zeros(2 * numel, dtype=dtype)[::2]
                strided.copy_(values)
                gs.all_reduce(strided, op=op)
                for name, got in (("needs grad", needs_grad.detach()), ("strided", strided)):
                    if not torch.equal(got, expected):
                        mismatches.append((call, op, str(dtype), numel, name))
            gs.all_reduce(values, op=op)
            if not torch.equal(values, expected):
                mismatches.append((call, op, str(dtype), numel, "plain"))
    return mismatches, sorted((k[1], str(k[3]), k[4]) for k in default_transport().context.plans if k[0] == "all_reduce")


def plan_then_mismatch(kind: str, numel: int):
    """Every rank all-reduces the same ``numel`` float32 three times (the last two from the kept plan);
    then rank 1 alone changes the call (``kind``: "dtype" or "op")."""
    for _ in range(3):
        gs.all_reduce(torch.ones(numel))
    if gs.world().rank == 1:
        gs.all_reduce(torch.ones(numel, dtype=torch.float64) if kind == "dtype" else torch.ones(numel), op="max")
    else:
        gs.all_reduce(torch.ones(numel))


def nan_payloads_all_reduced(sizes: list[int], ops: list[str]):
    """Each rank all-reduces float32 tensors holding NaNs of its own payload and finite values, twice
    per (op, size) (the second call of a small shape runs its kept plan): at every third element
    ranks 0 and 1 hold NaNs (the others a finite value), at the next one ranks 0 and 2. x86's add
    and multiply return one operand's payload, chosen by position, so only ranks that all fold in
    the same order, operand for operand, end with the same bits. Returns {(op, size, call): the
    result's bits as int32}."""
    rank = gs.world().rank
    results = {}
    for op in ops:
        for numel in sizes:
            for call in range(2):
                index = torch.arange(numel)
                bits = (index.to(torch.int32) % 1000) * 8 + rank + 1
                values = (bits | 0x7FC00000).view(torch.float32).clone()
                nan = (index % 3 == 0) & (rank < 2) | (index % 3 == 1) & (rank % 2 == 0)
                values[~nan] = (index[~nan] % 7).to(torch.float32) + rank
                gs.all_reduce(values, op=op)
                results[(op, numel, call)] = values.view(torch.int32).clone()
    return results


def plan_then_region(numel: int):
    """A plain float32 tensor of ``numel`` all-reduced twice (a plan is kept for its shape), then a
    tensor of the same shape in a shared region, then the plain one again. Returns, per call, the
    bytes this rank read out of the others' memory and whether the result was the closed form, and
    whether a plan was kept."""
    w = gs.world()
    transport = default_transport()
    plain = torch.empty(numel)
    region = transport.regions.allocate(numel, torch.float32)
    expected = torch.arange(numel, dtype=torch.float32) * sum(r + 1 for r in range(w.world_size))
    calls = []
    for tensor in (plain, plain, region, plain):
        torch.mul(torch.arange(numel, dtype=torch.float32), w.rank + 1, out=tensor)
        gs.traffic_reset()
        gs.all_reduce(tensor)
        calls.append((gs.traffic()["bytes_received"], torch.equal(tensor, expected)))
    kept = ("all_reduce", "sum", "auto", torch.float32, numel) in transport.context.plans
    return calls, kept


def all_reduce_traffic_and_barriers(numel: int):
    """One shared-memory all-reduce (sum, float32) of a fresh tensor: the meter's counts and how many
    shared-memory barriers this rank entered during it (the direct all-reduce enters one, the split
    one two per piece: which path ran, seen from outside the choice)."""
    transport = default_transport()
    t = torch.ones(numel)
    gs.traffic_reset()
    before = transport.counters.barriers
    gs.all_reduce(t, algorithm="shared_memory")
    return gs.traffic(), transport.counters.barriers - before


def single_copy_state():
    """(whether this rank's transport reads peers' tensors where they lie, why not)."""
    transport = default_transport()
    return transport.single_copy, transport.single_copy_problem


def adopted_region(numel: int, decliner: int | None):
    """A tensor of this rank's own (rank r's holds r + 1) adopted as a shared region (regions.adopt),
    every rank offering except ``decliner``; then one all-reduce of it. Returns whether it was
    adopted, what this rank reads in every rank's copy (rank order), whether its address moved,
    whether the all-reduce's result is the closed form, once it is freed whether a tensor mapped at
    its old address is taken for it (None when no mapping landed there), and whether a region
    allocated after another adopted tensor was freed is found (and whether it lies at that one's
    address)."""
    import gc

    w = gs.world()
    regions = default_transport().regions
    tensor = torch.full((numel,), float(w.rank + 1), dtype=torch.float64)
    before = tensor.data_ptr()
    adopted = regions.adopt(tensor, offer=w.rank != decliner)
    located = regions.views_of(tensor)
    seen = [float(view[-1]) for view in located[1]] if located is not None else None
    gs.all_reduce(tensor)
    right = torch.equal(tensor, torch.full((numel,), float(sum(range(1, w.world_size + 1))), dtype=torch.float64))
    address = tensor.data_ptr()
    moved = address != before
    del tensor, located
    gc.collect()
    reused = None
    stand_in = _mapped_at(address, numel * 8)   # fresh memory where the adopted tensor was
    if stand_in is not None:
        reused = regions.views_of(stand_in.view(torch.float64)) is not None
        _unmap(stand_in)
    # another adopted tensor freed, then a region allocated: its mapping usually lands at the freed
    # tensor's address while that one is still on the books; the region is found, and summed right
    third = torch.full((numel,), float(w.rank + 1), dtype=torch.float64)
    regions.adopt(third, offer=w.rank != decliner)
    address = third.data_ptr()
    del third
    gc.collect()
    region = regions.allocate(numel, torch.float64)
    region.fill_(float(w.rank + 1))
    found = regions.views_of(region) is not None
    gs.all_reduce(region)
    right = right and torch.equal(region, torch.full_like(region, float(sum(range(1, w.world_size + 1)))))
    return adopted, seen, moved, right, reused, found, region.data_ptr() == address


_MAP_FIXED_NOREPLACE = 0x100000


def _mapped_at(address: int, nbytes: int) -> torch.Tensor | None:
    """Anonymous memory mapped exactly at ``address`` as a uint8 tensor, or None when anything is
    mapped there already (mmap with MAP_FIXED_NOREPLACE never replaces a mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    got = libc.mmap(address, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE, -1, 0)
    if got in (None, ctypes.c_void_p(-1).value):
        return None
    if got != address:   # a kernel older than MAP_FIXED_NOREPLACE takes the address as a hint only
        libc.munmap(ctypes.c_void_p(got), ctypes.c_size_t(nbytes))
        return None
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)


def _unmap(tensor: torch.Tensor) -> None:
    import ctypes

    ctypes.CDLL(None).munmap(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(tensor.numel()))


def wait_that_times_out(kind: str, seconds: float):
    """Rank 0 waits for what rank 1 never does (kind "receive": a shared-memory message; "barrier": the
    transport's barrier) and returns the error; rank 1 sleeps past the wait, then returns None."""
    import torch

    transport = default_transport()
    if gs.world().rank == 1:
        time.sleep(seconds + 1.0)
        return None
    started = time.monotonic()
    try:
        if kind == "receive":
            transport.irecv(torch.empty(16), 1, "test/receive").wait(timeout=seconds)
        else:
            transport.barrier("test/barrier")
    except PeerError as exc:
        return str(exc), time.monotonic() - started
    return "no error", time.monotonic() - started
