"""PyTorch Lightning, unchanged, on the "gradsync" backend; run by test_backend_clients.py.

    python tests/clients_lightning.py OUT_DIR

Lightning's own launcher starts the second rank (Trainer(devices=2) re-runs this script with
LOCAL_RANK=1). The same float64 LightningModule is fitted twice in that one launch, with
DDPStrategy(process_group_backend="gloo") and then "gradsync", on the same data; between the two
the script destroys the first default group, as any program does that re-initialises, but keeps
the first fit's objects alive to the end (see KEEP_ALIVE). Each rank
saves, per backend, the losses of its own batches and its final parameters to
OUT_DIR/lightning_rank{r}.pt (torch.save, no collective involved).
"""

import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)
OUT = Path(sys.argv[1])
EPOCHS, LR = 2, 0.05
KEEP_ALIVE: list = []
"""Hack around a deadlock in torch's gloo (seen with torch 2.13): when the last reference to a
ProcessGroupGloo goes (here: DDP's reducer, once the default group is destroyed), its destructor
joins the group's worker threads while holding the GIL, and a worker that is still dropping the
last collective's tensors waits for the GIL. Keeping the gloo fit's objects until the process
exits, seconds after their last collective, closes that window; so gloo also runs first."""


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 2))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def dataset() -> TensorDataset:
    """24 samples: Lightning's DistributedSampler (no shuffling) gives each rank 12, in 3 batches."""
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(24, 5, generator=g, dtype=torch.float64),
                         torch.randn(24, 2, generator=g, dtype=torch.float64))


def fit(backend: str) -> dict:
    model = Regressor()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=backend),
                         precision="64-true", max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    trainer.fit(model, DataLoader(dataset(), batch_size=4, shuffle=False))
    used = dist.get_backend()
    KEEP_ALIVE.append((trainer, model))
    dist.destroy_process_group()  # the next fit initialises a new default group
    return {"backend": used, "world_size": trainer.world_size, "losses": model.losses,
            "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


runs = {backend: fit(backend) for backend in ("gloo", "gradsync")}
torch.save(runs, OUT / f"lightning_rank{int(os.environ.get('LOCAL_RANK', 0))}.pt")
