"""Server-side optimizers for the rows of a sparse table: each step touches only the rows it is given.

Vocabulary
    T        the server's block of a table (R_s x D), updated in place
    rows     unique local row ids touched this step (int64, k of them);  g  their gradient rows (k x D)
    t        steps taken on this table (every server version counts, touched or not, as torch counts a
             step for a parameter whose sparse gradient exists, however few rows it has)
    group    the hyper-parameters, read at every step from the torch optimizer's param group that holds
             the table, so a learning-rate schedule applied to that optimizer applies here too

The rule follows the torch optimizer that ``optimizer_fn`` builds (sparse_rule picks it):

    SGD       T[rows] -= lr * m[rows],  m[rows] = mu * m[rows] + g    (m = g when mu = 0)
              Lazy momentum: an untouched row's velocity neither decays nor moves the row. Dense
              momentum would keep moving every row that was ever touched, on every step, which
              costs O(R) per step and sends every row; lazy momentum is what sparse systems do (as
              TensorFlow's sparse momentum apply). With mu = 0 it is exactly torch's SGD.
    Adagrad   s[rows] += g^2;  T[rows] -= clr * g / (sqrt(s[rows]) + eps),
              clr = lr / (1 + (t - 1) * lr_decay)       (torch.optim.Adagrad's sparse path, exactly)
    Adam      torch.optim.SparseAdam's rule (Adam or SparseAdam in optimizer_fn):
              m[rows] = b1 m[rows] + (1 - b1) g,  v[rows] = b2 v[rows] + (1 - b2) g^2,
              T[rows] -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m[rows] / (sqrt(v[rows]) + eps)
              Moments of untouched rows do not decay (lazy Adam), and t counts every step.

Options these rules cannot honour (weight decay, Nesterov, dampening, AMSGrad, maximize) are refused
when the ParameterServer is built, naming the option.
"""

from __future__ import annotations

import math

import torch

RULES = ("SGD", "Adagrad", "Adam")


def sparse_rule(optimizer: torch.optim.Optimizer) -> str:
    """The sparse rule for a torch optimizer, or RuntimeError naming what is accepted."""
    group = optimizer.param_groups[0]
    name = type(optimizer).__name__
    refused = []
    if group.get("maximize", False):
        refused.append("maximize=True")
    if group.get("weight_decay", 0):
        refused.append(f"weight_decay={group['weight_decay']}")
    if isinstance(optimizer, torch.optim.SGD):
        if group.get("nesterov"):
            refused.append("nesterov=True")
        if group.get("dampening", 0):
            refused.append(f"dampening={group['dampening']}")
        rule = "SGD"
    elif isinstance(optimizer, torch.optim.Adagrad):
        rule = "Adagrad"
    elif isinstance(optimizer, (torch.optim.Adam, torch.optim.SparseAdam)):
        if group.get("amsgrad"):
            refused.append("amsgrad=True")
        rule = "Adam"
    else:
        raise RuntimeError(f"sparse parameters (nn.Embedding/EmbeddingBag with sparse=True) are updated on the "
                           f"servers with SGD (lazy momentum), Adagrad or Adam/SparseAdam; optimizer_fn built "
                           f"{name}. Use one of those, or sparse=False to push the table densely")
    if refused:
        raise RuntimeError(f"{name} with {', '.join(refused)} cannot be applied to sparse rows on the servers; "
                           f"the sparse rules support SGD(lr, momentum), Adagrad(lr, lr_decay, eps, "
                           f"initial_accumulator_value) and Adam/SparseAdam(lr, betas, eps)")
    return rule


class SparseRows:
    """Applies ``rule`` to one table block ``table`` with hyper-parameters from ``group`` (see module docstring)."""

    def __init__(self, rule: str, table: torch.Tensor, group: dict) -> None:
        assert rule in RULES, rule
        self.rule = rule
        self.table = table
        self.group = group
        self.t = 0
        self.state: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, fill: float = 0.0) -> torch.Tensor:
        if name not in self.state:
            self.state[name] = torch.full_like(self.table, fill)
        return self.state[name]

    @torch.no_grad()
    def step(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """One step: ``rows`` unique local ids (k), ``grad`` their gradient rows (k x D)."""
        self.t += 1
        if rows.numel() == 0:
            return
        lr = float(self.group["lr"])
        if self.rule == "SGD":
            momentum = float(self.group.get("momentum", 0.0))
            update = grad
            if momentum:  # a zero velocity makes the first step m = g, as torch's SGD starts its buffer
                velocity = self._buffer("momentum")
                update = velocity[rows].mul_(momentum).add_(grad)
                velocity[rows] = update
            self.table.index_add_(0, rows, update, alpha=-lr)
        elif self.rule == "Adagrad":
            clr = lr / (1 + (self.t - 1) * float(self.group.get("lr_decay", 0.0)))
            total = self._buffer("sum", float(self.group.get("initial_accumulator_value", 0.0)))
            total.index_add_(0, rows, grad.pow(2))
            std = total[rows].sqrt_().add_(float(self.group["eps"]))
            self.table.index_add_(0, rows, grad / std, alpha=-clr)
        else:  # Adam, SparseAdam's arithmetic order
            beta1, beta2 = self.group["betas"]
            eps = float(self.group["eps"])
            exp_avg, exp_avg_sq = self._buffer("exp_avg"), self._buffer("exp_avg_sq")
            old_avg, old_sq = exp_avg[rows], exp_avg_sq[rows]
            avg_update = grad.sub(old_avg).mul_(1 - beta1)
            sq_update = grad.pow(2).sub_(old_sq).mul_(1 - beta2)
            exp_avg.index_add_(0, rows, avg_update)
            exp_avg_sq.index_add_(0, rows, sq_update)
            numer = avg_update.add_(old_avg)
            denom = sq_update.add_(old_sq).sqrt_().add_(eps)
            step_size = lr * math.sqrt(1 - beta2 ** self.t) / (1 - beta1 ** self.t)
            self.table.index_add_(0, rows, -step_size * numer.div_(denom))
