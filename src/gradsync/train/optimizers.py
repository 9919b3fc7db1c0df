"""The optimizer a run steps with, and its learning rate at each step.

Optimizer (--optimizer): sgd | adam | adamw | adagrad, or module:function taking the parameters and
returning a torch.optim.Optimizer. --lr, --weight-decay and --momentum (sgd) override the model's
defaults (train/tasks.py); a function's optimizer keeps its own settings, and its lr is the base lr
unless --lr is given. Every strategy builds it from one OptimizerSpec, a class and its keyword
arguments, so ZeRO-1 (which constructs the class per shard) and the parameter server (per server
shard) step the very optimizer a single process would.

Schedule (--lr-schedule), for step s of a run of S steps with W warm-up steps and peak lr P:
    warm-up    s < W: P x (s + 1) / W                                  (linear from P/W, Goyal et al. 2017)
    constant   P
    cosine     m + (P - m) x (1 + cos(pi x t)) / 2,  t = (s - W) / (S - W) (Loshchilov & Hutter 2017)
    linear     m + (P - m) x (1 - t)
with m = --min-lr and t capped at 1. S, W, the schedule and m are decided when a run starts and kept by
its checkpoint, so a resume continues the same curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gradsync.train import factory

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
              "adagrad": torch.optim.Adagrad}
"""--optimizer's named choices (module:function besides)."""
SCHEDULES = ("constant", "cosine", "linear")
"""--lr-schedule's choices: what the lr does after the warm-up."""


@dataclass
class OptimizerSpec:
    """An optimizer class and the keyword arguments of its constructor (lr included)."""

    cls: type
    kwargs: dict = field(default_factory=dict)

    @property
    def lr(self) -> float:
        return float(self.kwargs["lr"])

    def with_lr(self, lr: float) -> "OptimizerSpec":
        return OptimizerSpec(self.cls, {**self.kwargs, "lr": lr})

    def build(self, params) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


def optimizer_spec(name: str, lr: float | None, weight_decay: float | None, momentum: float | None,
                   defaults: dict, default_name: str) -> OptimizerSpec:
    """The spec for --optimizer ``name``. ``defaults``: the model's lr, weight_decay, momentum for its own
    optimizer ``default_name``, used where the flag is not given; another optimizer takes only the model's
    lr, and torch's own defaults for the rest. A module:function is called once on a stand-in parameter to
    read its class and settings."""
    if name != default_name:
        defaults = {"lr": defaults["lr"]}
    if name in OPTIMIZERS:
        cls = OPTIMIZERS[name]
        kwargs = {"lr": lr if lr is not None else defaults.get("lr", 1e-3)}
        decay = weight_decay if weight_decay is not None else defaults.get("weight_decay")
        if decay is not None:
            kwargs["weight_decay"] = decay
        if name == "sgd":
            kwargs["momentum"] = momentum if momentum is not None else defaults.get("momentum", 0.0)
        elif momentum is not None:
            raise ValueError(f"--momentum is SGD's; --optimizer {name} has its own (betas): drop --momentum")
        return OptimizerSpec(cls, kwargs)
    if not factory.is_spec(name):
        raise ValueError(f"--optimizer {name!r} is not one of: {', '.join(OPTIMIZERS)}, or a module:function taking "
                         f"the parameters")
    build = factory.load(name, "--optimizer")
    try:
        made = build([torch.nn.Parameter(torch.zeros(1))])
    except Exception as exc:
        raise ValueError(f"--optimizer {name} raised {type(exc).__name__} given a list of parameters: {exc}") from None
    if not isinstance(made, torch.optim.Optimizer):
        raise ValueError(f"--optimizer {name} returned a {type(made).__name__}; it must return a "
                         f"torch.optim.Optimizer built over the parameters it is given")
    kwargs = dict(made.defaults)
    if lr is not None:
        kwargs["lr"] = lr
    if weight_decay is not None:
        kwargs["weight_decay"] = weight_decay
    if momentum is not None:
        kwargs["momentum"] = momentum
    return OptimizerSpec(type(made), kwargs)


def lr_at(step: int, peak: float, warmup_steps: int, schedule: str = "constant", total_steps: int | None = None,
          min_lr: float = 0.0) -> float:
    """The learning rate of 0-based ``step`` (module docstring)."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant" or total_steps is None:
        return peak
    t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return min_lr + (peak - min_lr) * (1 + math.cos(math.pi * t)) / 2
    if schedule == "linear":
        return min_lr + (peak - min_lr) * (1 - t)
    raise ValueError(f"--lr-schedule {schedule!r} is not one of: {', '.join(SCHEDULES)}")
