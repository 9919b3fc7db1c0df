"""Mixed precision, as torch's DDP defines its ``mixed_precision`` argument.

The argument is torch's ``torch.nn.parallel.distributed._MixedPrecision`` (or any object with the
same three fields, such as ``torch.distributed.fsdp.MixedPrecision``, whose other fields torch's
DDP ignores and so does this):

    param_dtype    forward and backward run with floating parameters (and floating inputs) cast
                   to it; outside them the parameters keep their full precision, so the optimizer
                   and checkpoints see full-precision values
    reduce_dtype   gradients are reduced in it (default: param_dtype, else the parameters' own)
    buffer_dtype   floating buffers are cast to it once, at construction

One step, for a parameter p of full dtype F (torch's ``_reducer_allreduce_and_upcast_hook``):
    forward      p.data <- p_F.to(param_dtype)
    backward     g (param_dtype) into its bucket (buckets are param_dtype)
    reduce       r = (sum over ranks of g.to(reduce_dtype)) / divisor, rounded to reduce_dtype once
                 (float16/bfloat16 added in float32: ddp/hooks.py reduce_in_dtype, the reducer's hook)
    after        p.data <- p_F;  p.grad <- r.to(F)   (never rounded through param_dtype)
Under no_sync the gradient stays in param_dtype (it accumulates there) until a synchronised
backward reduces it.

torch's own implementation needs an accelerator (on CPU its first forward raises "cpu backend
doesn't support events"); this one runs wherever the wrapper does. It replaces the communication
hook, so a hook of one's own (register_comm_hook) or comm_hook="fp16"/"bf16" cannot be combined
with it, as torch refuses the same.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.utils import _cast_forward_inputs

FIELDS = ("param_dtype", "reduce_dtype", "buffer_dtype")


def _dtype_field(config, name: str) -> torch.dtype | None:
    value = getattr(config, name)
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"mixed_precision.{name} must be None or a floating torch.dtype, got {value!r}")
    return value


class MixedPrecisionCasts:
    """The casts of one wrapped module (see the module docstring)."""

    def __init__(self, config, module: nn.Module) -> None:
        missing = [name for name in FIELDS if not hasattr(config, name)]
        if missing:
            raise TypeError(f"mixed_precision must have the fields {', '.join(FIELDS)} (torch's "
                            f"torch.nn.parallel.distributed._MixedPrecision); {type(config).__name__} lacks "
                            f"{', '.join(missing)}")
        self.param_dtype = _dtype_field(config, "param_dtype")
        self.reduce_dtype = _dtype_field(config, "reduce_dtype") or self.param_dtype
        self.buffer_dtype = _dtype_field(config, "buffer_dtype")
        self._params = [p for p in module.parameters() if p.is_floating_point()]
        self._full: dict[int, torch.Tensor] = {}
        if self.buffer_dtype is not None:
            for buffer in module.buffers():
                if buffer.is_floating_point():
                    buffer.data = buffer.data.to(self.buffer_dtype)

    def cast_for_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Parameters (and their accumulated gradients) and floating inputs to param_dtype."""
        if self.param_dtype is None:
            return args, kwargs
        with torch.no_grad():
            for p in self._params:
                full = self._full.setdefault(id(p), p.data)
                p.data = full.to(self.param_dtype)
                if p.grad is not None and p.grad.dtype != self.param_dtype:
                    p.grad = p.grad.to(self.param_dtype)
        return _cast_forward_inputs(self.param_dtype, *args, **kwargs)

    def restore_params(self) -> None:
        """Every parameter back to its full-precision values."""
        for p in self._params:
            full = self._full.pop(id(p), None)
            if full is not None:
                p.data = full

    def write_gradients(self, buckets, reduced: dict[int, torch.Tensor]) -> None:
        """Full-precision parameters, and each gradient its bucket's reduced value cast to the
        parameter's own dtype."""
        self.restore_params()
        for bucket in buckets:
            result = reduced[bucket.index].reshape(-1)
            for slot, p in enumerate(bucket.params):
                p.grad = bucket.grad_view(slot, result).to(p.dtype)
