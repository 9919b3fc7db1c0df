"""An unchanged torch.distributed program on the "gradsync" backend, run by test_backend.py.

The default group is gradsync's (init_process_group("gradsync")); the same script also makes a
gloo group over the same ranks, and every check runs the same thing on both and compares: torch's
own DDP (no_sync, find_unused_parameters, fp16_compress_hook, static_graph; buckets large enough
for the backend to adopt into shared memory, with and without gradient_as_bucket_view), ZeroRedundancyOptimizer,
every collective torch.distributed offers on shapes, dtypes, ops and roots that the test draws
with hypothesis (it serves them one at a time through a TCPStore of its own, the same case to
every rank, and reads back what differed from gloo), subgroups and a 2 x 2 DeviceMesh, point-to-point and
object collectives. It also checks the traffic meter against the ring formula, that a
mismatched collective is an error naming both ranks, and that when one rank never calls a
collective every rank waiting in it raises within the group's timeout naming that rank. Each rank
prints one line ``RESULT {json}``.
"""

import json
import os
import sys
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer

import gradsync as gs
from gradsync.comm.allreduce_ring import ring_bytes_sent

torch.set_num_threads(1)
dist.init_process_group("gradsync", timeout=timedelta(seconds=40))
RANK, N = dist.get_rank(), dist.get_world_size()
GLOO = dist.new_group(backend="gloo")
problems: list[str] = []


def check(condition: bool, what: str) -> None:
    if not condition:
        problems.append(what)


# -- torch's DDP -------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.unused = nn.Linear(6, 16), nn.Linear(16, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def train(group, variant: str):
    model = Net().double()
    kwargs = {"find_unused_parameters": True} if variant == "unused" else {}
    if variant == "static":
        kwargs["static_graph"] = True
    if variant != "unused":
        model.unused.requires_grad_(False)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, **kwargs)
    if variant == "fp16_hook":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(4):
        for micro in range(2):
            g = torch.Generator().manual_seed(100 * RANK + 10 * step + micro)
            x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)
            with ddp.no_sync() if micro == 0 and variant == "no_sync" else nullcontext():
                loss = nn.functional.mse_loss(ddp(x), y)
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return torch.tensor(losses), [p.detach().clone() for p in model.parameters()]


def relative(a, b) -> float:
    return float(((a - b).abs() / b.abs().clamp_min(1e-300)).max()) if a.numel() else 0.0


