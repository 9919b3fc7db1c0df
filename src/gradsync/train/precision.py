"""--precision: the dtype a step's forward and loss compute in, and float16's gradient scaler.

    fp32        no autocast, no scaler (the default)
    bf16-mixed  forward and loss under torch.autocast(device, dtype=torch.bfloat16)
    fp16-mixed  the same in float16, with a gradient scaler (LossScaler below)

Master weights and optimizer state stay float32 under both: autocast casts each op's operands as it
runs (a Linear's weight is read as bfloat16, its float32 copy is what the optimizer steps), so the
gradients arrive in the parameters' own dtype, and what the strategies reduce, clip and step is
float32 as under fp32. Backward runs outside autocast, as torch's recipe has it.

The gradient scaler, torch.amp.GradScaler's semantics (Micikevicius et al. 2018, "Mixed Precision
Training"): float16's smallest normal is 6e-5, and small gradients would flush to zero, so

    scale      backward runs on loss x S (S starts at 2^16)
    unscale    before clipping, every gradient x 1/S; found_inf: any of them is inf or NaN
    step       skipped when found_inf (the optimizer is not called: weights and state unchanged)
    update     found_inf: S x 1/2, the run of good steps restarts; else after 2000 good steps in a row
               S x 2

Every rank must skip the same steps, or the replicas part. Where the ranks' gradients are the same
after the step's reduction (ddp: the all-reduced .grad; local: one process) each rank's own check is
the agreed one. Where they differ (zero1: each rank unscales its local gradient before the
reduce-scatter; diloco: each worker steps its own replica), the strategy agrees on it with one
1-element all-reduce (max) of the flag per step (StrategyObject.agree_found_inf). A parameter-server
worker sends its flag with its push: a sync version with any flagged push is skipped by every
server, and their answers say so, so every worker updates its scale alike; in async and ssp the
servers skip that push alone, and its worker updates its own scale (ps/, train/strategies/ps.py).

The scaler's state (S and the count of good steps) is in every checkpoint (StrategyObject.state) and
a resume continues it; a live replacement receives it with the rest of rank 0's state.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def check(precision: str, device_type: str, device: torch.device | None = None) -> None:
    """Refuse a --precision this torch cannot run on ``device_type`` ("cpu" or "cuda"), naming the one that
    can; ``device``: try it there (a rank's own device). The launcher checks CUDA by name only: a matrix
    product there would make a CUDA context before the ranks bind their GPUs (group/device_path.py)."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r} is not one of: {', '.join(PRECISIONS)}")
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None or (device_type == "cuda" and device is None):
        return
    if _autocasts(device or torch.device("cpu"), dtype):
        return
    other = "a CUDA GPU (--device cuda)" if device_type == "cpu" else "the CPU (--device cpu)"
    raise RuntimeError(f"--precision {precision}: torch {torch.__version__} has no {dtype} autocast on "
                       f"{device_type}; use {other} for it, or --precision bf16-mixed / fp32")


