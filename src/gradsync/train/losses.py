"""How a batch becomes a loss: the conventions `gradsync train --loss` accepts.

    cross_entropy  a batch (inputs, targets): cross_entropy(model(inputs), targets); outputs (B, C) with
                   integer targets (B), or a sequence's (B, T, C) with (B, T), or class probabilities
                   of the outputs' own shape
    mse            a batch (inputs, targets): mse_loss(model(inputs), targets), the same shape (a
                   trailing 1 of the outputs is dropped: (B, 1) against (B))
    model          the model computes its own loss: model(*batch) for a tuple batch (nanoGPT's
                   forward(idx, targets) -> (logits, loss)), model(**batch) for a dict batch (Hugging
                   Face: forward(input_ids=..., labels=...) -> an output with .loss); the loss is what
                   forward returns when it is a 0-dim tensor, its ``.loss`` or ``["loss"]``, or the
                   0-dim tensor in the tuple it returns
    module:function  a batch (inputs, targets): function(model(inputs), targets) -> the loss
    auto           model for a dict batch, cross_entropy for the rest (the default)

A batch of more than two tensors is (inputs..., targets): model(*inputs). Every convention's loss is the
mean over the batch's samples, which the loop weighs so that the ranks' averaged gradient is the mean
over the step's samples (train/loop.py). The accuracy, where one can be read from the outputs
(floating (B, ..., C) against integer targets (B, ...): how often the argmax is the target), or a
``--metric module:function`` returning (correct, count), is reported beside the test loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch
from torch import nn

from gradsync.train import factory

LOSSES = ("auto", "cross_entropy", "mse", "model")
"""--loss's named conventions (module:function besides)."""


class LossRule:
    """One convention (module docstring): ``rule(model, batch) -> (loss, outputs)``; ``rule.score(outputs,
    batch) -> (correct, count) or None``."""

    def __init__(self, spec: str = "auto", metric: str | None = None) -> None:
        self.spec = spec
        self.function: Callable | None = None
        if spec not in LOSSES:
            if not factory.is_spec(spec):
                raise ValueError(f"--loss {spec!r} is not one of: {', '.join(LOSSES)}, or a module:function taking "
                                 f"(outputs, targets)")
            self.function = factory.load(spec, "--loss")
        self.metric = factory.load(metric, "--metric") if metric else None

    def convention(self, batch) -> str:
        """The convention that applies to ``batch``: ``spec``, with auto decided by the batch's kind."""
        if self.spec == "auto":
            return "model" if isinstance(batch, Mapping) else "cross_entropy"
        return self.spec if self.function is None else "function"

    def __call__(self, model, batch) -> tuple[torch.Tensor, object]:
        convention = self.convention(batch)
        if convention == "model":
            outputs = model(**batch) if isinstance(batch, Mapping) else model(*batch)
            return loss_in(outputs), outputs
        inputs, targets = split(batch, self.spec)
        outputs = model(*inputs)
        if convention == "cross_entropy":
            return cross_entropy(outputs, targets), outputs
        if convention == "mse":
            return mse(outputs, targets), outputs
        loss = self.function(outputs, targets)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise ValueError(f"--loss {self.spec} returned {_describe(loss)}; it must return the loss, a 0-dim tensor")
        return loss, outputs

    def score(self, outputs, batch) -> tuple[float, float] | None:
        """(correct, count) for the accuracy, or None where none can be read (module docstring)."""
        if self.convention(batch) == "model":
            return None
        _, targets = split(batch, self.spec)
        if self.metric is not None:
            correct, count = self.metric(outputs, targets)
            return float(correct), float(count)
        if (isinstance(outputs, torch.Tensor) and outputs.is_floating_point() and outputs.dim() >= 1
                and not targets.is_floating_point() and targets.dtype != torch.bool
                and outputs.shape[:-1] == targets.shape):
            return float((outputs.argmax(-1) == targets).sum()), float(targets.numel())
        return None


def samples_in(batch) -> int:
    """How many samples ``batch`` holds (its first tensor's first dimension)."""
    first = next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0]
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else len(first)


def split(batch, spec: str) -> tuple[tuple, torch.Tensor]:
    """(inputs, targets) of a tuple batch; one line naming --loss when the batch is not one."""
    if isinstance(batch, Mapping):
        raise ValueError(f"--loss {spec}: the batch is a dict (keys {', '.join(map(str, batch))}); a dict batch goes "
                         f"with --loss model (the model's output carries .loss, as Hugging Face models' do), or give "
                         f"(inputs, targets) samples")
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ValueError(f"--loss {spec}: a sample must be (inputs, targets) (or (inputs..., targets)); got "
                         f"{_describe(batch)}. A model that computes its own loss takes --loss model")
    return tuple(batch[:-1]), batch[-1]


def cross_entropy(outputs, targets: torch.Tensor) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor) and outputs.dim() >= 2:
        if outputs.shape[:-1] == targets.shape and not targets.is_floating_point():
            return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
        if outputs.shape == targets.shape and targets.is_floating_point():   # class probabilities
            return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]),
                                               targets.reshape(-1, targets.shape[-1]))
    raise ValueError(f"--loss cross_entropy: outputs {_describe(outputs)} and targets {_describe(targets)} do not "
                     f"fit: give outputs (B, C) with integer targets (B) (a sequence: (B, T, C) with (B, T)), or "
                     f"class probabilities of the outputs' shape; --loss mse for regression")


def mse(outputs, targets: torch.Tensor) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor) and targets.is_floating_point():
        if outputs.shape != targets.shape and outputs.shape[-1:] == (1,) and outputs.shape[:-1] == targets.shape:
            outputs = outputs.squeeze(-1)
        if outputs.shape == targets.shape:
            return nn.functional.mse_loss(outputs, targets)
    raise ValueError(f"--loss mse: outputs {_describe(outputs)} and targets {_describe(targets)} do not fit: give "
                     f"floating-point targets of the outputs' shape ((B, 1) outputs may meet (B) targets)")


def loss_in(outputs) -> torch.Tensor:
    """The loss a model that computes its own returned (module docstring, convention model)."""
    if isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        return outputs
    candidate = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if candidate is None and isinstance(outputs, (tuple, list)):
        candidate = next((o for o in outputs if isinstance(o, torch.Tensor) and o.dim() == 0), None)
    if isinstance(candidate, torch.Tensor) and candidate.dim() == 0:
        return candidate
    raise ValueError(f"--loss model: the model's forward returned {_describe(outputs)}, holding no loss: return "
                     f"the loss (a 0-dim tensor), a tuple holding it ((logits, loss), as nanoGPT), or an output "
                     f"with .loss (as Hugging Face models; give it the labels); or use --loss cross_entropy|mse")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(_describe(v) for v in value[:4])})"
    return f"a {type(value).__name__}"
