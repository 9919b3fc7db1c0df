"""torch FSDP2 and torch.distributed.checkpoint, unchanged, on the "gradsync" backend; run by
test_backend_clients.py under torchrun.

    torchrun --standalone --nproc-per-node 2 tests/clients_fsdp.py train OUT_DIR
    torchrun --standalone --nproc-per-node 3 tests/clients_fsdp.py load OUT_DIR

train (2 ranks): the default group is "gradsync"; a second group over the same ranks is gloo.
The same float64 MLP is fully_shard()-ed on a DeviceMesh over each group and trained STEPS Adam
steps on the same per-rank batches; each rank saves its losses and its local shards of both
models (torch.save, no collective involved) to OUT_DIR/fsdp_rank{r}.pt. Then the gradsync model
is saved with torch.distributed.checkpoint to OUT_DIR/checkpoint (planning collectives on the
default group, i.e. gradsync).

load (3 ranks, default group "gradsync"): a model built with other initial values is sharded over
3 ranks (13 rows: shards of 5, 5, 3), dcp.load() reads the 2-rank checkpoint into it, and one
forward pass on a fixed input runs (FSDP2 all-gathers the 3-rank shards). Each rank saves its
local shards and the output to OUT_DIR/load_rank{r}.pt.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
MODE, OUT = sys.argv[1], Path(sys.argv[2])
STEPS, LR = 4, 1e-2
dist.init_process_group("gradsync")
RANK, N = dist.get_rank(), dist.get_world_size()


def make_model(seed: int) -> nn.Module:
    """7 -> 13 -> 13 -> 3: 13 and 3 rows do not divide by 2 or 3, so FSDP2 pads its shards."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 13), nn.Tanh(), nn.Linear(13, 3))


def shard(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.to_local().detach().clone() for name, param in model.named_parameters()}


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 7, generator=g), torch.randn(6, 3, generator=g)


def train(group: dist.ProcessGroup) -> tuple[nn.Module, list[float]]:
    model = shard(make_model(seed=0), group)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(RANK, step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


if MODE == "train":
    gloo = dist.new_group(backend="gloo")
    assert dist.get_backend() == "gradsync" and dist.get_backend(gloo) == "gloo"
    ours, our_losses = train(dist.group.WORLD)
    theirs, their_losses = train(gloo)
    torch.save({"losses": {"gradsync": our_losses, "gloo": their_losses},
                "shards": {"gradsync": local_shards(ours), "gloo": local_shards(theirs)}},
               OUT / f"fsdp_rank{RANK}.pt")
    dcp.save({"model": ours.state_dict()}, checkpoint_id=OUT / "checkpoint")
elif MODE == "load":
    model = shard(make_model(seed=1), dist.group.WORLD)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=OUT / "checkpoint")
    model.load_state_dict(state["model"])
    with torch.no_grad():
        output = model(torch.linspace(-1, 1, 4 * 7).reshape(4, 7))
    torch.save({"shards": local_shards(model), "output": output}, OUT / f"load_rank{RANK}.pt")
else:
    raise ValueError(f"mode {MODE!r}; choose train or load")
dist.barrier()
dist.destroy_process_group()
