"""An unchanged torch.distributed program on the "gradsync" backend, run by test_backend.py.

The default group is gradsync's (init_process_group("gradsync")); the same script also makes a
gloo group over the same ranks, and every check runs the same thing on both and compares: torch's
own DDP (no_sync, find_unused_parameters, fp16_compress_hook, static_graph), ZeroRedundancyOptimizer,
every collective torch.distributed offers on shapes, dtypes, ops and roots that the test draws
with hypothesis (it serves them one at a time through a TCPStore of its own, the same case to
every rank, and reads back what differed from gloo), subgroups and a 2 x 2 DeviceMesh, point-to-point and
object collectives. It also checks the traffic meter against the ring formula and that a
mismatched collective is an error naming both ranks. Each rank prints one line ``RESULT {json}``.
"""

import json
import os
import sys
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


WIDE = {torch.float64: 2 ** 40, torch.float32: 2 ** 14, torch.float16: 2 ** 5, torch.bfloat16: 2 ** 3,
        torch.int64: 2 ** 33, torch.int32: 2 ** 17, torch.uint8: 4, torch.int8: 4}
"""Rank r's values are (r+1) x WIDE + 0..4 (as tests/cases.py's WIDE_BASE): every order of sums over 4
ranks is exact, and the values need more bits than the next narrower dtype has, so a narrowing cast
anywhere on the path (float64 -> float32, int64 -> int32, float32 -> float16) changes them."""


def values(shape, dtype, salt, rank=RANK) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return (torch.randint(0, 5, shape, generator=g) + (rank + 1) * WIDE[dtype]).to(dtype)


def both(fn, *tensors):
    """fn(tensors, group) on gradsync's default group and on gloo, each on its own copies."""
    ours = [t.clone() for t in tensors]
    theirs = [t.clone() for t in tensors]
    fn(ours, None)
    fn(theirs, GLOO)
    return ours, theirs


def run_case(dtype, shape, op, root, salt) -> None:
    label = f"{dtype} {shape} op={op} root={root} salt={salt}"
    x = values(shape, dtype, salt)
    ours, theirs = both(lambda ts, g: dist.all_reduce(ts[0], op=OPS[op], group=g), x)
    check(torch.equal(ours[0], theirs[0]), f"all_reduce {label}")
    ours, theirs = both(lambda ts, g: dist.broadcast(ts[0], src=root, group=g), x)
    check(torch.equal(ours[0], theirs[0]), f"broadcast {label}")
    if op in ("sum", "max", "min", "product", "band", "bor", "bxor"):
        ours, theirs = both(lambda ts, g: dist.reduce(ts[0], dst=root, op=OPS[op], group=g), x)
        check(RANK != root or torch.equal(ours[0], theirs[0]), f"reduce {label}")
    outs = [[torch.empty_like(x) for _ in range(N)] for _ in range(2)]
    dist.all_gather(outs[0], x)
    dist.all_gather(outs[1], x, group=GLOO)
    check(all(torch.equal(a, b) for a, b in zip(*outs)), f"all_gather {label}")
    flat = x.reshape(-1)
    gathered = [torch.empty(N * flat.numel(), dtype=dtype) for _ in range(2)]
    dist.all_gather_into_tensor(gathered[0], flat)
    dist.all_gather_into_tensor(gathered[1], flat, group=GLOO)
    check(torch.equal(*gathered), f"all_gather_into_tensor {label}")
    if dtype != torch.bool and op in ("sum", "max", "min"):
        piece = max(3, flat.numel())   # a large case's input is large too: the single-copy reduce-scatter
        big = values((N * piece,), dtype, salt + 500)
        pieces = [torch.empty(piece, dtype=dtype) for _ in range(2)]
        dist.reduce_scatter_tensor(pieces[0], big, op=OPS[op])
        dist.reduce_scatter_tensor(pieces[1], big, op=OPS[op], group=GLOO)
        check(torch.equal(*pieces), f"reduce_scatter_tensor {label}")
    got = [[torch.empty_like(x) for _ in range(N)] if RANK == root else None for _ in range(2)]
    dist.gather(x, got[0], dst=root)
    dist.gather(x, got[1], dst=root, group=GLOO)
    check(RANK != root or all(torch.equal(a, b) for a, b in zip(*got)), f"gather {label}")
    pieces = [values(shape, dtype, salt + 10 * r) for r in range(N)]
    into = [torch.empty_like(x) for _ in range(2)]
    dist.scatter(into[0], pieces if RANK == root else None, src=root)
    dist.scatter(into[1], pieces if RANK == root else None, src=root, group=GLOO)
    check(torch.equal(*into), f"scatter {label}")


collective_cases = 0
while True:  # until the test says stop; every rank reads the same case, rank 0 answers for all
    case = json.loads(CASES.get(f"case/{collective_cases}"))
    if case.get("stop"):
        break
    before = len(problems)
    try:
        run_case(getattr(torch, case["dtype"]), tuple(case["shape"]), case["op"], case["root"], case["salt"])
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

# -- CUDA work on the plain "gradsync" string: refused with the string that would route it --------
try:
    dist.distributed_c10d._get_default_group()._nccl_group("allreduce")  # what a CUDA tensor reaches
    cuda_refusal = None
except RuntimeError as exc:
    cuda_refusal = str(exc)

try:
    dist.all_reduce(torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (4,)))
    sparse_refusal = None
except RuntimeError as exc:
    sparse_refusal = str(exc)

result = {"rank": RANK, "problems": problems, "cuda_refusal": cuda_refusal, "sparse_refusal": sparse_refusal, "ddp": ddp_worst, "zero": zero_worst, "cases": collective_cases,
          "mismatch": mismatch, "backend": dist.get_backend()}
os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(result) + "\n").encode())
dist.destroy_process_group()
