"""gradsync bench ddp: training step time, gradsync DDP beside torch DDP (gloo), in one run.

Each rank builds the same model twice (same seed), one wrapped by torch's DistributedDataParallel
and one by ours per bucket size, and times full steps (forward, backward with the bucket
reductions, optimizer step), each step preceded by a barrier; a step's time is the slowest rank's.
The implementations are interleaved step by step so machine noise hits them alike, in an order
that rotates every step (each follows each other equally often, where a fixed order gave each the
same predecessor, whatever that one leaves behind in caches and threads); the table shows medians.
One intra-op thread per rank.

    ratio       = ours / torch DDP step time (below 1.0: ours is faster)
    no communication = the bare model's step on every rank at once (gradients never averaged):
                  the floor, so step - floor is what communication costs each implementation
    + one gradient copy = the floor, and each gradient copied once into a flat buffer as backward
                  produces it (every rank at once): the least memory traffic any average adds,
                  since each rank writes its M bytes of averaged gradient and the ranks
                  together read all N x M bytes of gradients, M per rank: a copy's traffic
                  (the in-place all-reduce moves that). Where no core is free for a
                  communication thread (as many ranks as cores) nothing hides that traffic, and
                  no implementation's step can go below this row's
    vs floor    = step / no communication
    overlap     = share of our bucket communication that ran before backward ended (trace.py)
    bytes/step  = payload bytes this rank sent per step, measured by the TrafficMeter
    transport   = what carried our buckets (shm or tcp, GRADSYNC_TRANSPORT's choice); torch DDP: gloo

Options (rows added to the same interleaved run):
    torch_hook  ours with torch's own allreduce_hook registered (register_comm_hook): the buckets go
                through torch.distributed's gloo instead of gradsync's collectives, by the same hook
                mechanism as the built-in average, so its overlap shows what that mechanism keeps
    compiled    torch.compile (inductor) over torch DDP, over ours (compile(DDP(m))) and under ours
                (DDP(compile(m))), each at the first bucket cap; compiled before the warm-up steps
    device      "cuda": every rank's model and batch on cuda:0 (ranks sharing the GPU, so CUDA tensors go
                through host memory: comm/host_staging.py), and torch's DDP on the "gradsync" backend
                beside it on gloo (the peer that runs there); a step ends when the GPU is done

The benchmark MLP is 1024 -> 2048 -> 2048 -> 2048 -> 10 (10.5M parameters), batch 64 per rank. A user's
model (``--model module:function --data module:function``, as gradsync train takes them) runs on its first
``batch`` training samples with its loss rule. ``loss`` is each implementation's loss on its batch after the
run's steps: equal across implementations up to float reassociation (the same seed, batch and SGD).
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from gradsync.bench.collectives import carrier
from gradsync.train.models import MLP, CharLM, DigitsCNN

BENCH_MODELS = ("mlp", "cnn", "charlm")
NO_COMM = "no communication"
"""The same step on the bare model, each rank alone: the floor any implementation's step sits on."""
ONE_COPY = "+ one gradient copy"
"""The floor plus one copy of every gradient: the least an average adds when no core is free."""
ON_GRADSYNC = "torch DDP on gradsync"
"""torch's DDP on a process group of the "gradsync" backend (with --device cuda)."""
TORCH_HOOK = " + torch allreduce_hook"


def model_and_batch(name: str, batch: int):
    """A built-in benchmark model and a batch of ``batch`` random samples for it (cross-entropy, step_loss)."""
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        return MLP(in_features=1024, hidden=2048, layers=3), torch.randn(batch, 1024, generator=g), torch.randint(0, 10, (batch,), generator=g)
    if name == "cnn":
        return DigitsCNN(), torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)
    if name == "charlm":
        tokens = torch.randint(0, 256, (batch, 65), generator=g)
        return CharLM(), tokens[:, :-1], tokens[:, 1:]
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(BENCH_MODELS)}")


