"""torch.nn.parallel.DistributedDataParallel's keyword arguments, accepted by gradsync's wrapper.

A program moves to gradsync by changing the class it wraps its model in, so every argument it
passes to torch's DDP must mean the same here or fail loudly:

    argument                  here
    device_ids                None, or one device equal to the module's (a single-device module
                              needs no scatter); more than one device, or another device: an error
    output_device             None or the module's device: outputs stay where the module puts them
    dim                       accepted, no effect: with a single device nothing is scattered
    process_group             None, torch's default group, or any group holding every rank;
                              a subgroup is an error (gradsync reduces over the whole world)
    gradient_as_bucket_view   honoured always: after the first backward each param.grad is a view
                              of its bucket (ddp/reducer.py), which is what True asks for; False is
                              accepted and behaves the same (no extra gradient copy)
    static_graph              accepted, no effect: the reducer needs no graph hint to be correct
    init_sync                 honoured: False skips the start-up check and broadcast of rank 0's state
    check_reduction           accepted, no effect (deprecated in torch too)
    mixed_precision,          not supported: an error that names them (use comm_hook="fp16"/"bf16"
    device_mesh, ...          for reduced-precision communication)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

UNSUPPORTED = ("mixed_precision", "device_mesh", "delay_all_reduce_named_params", "param_to_hook_all_reduce",
               "skip_all_reduce_unused_params")


def _module_device(module: nn.Module) -> torch.device:
    devices = {p.device for p in module.parameters()}
    if len(devices) > 1:
        raise ValueError(f"DistributedDataParallel: the module's parameters live on several devices "
                         f"({', '.join(sorted(map(str, devices)))}); put the module on one device")
    return next(iter(devices), torch.device("cpu"))


def _as_device(value) -> torch.device:
    return torch.device("cuda", value) if isinstance(value, int) else torch.device(value)


def _same_device(requested: torch.device, actual: torch.device) -> bool:
    if requested.type != actual.type:
        return False
    return requested.index is None or actual.index is None or requested.index == actual.index


def check(module: nn.Module, *, device_ids, output_device, process_group, world_size: int,
          unsupported: dict) -> None:
    """Raise for torch DDP arguments gradsync cannot honour (see the module docstring)."""
    named = [name for name in UNSUPPORTED if unsupported.get(name) not in (None, False)]
    if named:
        raise RuntimeError(f"DistributedDataParallel: {', '.join(named)} is not supported by gradsync's wrapper; "
                           f"use comm_hook='fp16' or 'bf16' for reduced-precision communication")
    device = _module_device(module)
    if device_ids is not None:
        if len(device_ids) != 1:
            raise ValueError(f"DistributedDataParallel: device_ids={device_ids!r}: give None or exactly one device, "
                             f"the one the module is on ({device}); multi-device modules are not supported")
        if not _same_device(_as_device(device_ids[0]), device):
            raise ValueError(f"DistributedDataParallel: device_ids={device_ids!r} but the module is on {device}; "
                             f"move the module there first (module.to(...)) or pass device_ids=None")
    if output_device is not None and not _same_device(_as_device(output_device), device):
        raise ValueError(f"DistributedDataParallel: output_device={output_device!r} but the module is on {device}; "
                         f"outputs stay on the module's device, so pass None or that device")
    if process_group is not None:
        size = process_group.size() if hasattr(process_group, "size") else dist.get_world_size(process_group)
        if size < 0:
            raise RuntimeError("DistributedDataParallel: this rank is not a member of process_group; gradsync "
                               "reduces over the whole world, subgroups are not supported (pass process_group=None)")
        if size != world_size:
            raise RuntimeError(f"DistributedDataParallel: process_group has {size} ranks but the world has "
                               f"{world_size}; gradsync reduces over the whole world, subgroups are not supported "
                               f"(pass process_group=None)")
