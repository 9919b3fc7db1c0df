"""Hugging Face Accelerate, unchanged, on the "gradsync" backend; run by test_backend_clients.py.

    torchrun --standalone --nproc-per-node 2 tests/clients_accelerate.py OUT_DIR

The same float64 model is trained twice in this one launch, on "gloo" and then on "gradsync":
accelerator.prepare() wraps it in torch's DDP and shards the DataLoader, accelerator.accumulate()
skips the gradient all-reduce on every other batch (no_sync), and accelerator.gather() collects
every rank's loss. Between the two runs the script resets Accelerate's state and destroys the
default group, but keeps the first run's objects alive to the end (see KEEP_ALIVE). Each rank
saves, per backend, its own losses, the gathered losses and its final parameters to
OUT_DIR/accelerate_rank{r}.pt (torch.save, no collective involved).

The backend goes through Accelerate's init kwargs, InitProcessGroupKwargs(backend=...). Accelerate
1.15 refuses any backend but gloo and mpi for CPU processes ("Your assigned backend
gradsync is not available, please use gloo", accelerate/state.py, PartialState._prepare_backend);
on exactly that refusal the script initialises the default group itself with
init_process_group(backend) and Accelerate adopts the group it finds. The route taken is saved.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import InitProcessGroupKwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)
OUT = Path(sys.argv[1])
LR, ACCUMULATION = 0.05, 2
REFUSAL = "Your assigned backend {} is not available"
KEEP_ALIVE: list = []
"""Hack around a deadlock in torch's gloo (seen with torch 2.13): when the last reference to a
ProcessGroupGloo goes (here: DDP's reducer, once the default group is destroyed), its destructor
joins the group's worker threads while holding the GIL, and a worker that is still dropping the
last all-gather's tensors waits for the GIL. Keeping the gloo run's objects until the process
exits, seconds after their last collective, closes that window; so gloo also runs first."""


def make_accelerator(backend: str) -> tuple[Accelerator, str]:
    kwargs = InitProcessGroupKwargs(backend=backend)
    try:
        return Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION, kwargs_handlers=[kwargs]), "init_kwargs"
    except ValueError as exc:
        if not str(exc).startswith(REFUSAL.format(backend)):
            raise
    AcceleratorState._reset_state(reset_partial_state=True)  # the refused attempt left half a state
    dist.init_process_group(backend)
    return Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION), "own_init_process_group"


def dataset() -> TensorDataset:
    """32 samples in batches of 4: each of the 2 ranks gets 4 batches, so 2 optimizer steps."""
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(32, 6, generator=g, dtype=torch.float64),
                         torch.randn(32, 2, generator=g, dtype=torch.float64))


def train(backend: str) -> dict:
    accelerator, route = make_accelerator(backend)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 2)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = DataLoader(dataset(), batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, gathered = [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        gathered.append(accelerator.gather(loss.detach().reshape(1)).tolist())
    result = {"route": route, "backend": dist.get_backend(), "world_size": accelerator.num_processes,
              "losses": losses, "gathered": gathered,
              "params": {name: p.detach().clone() for name, p in accelerator.unwrap_model(model).named_parameters()}}
    KEEP_ALIVE.append((accelerator, model, optimizer, loader))
    AcceleratorState._reset_state(reset_partial_state=True)
    dist.destroy_process_group()  # the next run initialises a new default group
    return result


runs = {backend: train(backend) for backend in ("gloo", "gradsync")}
torch.save(runs, OUT / f"accelerate_rank{os.environ['RANK']}.pt")
