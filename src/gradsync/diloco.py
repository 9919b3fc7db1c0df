"""DiLoCo: replicas train alone for H steps, then agree on one outer step of their averaged progress.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023): local
SGD with an inner optimizer (AdamW in the paper) and an outer optimizer (SGD with Nesterov momentum,
lr 0.7, momentum 0.9) applied to the pseudo-gradient, the replicas' average movement.

    diloco = gs.DiLoCo(model, inner_optimizer, outer_lr=0.7, outer_momentum=0.9, sync_every=H)
    for x, y in batches:                     # each rank its own shard; no wrapper around the model
        inner_optimizer.zero_grad(); loss_fn(model(x), y).backward(); inner_optimizer.step()
        diloco.step()                        # counts inner steps; every H-th one is an outer step

Vocabulary
    N           replicas;  H  inner steps between outer steps (``sync_every``)
    theta       the parameters a replica trains (the model's own); theta_i after replica i's H steps
    anchor      the parameters of the last outer step, the same on every rank (where each round of
                H inner steps started)
    pseudo-gradient   delta = mean_i (anchor - theta_i): the replicas' average step, as a gradient

One outer step (every H inner steps; the same on every rank):
    1. delta_i = anchor - theta_i, flat; all-reduce it, averaged (one all-reduce of M bytes)
    2. the outer optimizer steps the anchor with gradient delta (Nesterov SGD by default)
    3. theta <- anchor on every rank, so the replicas are bit-identical again (check_replicas)
Floating buffers (BatchNorm's running statistics) are averaged at the same moment; integer ones
(counters) are taken from rank 0.

Inner optimizer state (AdamW's moments) stays on each rank, unsynchronised, as in the paper. The
inner learning rate schedule is the program's.

Traffic: one all-reduce of the M bytes of parameters every H steps: with the ring all-reduce
2(N-1)/N * M bytes sent per rank per outer step, so 2(N-1)/(N H) * M per step against ring DDP's
2(N-1)/N * M: H times less.

Checkpoints: ``state_dict()`` holds the anchor, the outer optimizer's state and the inner step
count; save it with the model's and the inner optimizer's (train/ does), and ``load_state_dict``
before going on: the run continues as if it had not stopped.
"""

from __future__ import annotations

import torch
from torch import nn

from gradsync.group import runtime
from gradsync.comm.collectives import all_reduce, broadcast, shared_allocator


class DiLoCo:
    """See the module docstring. ``algorithm``: gradsync's all-reduce algorithm for the pseudo-gradients."""

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, sync_every: int = 500, nesterov: bool = True,
                 algorithm: str = "auto") -> None:
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"DiLoCo sync_every (H, inner steps between outer steps) must be an integer >= 1, "
                             f"got {sync_every!r}")
        if not outer_lr > 0:
            raise ValueError(f"DiLoCo outer_lr must be > 0, got {outer_lr!r} (the paper uses 0.7)")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"DiLoCo outer_momentum must be in [0, 1), got {outer_momentum!r} (the paper uses 0.9)")
        if nesterov and outer_momentum == 0:
            raise ValueError("DiLoCo: Nesterov momentum needs outer_momentum > 0 (or pass nesterov=False)")
        self.world = runtime.world()
        self.model, self.inner_optimizer = model, inner_optimizer
        self.sync_every, self.algorithm = sync_every, algorithm
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("DiLoCo needs a model with at least one parameter that requires grad")
        if len({p.dtype for p in self.params}) != 1:
            raise ValueError(f"DiLoCo needs parameters of one dtype, got "
                             f"{sorted(str(d) for d in {p.dtype for p in self.params})}")
        self.inner_steps = 0
        self.outer_steps = 0
        with torch.no_grad():
            for p in self.params:   # replicas start from rank 0's parameters
                broadcast(p.data, src=0)
        numel = sum(p.numel() for p in self.params)
        dtype, device = self.params[0].dtype, self.params[0].device
        allocate = shared_allocator(self.world) if device.type == "cpu" else None
        delta = allocate(numel, dtype) if allocate is not None else None
        self._delta = delta if delta is not None else torch.zeros(numel, dtype=dtype, device=device)
        self.anchor = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in self.params]))
        self.outer_optimizer = torch.optim.SGD([self.anchor], lr=outer_lr, momentum=outer_momentum,
                                               nesterov=nesterov)

    def step(self) -> bool:
        """Count one inner step (call it after the inner optimizer's step, on every rank); every
        ``sync_every``-th call runs the outer step. Returns whether it did."""
        self.inner_steps += 1
        if self.inner_steps % self.sync_every:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step (module docstring), now. Collective: every rank calls it at the same step."""
        offset = 0
        for p in self.params:   # 1. delta = anchor - theta, averaged
            self._delta[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            offset += p.numel()
        torch.sub(self.anchor.detach(), self._delta, out=self._delta)
        all_reduce(self._delta, op="avg", algorithm=self.algorithm)
        self.anchor.grad = self._delta   # 2. the outer step
        self.outer_optimizer.step()
        self.anchor.grad = None
        offset = 0
        for p in self.params:   # 3. theta <- anchor
            p.copy_(self.anchor.detach()[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        for buffer in self.model.buffers():
            if buffer.is_floating_point():
                all_reduce(buffer, op="avg", algorithm=self.algorithm)
            elif buffer.numel():
                broadcast(buffer, src=0)
        self.outer_steps += 1

    def state_dict(self) -> dict:
        """The anchor, the outer optimizer's state and the step counts (not the model's parameters
        nor the inner optimizer's state: save those beside it)."""
        return {"anchor": self.anchor.detach().clone(), "outer_optimizer": self.outer_optimizer.state_dict(),
                "inner_steps": self.inner_steps, "outer_steps": self.outer_steps, "sync_every": self.sync_every}

    def load_state_dict(self, state: dict) -> None:
        if state["anchor"].shape != self.anchor.shape:
            raise ValueError(f"DiLoCo.load_state_dict: the saved anchor has {state['anchor'].numel()} elements, "
                             f"this model {self.anchor.numel()}: not the same model")
        with torch.no_grad():
            self.anchor.copy_(state["anchor"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.inner_steps, self.outer_steps = int(state["inner_steps"]), int(state["outer_steps"])

    def bytes_per_sync(self) -> int:
        """M: the bytes of parameters one outer step all-reduces."""
        return self._delta.numel() * self._delta.element_size()
