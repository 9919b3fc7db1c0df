"""State transfer: rank 0 sends a joiner the training state by broadcast over gradsync's transport.

What travels (nothing is pickled: a text descriptor, one float64 vector of numbers, raw tensors)
    descriptor   utf-8 lines, as a uint8 tensor after its int64 length:
                     "state <param index> <key> tensor <dtype> <d0,d1,...> <where>"
                                                   optimizer state tensor; where: "param" (on its
                                                   parameter's device: Adam's moments) or "cpu"
                                                   (Adam's step count, a CPU scalar beside CUDA moments)
                     "state <param index> <key> number <int|float|bool>"      optimizer state number
                     "state <param index> <key> none"
                     "number <section> <key> <int|float|bool>"                 a number of a section
                 sections: "step" (LiveDDP.step), "live" (LiveDDP's own: the size the job started
                 with, the floor), "progress" (the sampler position, epoch), "shared"
                 (the caller's other numbers: the batch policy's global batch and learning rate),
                 "group<i>" (optimizer.param_groups[i]'s numbers: lr, momentum, ...)
    numbers      every "number" of the descriptor, in its order, as float64 (ints exact below 2**53)
    tensors      the module's parameters and buffers in module order, then each optimizer state
                 tensor in descriptor order

Every rank of the world takes part (a broadcast from rank 0); only the ranks that asked for the
state (``receive=True``) apply it, the others drop what they receive (it equals what they hold).
Every rank receives each tensor where rank 0 holds it: on its own parameter's device (its own GPU)
or on the CPU, so that every rank stages the same tensors through host memory (a CUDA broadcast is
staged, and staging allocates its shared regions collectively: comm/host_staging.py), and the
receivers' optimizer state lies where their parameters are.
Cost: one broadcast of the model plus its optimizer state, M bytes each way per receiving rank
(ring/tree broadcast: comm/broadcast.py).
"""

from __future__ import annotations

import torch
from torch import nn

from gradsync.comm.collectives import broadcast

NUMBER_TYPES = {"int": int, "float": float, "bool": bool}


def _number_type(value) -> str | None:
    kind = type(value).__name__
    return kind if kind in NUMBER_TYPES else None


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in the order its state_dict numbers them."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _describe(optimizer: torch.optim.Optimizer, sections: dict[str, dict]) -> tuple[list[str], list[float],
                                                                                     list[torch.Tensor]]:
    """Rank 0: descriptor lines, numbers, optimizer state tensors (module docstring)."""
    lines, numbers, tensors = [], [], []
    for index, entries in optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                shape = ",".join(map(str, value.shape))
                where = "cpu" if value.device.type == "cpu" else "param"
                lines.append(f"state {index} {key} tensor {str(value.dtype).removeprefix('torch.')} {shape} {where}")
                tensors.append(value)
            elif _number_type(value):
                lines.append(f"state {index} {key} number {_number_type(value)}")
                numbers.append(float(value))
            elif value is None:
                lines.append(f"state {index} {key} none")
            else:
                raise RuntimeError(f"optimizer state {index}/{key} is a {type(value).__name__}: the state transfer "
                                   f"sends tensors, numbers and None")
    for name, values in sections.items():
        for key, value in values.items():
            if _number_type(value):
                lines.append(f"number {name} {key} {_number_type(value)}")
                numbers.append(float(value))
    return lines, numbers, tensors


def _sections(optimizer: torch.optim.Optimizer, step: int, progress: dict, shared: dict,
              live: dict) -> dict[str, dict]:
    groups = {f"group{i}": group for i, group in enumerate(optimizer.param_groups)}
    return {"step": {"step": step}, "live": live, "progress": progress, "shared": shared, **groups}


def state_tensor(words: list[str], params: list[torch.Tensor]) -> torch.Tensor:
    """An empty tensor for a descriptor line "state <i> <key> tensor <dtype> <dims> <where>", on this
    rank's parameter i's device ("param") or the CPU ("cpu")."""
    index, dtype = int(words[1]), getattr(torch, words[4])
    dims = tuple(int(d) for d in words[5].split(",") if d)
    device = params[index].device if words[6] == "param" else torch.device("cpu")
    return torch.empty(dims, dtype=dtype, device=device)


def _carries_number(words: list[str]) -> bool:
    return words[0] == "number" or (words[0] == "state" and words[3] == "number")


def _broadcast_all(tensor: torch.Tensor) -> None:
    if tensor.numel():
        broadcast(tensor.view(-1), src=0)


def _broadcast_text(lines: list[str] | None) -> list[str]:
    length = torch.zeros(1, dtype=torch.int64)
    data = "\n".join(lines).encode() if lines is not None else b""
    length[0] = len(data)
    broadcast(length, src=0)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if lines is not None
              else torch.empty(int(length[0]), dtype=torch.uint8))
    if buffer.numel():
        broadcast(buffer, src=0)
    return bytes(buffer.numpy()).decode().split("\n") if buffer.numel() else []


def share_state(rank: int, module: nn.Module, optimizer: torch.optim.Optimizer, step: int, progress: dict,
                shared: dict, receive: bool, live: dict | None = None) -> int:
    """Collective: rank 0's parameters, buffers, optimizer state, ``step``, ``progress``, ``shared`` and
    ``live`` reach every rank; a rank with ``receive`` takes them over (``progress``, ``shared`` and
    ``live`` updated in place) and gets rank 0's step as the return value (the others their own ``step``)."""
    sections = _sections(optimizer, step, progress, shared, {} if live is None else live)
    lines, numbers, state_tensors = _describe(optimizer, sections) if rank == 0 else (None, [], [])
    lines = _broadcast_text(lines)
    count = sum(1 for line in lines if _carries_number(line.split(" ")))
    values = torch.tensor(numbers, dtype=torch.float64) if rank == 0 else torch.zeros(count, dtype=torch.float64)
    _broadcast_all(values)
    # parameters and buffers: in place where this rank takes them over, into scratch elsewhere
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            _broadcast_all(t.data if receive or rank == 0 else torch.empty_like(t))
    state: dict[int, dict] = {}
    params = _params(optimizer)
    received_tensors = iter(state_tensors)
    numbers_left = iter(values.tolist())
    for line in lines:
        words = line.split(" ")
        if words[0] == "state":
            index, key, kind = int(words[1]), words[2], words[3]
            if kind == "tensor":
                tensor = next(received_tensors).contiguous() if rank == 0 else state_tensor(words, params)
                _broadcast_all(tensor)
                value = tensor
            elif kind == "number":
                value = NUMBER_TYPES[words[4]](next(numbers_left))
            else:
                value = None
            state.setdefault(index, {})[key] = value
        else:
            name, key, kind = words[1], words[2], words[3]
            value = NUMBER_TYPES[kind](next(numbers_left))
            if receive:
                sections[name][key] = value
    if not receive:
        return step
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    return sections["step"]["step"]
