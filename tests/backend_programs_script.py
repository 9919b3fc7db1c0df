"""Modern torch programs on the "gradsync" backend, each also run on gloo (the oracle), 2 ranks.

Run by tests/test_backend_programs.py under torchrun. The default group is gradsync's; a gloo group
over the same ranks runs the same work. Every rank saves what it measured to OUT/programs_rank<r>.pt
(torch.save: no collective of either backend carries the results the test compares):

- torch.compile over torch DDP, both orders (compile(DDP(m)) and DDP(compile(m))), for an MLP and a
  nanoGPT-style transformer (token + position embeddings, causal self-attention, GELU MLP, pre-norm
  blocks), float64, 3 SGD steps: losses, parameters, and the graphs the compiler was handed (the
  aot_eager backend behind a counting one). DDPOptimizer splits the forward graph at DDP's bucket
  boundaries: with 1 MiB buckets and 1.5 MiB blocks the transformer makes several graphs, and one
  graph with torch._dynamo.config.optimize_ddp=False (recorded too).
- compiled autograd with torch's python_reducer (optimize_ddp="python_reducer"): the gradients are
  all-reduced by functional collectives inside the compiled backward; gradsync's traffic meter says
  whether the bytes went through gradsync.
- torch's DDP communication hooks: allreduce_hook, fp16_compress_hook, bf16_compress_hook,
  PowerSGD (one bucket: on gloo several buckets deadlock, see below), batched PowerSGD,
  post-localSGD, and a hook of our own that chains three collectives through then(), waits inside
  callbacks for a collective issued inside them and for one issued before them (on its Work), and
  hands DDP a future completed from another thread. PowerSGD and the chained hook with several
  buckets run on gradsync only: gloo hangs there (its two worker threads both block in callbacks
  waiting for collectives queued behind them); every rank's result is saved so the test checks
  that the replicas agree.
- the watchdog, on a gradsync group with a 3 s timeout: rank 1 never calls an all-reduce rank 0 is
  waiting in; then a callback that waits on the torch Future of a collective queued behind it.
"""

import faulthandler
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

import gradsync as gs
from gradsync.group.launch import _die_with_parent

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test dumps every thread's stack if it must kill
_die_with_parent()
torch.set_num_threads(1)
dist.init_process_group("gradsync", timeout=timedelta(seconds=60))
RANK, N = dist.get_rank(), dist.get_world_size()
GLOO = dist.new_group(backend="gloo")
OUT = Path(sys.argv[1])
(OUT / f"pid_rank{RANK}").write_text(str(os.getpid()))
results: dict = {}
START = time.monotonic()


def progress(what: str) -> None:
    print(f"rank {RANK}: {what} done at {time.monotonic() - START:.1f} s", file=sys.stderr, flush=True)