def task_model_and_batch(model: str, data: str, loss: str | None, model_args: dict, data_args: dict, batch: int):
    """A user's task (train/task.py: --model module:function --data module:function): its model, its first
    ``batch`` training samples collated, and how that batch becomes a loss (the task's loss rule)."""
    from gradsync.train.task import Task

    task = Task(model, data, model_args, data_args, loss=loss)
    built = task.build_data()
    samples = task.batch(built, built.train, list(range(min(batch, len(built.train)))))
    return task.build_model(), samples, lambda m: task.loss(m, samples)[0]


def step_loss(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def timed_step(model, optimizer, x, y, set_to_none: bool = True, loss_of=None) -> float:
    """One training step after a barrier; seconds of the slowest rank. ``loss_of(model)``: the loss, where it is
    not step_loss on (x, y) (a user's task)."""
    dist.barrier()
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=set_to_none)
    (loss_of(model) if loss_of is not None else step_loss(model(x), y)).backward()
    optimizer.step()
    device = next(model.parameters()).device
    if device.type == "cuda":   # the step is over when the GPU has run it
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _copy_grad(param: torch.Tensor, target: torch.Tensor) -> None:
    target.copy_(param.grad)


def _copy_each_gradient(model: nn.Module) -> torch.Tensor:
    """Copy each gradient into a flat buffer of the model's size (returned) once backward has
    accumulated it."""
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        target = flat.narrow(0, offset, p.numel()).view_as(p)
        p.register_post_accumulate_grad_hook(partial(_copy_grad, target=target))
        offset += p.numel()
    return flat


def _labels(bucket_mbs: list[float], torch_hook: bool, compiled: bool, cuda: bool = False) -> list[tuple[str, float]]:
    """(row label, bucket cap in MiB) of every implementation the run times."""
    labels = [("torch DDP", 25.0)] + [(f"gradsync {cap:g} MiB", cap) for cap in bucket_mbs]
    if cuda:
        labels.append((ON_GRADSYNC, 25.0))
    if torch_hook:
        labels += [(f"gradsync {cap:g} MiB{TORCH_HOOK}", cap) for cap in bucket_mbs]
    if compiled:
        labels += [("torch DDP compiled", 25.0), (f"gradsync {bucket_mbs[0]:g} MiB, compile(DDP(m))", bucket_mbs[0]),
                   (f"gradsync {bucket_mbs[0]:g} MiB, DDP(compile(m))", bucket_mbs[0])]
    return labels + [(NO_COMM, 0.0), (ONE_COPY, 0.0)]


def _wrap(label: str, model: nn.Module, cap: float):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    if label == ON_GRADSYNC:
        return TorchDDP(model, bucket_cap_mb=cap, process_group=dist.new_group(backend="gradsync"))
    if label.startswith("torch DDP"):
        wrapped = TorchDDP(model, bucket_cap_mb=cap)
        return torch.compile(wrapped) if label.endswith("compiled") else wrapped
    if label in (NO_COMM, ONE_COPY):
        if label == ONE_COPY:
            _copy_each_gradient(model)
        return model
    if label.endswith("DDP(compile(m))"):
        return gs.DistributedDataParallel(torch.compile(model), bucket_cap_mb=cap)
    wrapped = gs.DistributedDataParallel(model, bucket_cap_mb=cap)
    if label.endswith(TORCH_HOOK):
        wrapped.register_comm_hook(None, allreduce_hook)
    return torch.compile(wrapped) if label.endswith("compile(DDP(m))") else wrapped


def _ours(wrapped):
    """gradsync's wrapper inside ``wrapped`` (a compiled module keeps it as _orig_mod), else None."""
    inner = getattr(wrapped, "_orig_mod", wrapped)
    return inner if isinstance(inner, gs.DistributedDataParallel) else None