def _autocasts(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a matrix product on ``device`` under torch.autocast computes in ``dtype`` here (torch turns
    an autocast it cannot run into a warning and float32)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.autocast(device.type, dtype=dtype):
                product = torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
        except (RuntimeError, ValueError):
            return False
    return product.dtype == dtype


class LossScaler:
    """fp16-mixed's gradient scaler (module docstring); its numbers in ``state`` ("loss_scale",
    "good_steps"), a plain dict of numbers so that a live replacement receives it (keep_in)."""

    INITIAL_SCALE = 2.0 ** 16
    GROWTH_FACTOR = 2.0
    BACKOFF_FACTOR = 0.5
    GROWTH_INTERVAL = 2000
    """torch.amp.GradScaler's defaults."""

    def __init__(self) -> None:
        self.state = {"loss_scale": self.INITIAL_SCALE, "good_steps": 0}
        self.skipped: list[int] = []   # the steps skipped in this process (counted by update's callers)

    @property
    def scale(self) -> float:
        return float(self.state["loss_scale"])

    def unscale_(self, params) -> bool:
        """Every gradient of ``params`` x 1/S in place; whether any of them holds inf or NaN."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return False
        inverse = 1.0 / self.scale   # a power of two: exact, as GradScaler's
        for grad in grads:
            grad.mul_(inverse)
        values = [grad.coalesce().values() if grad.is_sparse else grad for grad in grads]   # a sparse table's rows
        finite = torch.stack([torch.isfinite(value).all() for value in values]).all()
        return not bool(finite)

    def update(self, found_inf: bool) -> None:
        """After a step: halve S on inf/NaN (and restart the count), double it after GROWTH_INTERVAL good steps."""
        state = self.state
        if found_inf:
            state["loss_scale"] = self.scale * self.BACKOFF_FACTOR
            state["good_steps"] = 0
            return
        state["good_steps"] = int(state["good_steps"]) + 1
        if state["good_steps"] >= self.GROWTH_INTERVAL:
            state["loss_scale"] = self.scale * self.GROWTH_FACTOR
            state["good_steps"] = 0


class Precision:
    """One rank's --precision: the autocast around forward and loss (StepWork.compute) and, for
    fp16-mixed, the scaler the strategies step through (module docstring)."""

    def __init__(self, precision: str, device: torch.device) -> None:
        check(precision, device.type, device)
        self.name = precision
        self.device_type = device.type
        self.dtype = AUTOCAST_DTYPES.get(precision)
        self.scaler = LossScaler() if precision == "fp16-mixed" else None

    def autocast(self):
        """The context forward and loss run in."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward runs on: loss x S under fp16-mixed, else the loss."""
        return loss if self.scaler is None else loss * self.scaler.scale

    def step(self, params, apply, clip=None, agree=None, step_number: int = 0) -> bool:
        """The end of a step: unscale (fp16-mixed), agree on inf/NaN with ``agree(found) -> found`` where
        the ranks' gradients differ, then ``clip()`` and ``apply()`` unless it was found, and update the
        scale; True when ``apply`` ran. ``step_number``: the step, recorded when it is skipped."""
        scaler = self.scaler
        found = False
        if scaler is not None:
            params = list(params)
            found = scaler.unscale_(params)
            if agree is not None:
                found = agree(found)
        if not found:
            if clip is not None:
                clip()
            apply()
        if scaler is not None:
            self.record(found, step_number)
        return not found

    def unscale(self, params) -> bool:
        """fp16-mixed: unscale the gradients of ``params``; whether any is inf or NaN (False otherwise)."""
        return False if self.scaler is None else self.scaler.unscale_(list(params))

    def record(self, found_inf: bool, step_number: int) -> None:
        """Update the scale after a step whose agreed verdict was ``found_inf`` (fp16-mixed)."""
        if self.scaler is None:
            return
        if found_inf:
            self.scaler.skipped.append(step_number)
        self.scaler.update(found_inf)

    # -- checkpoints and live replacements ---------------------------------------------------------
    def state_dict(self) -> dict:
        return {"precision": self.name, **(dict(self.scaler.state) if self.scaler is not None else {})}

    def load_state_dict(self, saved: dict | None) -> None:
        """The checkpoint's scaler, where both it and this run are fp16-mixed (another --precision starts afresh)."""
        if self.scaler is not None and saved and saved.get("precision") == "fp16-mixed":
            self.scaler.state["loss_scale"] = float(saved["loss_scale"])
            self.scaler.state["good_steps"] = int(saved["good_steps"])

    def keep_in(self, shared: dict) -> None:
        """Keep the scaler's numbers in ``shared`` from now on (live mode sends that dict to a replacement)."""
        if self.scaler is not None:
            shared.update(self.scaler.state)
            self.scaler.state = shared

    def describe(self) -> str:
        """The line said at the start of a mixed-precision run."""
        scaler = "; a gradient scaler from 2^16, every rank skipping the same steps" if self.scaler else ""
        return (f"--precision {self.name}: forward and loss under torch.autocast({self.device_type!r}, "
                f"{self.dtype}), weights and optimizer state float32{scaler}")

    def verdicts(self) -> str:
        """fp16-mixed's line at the end: how many steps were skipped, and the scale it ended with."""
        skipped = self.scaler.skipped
        which = f" ({', '.join(map(str, skipped[:8]))}{', ...' if len(skipped) > 8 else ''})" if skipped else ""
        return f"fp16-mixed: {len(skipped)} step(s) skipped for inf or NaN{which}, loss scale now {self.scaler.scale:g}"

    def summary(self) -> dict:
        """What the run's result says of it: the precision, and under fp16-mixed the scale and skipped steps."""
        if self.scaler is None:
            return {"precision": self.name}
        return {"precision": self.name, "loss_scale": self.scaler.scale, "skipped_steps": list(self.scaler.skipped)}