# -- models --------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 512), nn.Linear(512, 512), nn.Linear(512, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        length = x.shape[1]
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool), 1)
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    VOCAB, CONTEXT = 64, 16

    def __init__(self, width: int = 128, layers: int = 2):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(self.VOCAB, width), nn.Embedding(self.CONTEXT, width)
        self.blocks = nn.Sequential(*[Block(width, 4) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, self.VOCAB)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        return self.head(self.norm(self.blocks(x)))


def loss_of(model, kind: str, step: int):
    g = torch.Generator().manual_seed(100 * RANK + step)
    if kind == "gpt":
        idx = torch.randint(0, TinyGPT.VOCAB, (4, TinyGPT.CONTEXT), generator=g)
        logits = model(idx)
        return nn.functional.cross_entropy(logits.reshape(-1, TinyGPT.VOCAB), torch.roll(idx, -1, 1).reshape(-1))
    return model(torch.randn(8, 16, generator=g, dtype=torch.float64)).pow(2).mean()


def flat_params(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# -- torch.compile ---------------------------------------------------------------------------------
GRAPHS: list[int] = []


def counting_aot_eager(graph_module, example_inputs):
    """aot_eager (AOTAutograd, no code generation: the numbers of eager kernels, compile in seconds),
    counting the graphs dynamo hands over."""
    from torch._dynamo.backends.debugging import aot_eager

    GRAPHS.append(len(graph_module.graph.nodes))
    return aot_eager(graph_module, example_inputs)


def compiled_run(group, kind: str, order: str, steps: int = 3) -> dict:
    torch._dynamo.reset()
    GRAPHS.clear()
    torch.manual_seed(0)
    model = (TinyGPT() if kind == "gpt" else MLP()).double()
    if order == "compile_then_wrap":
        ddp = nn.parallel.DistributedDataParallel(torch.compile(model, backend=counting_aot_eager),
                                                  process_group=group, bucket_cap_mb=1)
    else:
        ddp = torch.compile(nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=1),
                            backend=counting_aot_eager)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        loss = loss_of(ddp, kind, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": torch.tensor(losses), "params": flat_params(model), "graphs": list(GRAPHS)}


for kind in ("mlp", "gpt"):
    for order in ("wrap_then_compile", "compile_then_wrap"):
        results[f"compile/{kind}/{order}"] = (compiled_run(None, kind, order), compiled_run(GLOO, kind, order))
        progress(f"compile {kind} {order}")
torch._dynamo.config.optimize_ddp = False
results["compile/gpt/no_ddp_optimizer_graphs"] = compiled_run(None, "gpt", "wrap_then_compile", steps=1)["graphs"]
torch._dynamo.config.optimize_ddp = True


def compiled_autograd_run(group) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP().double()
    ddp = torch.compile(nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=1),
                        backend="aot_eager")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    losses, sent = [], gs.traffic()["bytes_sent"]
    for step in range(3):
        loss = loss_of(ddp, "mlp", step)
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": torch.tensor(losses), "params": flat_params(model),
            "gradsync_bytes_sent": gs.traffic()["bytes_sent"] - sent}


torch._dynamo.config.optimize_ddp = "python_reducer"
results["compiled_autograd"] = (compiled_autograd_run(None), compiled_autograd_run(GLOO))
progress("compiled autograd")
torch._dynamo.config.optimize_ddp = True
torch._dynamo.reset()


# -- communication hooks ---------------------------------------------------------------------------
def chained_hook(group, bucket):
    """Three collectives chained through then(): the sum (issued here), the largest |gradient|
    (issued here, waited for on its Work inside the first callback, where it is still queued behind
    the callback's own operation on gradsync), and a broadcast issued and waited for inside the
    second callback. DDP gets a future completed from another thread that waited for the chain."""
    buffer = bucket.buffer()
    largest = buffer.detach().abs().max().reshape(1)  # before the sum: it reduces the buffer in place
    summed = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    largest_work = dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def average(fut):
        largest_work.wait()
        return fut.value()[0].div_(dist.get_world_size(group))

    def scale_from_rank_0(fut):
        scale = torch.tensor([0.5 if RANK == 0 else 7.0], dtype=buffer.dtype)
        dist.broadcast(scale, src=0, group=group, async_op=True).wait()
        return fut.value().mul_(scale).add_(largest * 1e-3)

    chain = summed.then(average).then(scale_from_rank_0)
    handed_to_ddp = torch.futures.Future()

    def wait_elsewhere():
        try:
            handed_to_ddp.set_result(chain.wait())
        except Exception as exc:  # DDP raises it at the end of backward
            handed_to_ddp.set_exception(exc)

    threading.Thread(target=wait_elsewhere, daemon=True).start()
    return handed_to_ddp


