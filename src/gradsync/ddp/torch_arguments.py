"""torch.nn.parallel.DistributedDataParallel's keyword arguments, accepted by gradsync's wrapper.

A program moves to gradsync by changing the class it wraps its model in, so every argument it
passes to torch's DDP must mean the same here or fail loudly:

    argument                  here
    device_ids                None, or one device equal to the module's (a single-device module
                              needs no scatter); more than one device, or another device: an error
    output_device             None or the module's device: outputs stay where the module puts them
    dim                       accepted, no effect: with a single device nothing is scattered
    process_group             None or a group of every rank: gradsync's own collectives over its
                              world. A subgroup (new_group(ranks)): the replicas are its members and
                              every collective of the wrapper is the group's own (ddp/replica_group.py);
                              on a rank outside it, an error (torch's DDP raises there too)
    bucket_cap_mb             the bucket cap; the first bucket is 1 MiB whatever the cap (torch:
                              only when bucket_cap_mb is not given)
    bucket_cap_mb_list        one cap per bucket in launch order, the last repeating (as torch)
    broadcast_buffers,        rank 0's buffers at each forward (under Join: the highest rank still
    forward_sync_buffers      training's); forward_sync_buffers, where given, wins, as in torch
    gradient_as_bucket_view   honoured always: after the first backward each param.grad is a view
                              of its bucket (ddp/reducer.py), which is what True asks for; False is
                              accepted and behaves the same (no extra gradient copy)
    static_graph              no graph hint is needed to be correct; with find_unused_parameters it
                              lets the buckets be rebuilt after the first backward, as in torch
    init_sync                 honoured: False skips the start-up check and broadcast of rank 0's state
    mixed_precision           honoured (ddp/mixed_precision.py): param_dtype, reduce_dtype,
                              buffer_dtype as torch defines them, on CPU too (torch's needs an
                              accelerator); not with a communication hook, which torch refuses too
    check_reduction,          accepted, no effect (deprecated in torch; a performance knob)
    batched_grad_copy
    device_mesh, delay_all_reduce_named_params, param_to_hook_all_reduce,
    skip_all_reduce_unused_params
                              not supported: an error that names them

Methods of torch's DDP beside the constructor: register_comm_hook(state, hook) with torch's
contract (ddp/hooks.py, ddp/grad_bucket.py), no_sync(), join() and the Joinable interface for
torch.distributed.algorithms.join.Join (ddp/uneven_inputs.py).
"""

from __future__ import annotations

import torch
from torch import nn

UNSUPPORTED = ("device_mesh", "delay_all_reduce_named_params", "param_to_hook_all_reduce",
               "skip_all_reduce_unused_params")


def module_device(module: nn.Module) -> torch.device:
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


def check(module: nn.Module, *, device_ids, output_device, unsupported: dict) -> None:
    """Raise for torch DDP arguments gradsync cannot honour (see the module docstring)."""
    named = [name for name in UNSUPPORTED if unsupported.get(name) not in (None, False)]
    if named:
        raise RuntimeError(f"DistributedDataParallel: {', '.join(named)} is not supported by gradsync's wrapper")
    device = module_device(module)
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


def bucket_limits(bucket_cap_mb_list) -> list[int] | None:
    """Per-bucket caps in bytes from ``bucket_cap_mb_list``, or None when it is not given."""
    if not bucket_cap_mb_list:
        return None
    if not all(isinstance(cap, (int, float)) and cap > 0 for cap in bucket_cap_mb_list):
        raise ValueError(f"bucket_cap_mb_list must hold positive numbers of MiB, got {bucket_cap_mb_list!r}")
    return [int(cap * (1 << 20)) for cap in bucket_cap_mb_list]