def _bench_rank(model_name: str, batch: int, bucket_mbs: list[float], steps: int, warmup: int,
                torch_hook: bool = False, compiled: bool = False, device: str = "cpu",
                task: tuple | None = None) -> list[dict]:
    torch.set_num_threads(1)
    w = gs.world()
    where = torch.device("cuda:0" if device == "cuda" else device)
    runners = {}
    for label, cap in _labels(bucket_mbs, torch_hook, compiled, where.type == "cuda"):
        torch.manual_seed(0)
        if task is not None:   # a user's model: its own batch and loss rule (x carries the batch, y is unused)
            model, x, loss_of = task_model_and_batch(model_name, *task, batch)
            model, y = model.to(where), None
        else:
            model, x, y = model_and_batch(model_name, batch)
            model, x, y, loss_of = model.to(where), x.to(where), y.to(where), None
        runners[label] = (_wrap(label, model, cap), torch.optim.SGD(model.parameters(), lr=1e-3), x, y, loss_of)

    def step(label: str) -> float:
        wrapped, opt, x, y, loss_of = runners[label]
        return timed_step(wrapped, opt, x, y, set_to_none=False,
                          loss_of=loss_of)

    for label in runners:
        for _ in range(warmup):
            step(label)
    times = {label: [] for label in runners}
    overlaps = {label: [] for label in runners}
    bytes_per_step = {}
    labels = list(runners)
    for index in range(steps):
        turn = index % len(labels)
        for label in labels[turn:] + labels[:turn]:
            gs.traffic_reset()
            times[label].append(step(label))
            wrapper = _ours(runners[label][0])
            if wrapper is not None:
                if not label.endswith(TORCH_HOOK):   # torch's hook sends over gloo, which the meter does not see
                    bytes_per_step[label] = gs.traffic()["bytes_sent"]
                overlaps[label].append(wrapper.last_overlap or 0.0)
    n_params = sum(p.numel() for p in runners[NO_COMM][0].parameters())
    ours = carrier()
    rows = []
    for label in runners:
        wrapped, _, x, y, loss_of = runners[label]
        with torch.no_grad():   # after the same steps on the same batch: equal up to float reassociation
            loss = float(loss_of(wrapped) if loss_of is not None else step_loss(wrapped(x), y))
        rows.append({"workers": w.world_size, "model": model_name, "params": n_params, "impl": label, "loss": loss,
                     "step_s": statistics.median(times[label]), "times_s": times[label],
                     "buckets": len(_ours(wrapped).buckets) if _ours(wrapped) is not None else None,
                     "overlap": statistics.median(overlaps[label]) if overlaps[label] else None,
                     "bytes_per_step": bytes_per_step.get(label),
                     "device": where.type,
                     "transport": ("gloo" if label.startswith("torch DDP") and label != ON_GRADSYNC
                                   or label.endswith(TORCH_HOOK)
                                   else None if label in (NO_COMM, ONE_COPY) else ours)})
    return rows


def run(workers: int, model: str, batch: int = 64, bucket_mbs: list[float] | None = None,
        steps: int = 15, warmup: int = 3, torch_hook: bool = False, compiled: bool = False,
        device: str = "cpu", data: str | None = None, loss: str | None = None, model_args: dict | None = None,
        data_args: dict | None = None) -> list[dict]:
    """``model``: a built-in benchmark model, or a user's module:function with ``data`` (and ``loss``: --loss's
    conventions, train/losses.py) naming its data, as gradsync train takes them."""
    from gradsync.train.factory import is_spec

    task = None
    if is_spec(model):
        if data is None:
            raise ValueError(f"--model {model} needs --data module:function (the batch is its first training samples)")
        from gradsync.train.task import Task

        Task(model, data, model_args, data_args, loss=loss)   # a bad name is one line, before any rank starts
        task = (data, loss, model_args or {}, data_args or {})
    elif model not in BENCH_MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(BENCH_MODELS)}, or module:function")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: choose cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: this machine has no CUDA GPU that torch can see (torch.cuda.is_available() "
                           "is False); run without --device, or on a machine with a GPU")
    rows = gs.spawn(_bench_rank, nprocs=workers,
                    args=(model, batch, bucket_mbs or [1.0, 25.0], steps, warmup, torch_hook, compiled, device, task))[0]
    baseline = next(r["step_s"] for r in rows if r["impl"] == "torch DDP")
    floor = next(r["step_s"] for r in rows if r["impl"] == NO_COMM)
    for r in rows:
        r["ratio_vs_torch"] = r["step_s"] / baseline
        r["ratio_vs_floor"] = r["step_s"] / floor
    return rows