def hooked_run(group, hook: str, bucket_cap_mb: float = 25, steps: int = 6):
    torch.manual_seed(0)
    model = MLP().double()
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_cap_mb)
    if hook in ("allreduce", "fp16", "bf16"):
        ddp.register_comm_hook(group, {"allreduce": default_hooks.allreduce_hook,
                                       "fp16": default_hooks.fp16_compress_hook,
                                       "bf16": default_hooks.bf16_compress_hook}[hook])
    elif hook in ("powersgd", "batched_powersgd"):
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                            min_compression_rate=0.5)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook if hook == "powersgd"
                               else powerSGD_hook.batched_powerSGD_hook)
    elif hook == "post_localsgd":
        subgroup, _ = dist.new_subgroups(group_size=1, backend="gloo" if group is GLOO else None)
        state = post_localSGD_hook.PostLocalSGDState(process_group=group, subgroup=subgroup, start_localSGD_iter=3)
        ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
    elif hook == "chained":
        ddp.register_comm_hook(group, chained_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(steps):
        loss_of(ddp, "mlp", step).backward()
        optimizer.step()
        optimizer.zero_grad()
    return flat_params(model)


def outcome(run, *args):
    """The parameters, or the error's type and message (torch's batched PowerSGD fails alike)."""
    try:
        return run(*args)
    except Exception as exc:  # compared with gloo's outcome by the test
        return f"{type(exc).__name__}: {exc}"


for hook in ("allreduce", "fp16", "bf16", "powersgd", "batched_powersgd", "post_localsgd", "chained"):
    results[f"hook/{hook}"] = (outcome(hooked_run, None, hook), outcome(hooked_run, GLOO, hook))
    progress(f"hook {hook}")
    if hook in ("allreduce", "fp16"):
        results[f"hook/{hook}/several_buckets"] = (outcome(hooked_run, None, hook, 0.004),
                                                   outcome(hooked_run, GLOO, hook, 0.004))
for hook in ("powersgd", "chained"):  # hooks that wait inside callbacks: with several buckets gloo hangs
    results[f"hook/{hook}/several_buckets/ours_only"] = outcome(hooked_run, None, hook, 0.004)
progress("hooks")


# -- the watchdog ----------------------------------------------------------------------------------
SHORT = 3.0
short = dist.new_group(backend="gradsync", timeout=timedelta(seconds=SHORT))
dist.all_reduce(torch.ones(4), group=short)  # the group works
started = time.monotonic()
if RANK == 0:
    try:
        dist.all_reduce(torch.ones(4), group=short)  # rank 1 never calls this one
        results["watchdog/peer_never_calls"] = ("no error", 0.0)
    except Exception as exc:  # the message is what the test checks
        results["watchdog/peer_never_calls"] = (str(exc), time.monotonic() - started)
dist.barrier(group=GLOO)  # rank 1 waits here on gloo, not calling the short group

stuck = dist.new_group(backend="gradsync", timeout=timedelta(seconds=SHORT))
dist.all_reduce(torch.ones(1 << 24), group=stuck, async_op=True)  # 64 MB: busy while the callback is attached
first = dist.all_reduce(torch.ones(4), group=stuck, async_op=True)
second = dist.all_reduce(torch.ones(4), group=stuck, async_op=True).get_future()
callback_started = []


def wait_for_the_queued_one(fut):
    callback_started.append(time.monotonic())
    return second.wait()  # torch's own wait on a queued operation: it waits for itself


chained = first.get_future().then(wait_for_the_queued_one)
try:
    chained.wait()
    results["watchdog/callback_waits_for_queued"] = ("no error", 0.0)
except Exception as exc:  # the message is what the test checks
    results["watchdog/callback_waits_for_queued"] = (str(exc), time.monotonic() - callback_started[0])
try:
    dist.all_reduce(torch.ones(4), group=stuck)
    results["watchdog/later_call"] = "no error"
except Exception as exc:  # the message is what the test checks
    results["watchdog/later_call"] = str(exc)

torch.save(results, OUT / f"programs_rank{RANK}.pt")
dist.barrier(group=GLOO)
dist.destroy_process_group()