def normwise(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


ddp_worst = {}
for variant in ("no_sync", "unused", "fp16_hook", "static"):
    ours, theirs = train(None, variant), train(GLOO, variant)
    # fp16 on the wire: the two backends add the compressed gradients in different orders, so
    # they agree to fp16's precision, normwise; float64 everywhere else, elementwise
    distance = normwise if variant == "fp16_hook" else relative
    ddp_worst[variant] = max([distance(ours[0], theirs[0])] + [distance(a, b) for a, b in zip(ours[1], theirs[1])])

# -- torch's DDP with buckets of 256 KiB and more: the backend adopts them into shared memory --------
class Wide(nn.Module):
    """float64 weights of 256 KiB and 2 MiB: two buckets (torch's first closes at 1 MiB), both large
    enough for the backend to adopt (c10d/adoption.py)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = nn.Linear(64, 512), nn.Linear(512, 512)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def train_wide(group, view: bool):
    """Six steps (the backend adopts a bucket from its third backward); the losses, the parameters,
    and whether every gradient lay in shared memory after the last backward."""
    model = Wide().double()
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=view)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses, shared = [], None
    for step in range(6):
        g = torch.Generator().manual_seed(1000 + 100 * RANK + step)
        x, y = torch.randn(8, 64, generator=g, dtype=torch.float64), torch.randn(8, 512, generator=g, dtype=torch.float64)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        losses.append(loss.item())
        shared = all(p.grad.untyped_storage().is_shared() for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
    return torch.tensor(losses), [p.detach().clone() for p in model.parameters()], shared


wide = {}
for view in (False, True):
    ours, theirs = train_wide(None, view), train_wide(GLOO, view)
    wide[f"view={view}"] = {"worst": max([relative(ours[0], theirs[0])]
                                         + [relative(a, b) for a, b in zip(ours[1], theirs[1])]),
                            "shared": ours[2], "shared_on_gloo": theirs[2]}
# Which other tensors move: a program's own all-reduce outside backward never moves its tensor; one
# issued during backward (a hook's) moves a buffer it all-reduces again and again, unless NumPy
# shares the buffer's memory (t.numpy(): the NumPy view stays true)
outside = torch.ones(1 << 16, dtype=torch.float64)
outside_address = outside.data_ptr()
for _ in range(2):
    dist.all_reduce(outside)
    dist.all_reduce(outside, async_op=True).wait()
wide["outside_backward_kept"] = outside.data_ptr() == outside_address and float(outside[-1]) == float(N ** 4)
buffers = {"plain": torch.zeros(1 << 16, dtype=torch.float64), "numpy": torch.zeros(1 << 16, dtype=torch.float64)}
numpy_view, addresses = buffers["numpy"].numpy(), {name: b.data_ptr() for name, b in buffers.items()}
leaf = torch.ones(3, requires_grad=True)


def all_reduce_buffers(grad):
    for buffer in buffers.values():
        buffer.fill_(1.0)
        dist.all_reduce(buffer, async_op=True).wait()
    return grad


leaf.register_hook(all_reduce_buffers)
for _ in range(4):
    (leaf * 2).sum().backward()
wide["in_backward_moved"] = {name: buffer.data_ptr() != addresses[name] for name, buffer in buffers.items()}
wide["numpy_view_true"] = float(numpy_view[-1]) == float(N)

# -- ZeroRedundancyOptimizer -------------------------------------------------------------------
zero = []
for group in (None, GLOO):
    model = Net().double()
    model.unused.requires_grad_(False)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    optimizer = ZeroRedundancyOptimizer([p for p in ddp.parameters() if p.requires_grad], torch.optim.Adam,
                                        process_group=group, lr=0.01)
    for step in range(3):
        g = torch.Generator().manual_seed(7 * RANK + step)
        nn.functional.mse_loss(ddp(torch.randn(4, 6, generator=g, dtype=torch.float64)),
                               torch.zeros(4, 3, dtype=torch.float64)).backward()
        optimizer.step()
        optimizer.zero_grad()
    zero.append([p.detach().clone() for p in model.parameters()])
zero_worst = max(relative(a, b) for a, b in zip(*zero))

# -- every collective on the cases test_backend.py draws with hypothesis, against gloo ---------------
CASES = dist.TCPStore("127.0.0.1", int(os.environ["GRADSYNC_TEST_CASES_PORT"]), is_master=False,
                      timeout=timedelta(seconds=120))  # the test's store: case i under "case/i"
OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
       "avg": dist.ReduceOp.AVG}


SUM_RANGE = {torch.float16: 1 << 9, torch.bfloat16: 1 << 5, torch.float32: 1 << 21, torch.float64: 1 << 50,
             torch.complex64: 1 << 21, torch.complex128: 1 << 50, torch.int32: 1 << 29, torch.int8: 31,
             torch.uint8: 63}
"""Largest magnitude drawn for sums, per dtype: integers that N=4 ranks add exactly in the dtype,
each beyond what the next narrower type holds (a float32 value past float16's 65504 or its
integers, a float64 one past float32's 2^24, ...), so a narrowing cast on any path changes it."""
INT64_LOW = 1 << 41
"""int64 magnitudes are drawn in [2^41, 2^60]: past int32 and past float64's 2^53 integers."""


def values(shape, dtype, salt, op="sum", rank=RANK) -> torch.Tensor:
    """Rank ``rank``'s values for a case. Every reduction of them is exact in ``dtype``, so both
    backends must agree bit for bit whatever order they combine the ranks in: for products, powers
    of two from 2^-3 to 2^3 with random signs (floats; a product of 4 stays within float16's
    normal range) or integers in [-3, 3] ([0, 3] unsigned); otherwise integers bounded by SUM_RANGE
    (int64: random signs and magnitudes in [2^41, 2^60]); complex: such real and imaginary parts."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if op == "product":
        if dtype.is_floating_point:
            signs = torch.randint(0, 2, shape, generator=g) * 2 - 1
            return (signs * torch.pow(2.0, torch.randint(-3, 4, shape, generator=g).double())).to(dtype)
        return torch.randint(0 if dtype == torch.uint8 else -3, 4, shape, generator=g).to(dtype)
    if dtype == torch.int64:
        magnitudes = torch.randint(INT64_LOW, 1 << 60, shape, generator=g, dtype=torch.int64)
        return magnitudes * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
    bound = SUM_RANGE[dtype]
    low = 0 if dtype == torch.uint8 else -bound
    if dtype.is_complex:
        real = torch.randint(low, bound + 1, shape, generator=g, dtype=torch.int64).double()
        imaginary = torch.randint(low, bound + 1, shape, generator=g, dtype=torch.int64).double()
        return torch.complex(real, imaginary).to(dtype)
    return torch.randint(low, bound + 1, shape, generator=g, dtype=torch.int64).to(dtype)


def attempt(fn, copies, group):
    try:
        fn(copies, group)
        return None
    except Exception as exc:  # compared by both()
        return f"{type(exc).__name__}: {exc}"[:300]


def both(fn, *tensors):
    """fn(tensors, group) on gradsync's default group and on gloo, each on its own copies; fn
    appends or replaces outputs in the list it is given. Returns (ours, theirs), or None when both
    refused alike. A call only one backend refuses is a problem, with one exception: gloo refuses
    some collectives of complex tensors (gather), and then the oracle is gloo on the same numbers
    viewed as pairs of reals."""
    ours = [t.clone() for t in tensors]
    theirs = [t.clone() for t in tensors]
    ours_error, theirs_error = attempt(fn, ours, None), attempt(fn, theirs, GLOO)
    if theirs_error and not ours_error and any(t.is_complex() for t in tensors):
        theirs = [torch.view_as_real(t.clone()) if t.is_complex() else t.clone() for t in tensors]
        theirs_error = attempt(fn, theirs, GLOO)
    if ours_error or theirs_error:
        if not (ours_error and theirs_error):
            raise RuntimeError(f"gradsync: {ours_error}; gloo: {theirs_error}")
        return None
    return ours, theirs


def same(result, what: str) -> None:
    if result is not None:
        ours, theirs = result
        real = [torch.view_as_real(t) if t.is_complex() and not u.is_complex() else t for t, u in zip(ours, theirs)]
        check(len(ours) == len(theirs) and all(torch.equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(real, theirs)),
              what)


def run_case(dtype, shape, op, root, several, salt) -> None:
    """Every torch.distributed collective on this case's tensors, on gradsync and on gloo."""
    label = f"{dtype} {shape} op={op} root={root} several={several} salt={salt}"
    reduce_op = OPS[op]
    x = values(shape, dtype, salt, op)
    extra = [values((salt % 7 + i,), dtype, salt + i, op) for i in range(1, several)]  # more inputs
    flat = x.reshape(-1)

    same(both(lambda ts, g: dist.all_reduce(ts[0], op=reduce_op, group=g), x), f"all_reduce {label}")
    same(both(lambda ts, g: dist.all_reduce_coalesced(ts, op=reduce_op, group=g), x, *extra),
         f"all_reduce_coalesced {label}")
    same(both(lambda ts, g: dist.broadcast(ts[0], src=root, group=g), x), f"broadcast {label}")
    result = both(lambda ts, g: dist.reduce(ts[0], dst=root, op=reduce_op, group=g), x)
    if RANK == root:  # only the root's tensor is defined after a reduce
        same(result, f"reduce {label}")

    def all_gather(ts, g):
        ts[1:] = [torch.empty_like(ts[0]) for _ in range(N)]
        dist.all_gather(ts[1:], ts[0], group=g)
    same(both(all_gather, x), f"all_gather {label}")

    def all_gather_coalesced(ts, g):
        inputs = ts[:several]
        ts[several:] = [torch.empty_like(t) for _ in range(N) for t in inputs]
        dist.all_gather_coalesced([ts[several + r * several:several + (r + 1) * several] for r in range(N)], inputs,
                                  group=g)
    same(both(all_gather_coalesced, x, *extra), f"all_gather_coalesced {label}")

    def all_gather_into_tensor(ts, g):
        ts.append(ts[0].new_empty(N * ts[0].numel()))
        dist.all_gather_into_tensor(ts[-1], ts[0], group=g)
    same(both(all_gather_into_tensor, flat), f"all_gather_into_tensor {label}")

    def all_gather_into_tensor_coalesced(ts, g):  # torch's coalescing manager: one call to the backend
        inputs = list(ts)
        ts[:] = inputs + [t.new_empty(N * t.numel()) for t in inputs]
        with dist._coalescing_manager(group=g):
            for inp, out in zip(inputs, ts[len(inputs):]):
                dist.all_gather_into_tensor(out, inp, group=g)
    same(both(all_gather_into_tensor_coalesced, flat, *extra), f"all_gather_into_tensor_coalesced {label}")

    if dtype != torch.bool:  # gloo's reduce-scatter takes no bool
        pieces = [values(shape, dtype, salt + 10 * j, op).reshape(-1) for j in range(N)]

        def reduce_scatter(ts, g):
            ts.append(torch.empty_like(ts[0]))
            dist.reduce_scatter(ts[-1], ts[:N], op=reduce_op, group=g)
        same(both(reduce_scatter, *pieces), f"reduce_scatter {label}")

        def reduce_scatter_tensor(ts, g):
            ts.append(ts[0].new_empty(ts[0].numel() // N))
            dist.reduce_scatter_tensor(ts[-1], ts[0], op=reduce_op, group=g)
        same(both(reduce_scatter_tensor, torch.cat(pieces)), f"reduce_scatter_tensor {label}")

        def reduce_scatter_tensor_coalesced(ts, g):
            inputs = list(ts)
            ts[:] = inputs + [t.new_empty(t.numel() // N) for t in inputs]
            with dist._coalescing_manager(group=g):
                for inp, out in zip(inputs, ts[len(inputs):]):
                    dist.reduce_scatter_tensor(out, inp, op=reduce_op, group=g)
        same(both(reduce_scatter_tensor_coalesced, torch.cat(pieces), *[e.repeat(N) for e in extra]),
             f"reduce_scatter_tensor_coalesced {label}")

    outgoing = [values(shape, dtype, salt + 100 + j, op) for j in range(N)]  # piece j goes to rank j

    def all_to_all(ts, g):
        ts[N:] = [torch.empty_like(t) for t in ts[:N]]
        dist.all_to_all(ts[N:], ts[:N], group=g)
    same(both(all_to_all, *outgoing), f"all_to_all {label}")

    def all_to_all_single(ts, g):
        ts.append(torch.empty_like(ts[0]))
        dist.all_to_all_single(ts[-1], ts[0], group=g)
    same(both(all_to_all_single, torch.stack(outgoing)), f"all_to_all_single {label}")

    def gather(ts, g):
        ts[1:] = [torch.empty_like(ts[0]) for _ in range(N)] if RANK == root else []
        dist.gather(ts[0], ts[1:] if RANK == root else None, dst=root, group=g)
    same(both(gather, x), f"gather {label}")

    def scatter(ts, g):
        ts.append(torch.empty_like(ts[0]))
        dist.scatter(ts[-1], ts[:N] if RANK == root else None, src=root, group=g)
    same(both(scatter, *outgoing), f"scatter {label}")

    def ring(ts, g):  # send to the right, receive from the left
        ts.append(torch.empty_like(ts[0]))
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, ts[0], (RANK + 1) % N, group=g),
                                            dist.P2POp(dist.irecv, ts[-1], (RANK - 1) % N, group=g)]):
            work.wait()
    same(both(ring, x), f"send/recv around the ring {label}")


collective_cases = 0
while True:  # until the test says stop; every rank reads the same case, rank 0 answers for all
    case = json.loads(CASES.get(f"case/{collective_cases}"))
    if case.get("stop"):
        break
    before = len(problems)
    try:
        run_case(getattr(torch, case["dtype"]), tuple(case["shape"]), case["op"], case["root"], case["several"],
                 case["salt"])
    except Exception as exc:  # reported to the test as the case's failure; the next case goes on
        problems.append(f"case {case}: {type(exc).__name__}: {exc}")
    found = [None] * N
    dist.all_gather_object(found, problems[before:], group=GLOO)
    del problems[before:]  # the test reports them per case (and shrinks the case)
    if RANK == 0:
        CASES.set(f"result/{collective_cases}", json.dumps([p for rank_found in found for p in rank_found]))
    collective_cases += 1

# all_to_all_single with uneven splits: rank r sends r+1+j rows to rank j
send_rows = [RANK + 1 + j for j in range(N)]
recv_rows = [j + 1 + RANK for j in range(N)]
source = values((sum(send_rows), 2), torch.float32, 77)
results = [torch.empty(sum(recv_rows), 2) for _ in range(2)]
dist.all_to_all_single(results[0], source, recv_rows, send_rows)
dist.all_to_all_single(results[1], source, recv_rows, send_rows, group=GLOO)
check(torch.equal(*results), "all_to_all_single with uneven splits")
dist.barrier()

# -- subgroups and a 2 x 2 mesh ------------------------------------------------------------------
even_ours, even_gloo = dist.new_group([0, 2]), dist.new_group([0, 2], backend="gloo")
t = values((7,), torch.int64, 5)
if RANK in (0, 2):
    a, b = t.clone(), t.clone()
    dist.all_reduce(a, group=even_ours)
    dist.all_reduce(b, group=even_gloo)
    check(torch.equal(a, b), "subgroup [0, 2] all_reduce")
else:
    outside = t.clone()
    dist.all_reduce(outside, group=even_ours)  # a rank outside the group: torch skips the call
    check(torch.equal(outside, t), "a rank outside a subgroup is left alone")
pair, _ = dist.new_subgroups(group_size=2)  # [0, 1] and [2, 3], each a gradsync group
pair_members = dist.get_process_group_ranks(pair)
a = values((6,), torch.int32, 11)
dist.all_reduce(a, op=dist.ReduceOp.MAX, group=pair)
check(torch.equal(a, torch.maximum(*[values((6,), torch.int32, 11, rank=r) for r in pair_members])),
      f"new_subgroups: MAX over {pair_members}")
coalesced = [values((3,), torch.float64, 21), values((2, 2), torch.float64, 22), values((4,), torch.float64, 23)]
ours, theirs = both(lambda ts, g: dist.all_reduce_coalesced(ts, group=g), *coalesced)
check(all(torch.equal(x, y) for x, y in zip(ours, theirs)), "all_reduce_coalesced of three shapes")
mesh = dist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
for dim in ("replicate", "shard"):
    group = mesh.get_group(dim)
    members = dist.get_process_group_ranks(group)
    a = values((5,), torch.float64, 9)
    dist.all_reduce(a, group=group)
    expected = sum(values((5,), torch.float64, 9, rank=r) for r in members)
    check(torch.equal(a, expected), f"DeviceMesh dim {dim} all_reduce over {members}")

# -- point-to-point and objects --------------------------------------------------------------------
right, left = (RANK + 1) % N, (RANK - 1) % N
outgoing, incoming = torch.full((3,), float(RANK)), torch.empty(3)
ops = [dist.P2POp(dist.isend, outgoing, right, tag=3), dist.P2POp(dist.irecv, incoming, left, tag=3)]
for work in dist.batch_isend_irecv(ops):
    work.wait()
check(torch.equal(incoming, torch.full((3,), float(left))), "batch_isend_irecv around the ring")
if RANK == 0:
    senders = set()
    for _ in range(N - 1):
        buf = torch.empty(2)
        senders.add(dist.recv(buf, tag=9))  # from any rank
        check(buf[0].item() == buf[1].item() and buf[0].item() in range(1, N), "recv from any rank: payload")
    check(senders == set(range(1, N)), f"recv from any rank names the senders, got {senders}")
else:
    dist.send(torch.full((2,), float(RANK)), 0, tag=9)
objects = [None] * N
dist.all_gather_object(objects, {"rank": RANK, "name": f"r{RANK}"})
check(objects == [{"rank": r, "name": f"r{r}"} for r in range(N)], "all_gather_object")
box = [{"from": RANK}, RANK * 2]
dist.broadcast_object_list(box, src=N - 1)
check(box == [{"from": N - 1}, (N - 1) * 2], "broadcast_object_list")
collected = [None] * N if RANK == 0 else None
dist.gather_object(("x", RANK), collected, dst=0)
check(RANK != 0 or collected == [("x", r) for r in range(N)], "gather_object")
received = [None]
dist.scatter_object_list(received, [f"for {r}" for r in range(N)] if RANK == 1 else None, src=1)
check(received == [f"for {RANK}"], "scatter_object_list")

# -- traffic: the meter sees the ring's 2(N-1)/N x M --------------------------------------------
os.environ["GRADSYNC_ALGORITHM"] = "ring"
payload = torch.ones(4096 * N)
gs.traffic_reset()
dist.all_reduce(payload)
traffic = gs.traffic()
check(traffic["bytes_sent"] == ring_bytes_sent(payload.numel(), N, RANK, 4),
      f"ring traffic {traffic['bytes_sent']} != {ring_bytes_sent(payload.numel(), N, RANK, 4)}")
del os.environ["GRADSYNC_ALGORITHM"]
gs.traffic_reset()
dist.reduce(payload, dst=1)  # a binomial tree onto rank 1: every other rank sends M once
expected = 0 if RANK == 1 else payload.numel() * 4
check(gs.traffic()["bytes_sent"] == expected, f"reduce traffic {gs.traffic()['bytes_sent']} != {expected}")

# -- a mismatched collective is an error that names both ranks ----------------------------------
mismatch = None
try:
    dist.all_reduce(torch.ones(10 + RANK))  # every rank a different size
except Exception as exc:  # the message is what the test checks
    mismatch = str(exc)

# -- CUDA work on the plain "gradsync" string stays with gradsync (staged through host memory) -----
cuda_to_nccl = dist.distributed_c10d._get_default_group().cuda_to_nccl()

try:
    dist.all_reduce(torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (4,)))
    sparse_refusal = None
except RuntimeError as exc:
    sparse_refusal = str(exc)

# -- a peer that never calls: every rank waiting for it raises within the group's timeout, naming it --
SHORT = 3.0
short = dist.new_group(backend="gradsync", timeout=timedelta(seconds=SHORT))
dist.all_reduce(torch.ones(3), group=short)  # the group works
never_called = None
if RANK != N - 1:  # the last rank never calls this all-reduce; it waits for the others on gloo
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(3), group=short)
        never_called = {"error": None}
    except Exception as exc:  # the message is what the test checks
        never_called = {"error": str(exc), "after": time.monotonic() - started}
dist.barrier(group=GLOO)

result = {"rank": RANK, "problems": problems, "never_called": never_called, "short_timeout": SHORT, "cuda_to_nccl": cuda_to_nccl, "sparse_refusal": sparse_refusal, "ddp": ddp_worst, "wide": wide, "zero": zero_worst, "cases": collective_cases,
          "mismatch": mismatch, "backend": dist.get_backend()}
os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(result) + "\n").encode())
dist.destroy_process_group()
