"""A parameter server's state, whole, and cut again for another number of servers (checkpoints).

Vocabulary
    S, S'     servers that wrote the state, servers that load it
    part      what one server holds (Server.part): its flat dense shard, its torch optimizer's state
              over that shard, its block of every sparse table with the block's sparse-rule state,
              the version and every worker's clock
    whole     the same state with no trace of S (whole_state): every dense parameter whole, every
              optimizer-state tensor of the shard as one tensor per dense parameter, every table
              and every per-row state tensor whole; plain numbers (Adam's step, the sparse rule's
              t, the version, the clocks) once, since every server holds the same ones

From parts to whole, for server s of S (its pieces from plan_shards(numels, S), sharding.py):
    dense   scatter_shard(shard_s, pieces_s, params)        each element has exactly one owner
    state   the same for every state tensor of the shard's size (momentum, exp_avg, exp_avg_sq, sum)
    tables  whole[s::S] = block_s                            (row r on server r mod S, row_sharding.py)
From whole to the part of server s' of S' (Server.load_part): gather_shard(whole, pieces'_s') and
whole[s'::S'], the inverse maps. Every optimizer here is element-wise on the flat shard (the dense
ones torch runs per element, the sparse rules per row), so an element's update does not depend on
which server holds it: a state re-cut for S' continues exactly as it would have on S.

Workers are not re-cut: each worker's data shard and clock belong to it, so W' must equal W.
"""

from __future__ import annotations

import torch

from gradsync.ps.sharding import gather_shard, plan_shards, scatter_shard


def _is_per_element(value, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel and numel > 0


def whole_state(parts: list[dict], numels: list[int], shapes: list[tuple]) -> dict:
    """The whole state from the S servers' ``parts`` (in server order); ``numels`` and ``shapes``
    of the dense parameters in model order."""
    servers = len(parts)
    plan = plan_shards(numels, servers)
    dtype = next((p["shard"].dtype for p in parts), torch.float32)
    params = [torch.zeros(shape, dtype=dtype) for shape in shapes]
    dense_state: dict[str, object] = {}
    for part, pieces in zip(parts, plan.pieces):
        scatter_shard(part["shard"], pieces, params)
        for key, value in part["dense_state"].items():
            if _is_per_element(value, part["shard"].numel()):
                target = dense_state.setdefault(key, [torch.zeros(shape, dtype=value.dtype) for shape in shapes])
                scatter_shard(value, pieces, target)
            else:
                dense_state.setdefault(key, value)
    tables = {}
    for name in parts[0]["tables"]:
        blocks = [part["tables"][name] for part in parts]
        rows = sum(b["block"].shape[0] for b in blocks)
        table = {"rows": _interleave([b["block"] for b in blocks], rows), "t": blocks[0]["t"],
                 "state": {key: _interleave([b["state"][key] for b in blocks], rows) for key in blocks[0]["state"]}}
        tables[name] = table
    first = parts[0]
    return {"servers": servers, "version": first["version"], "clocks": list(first["clocks"]), "params": params,
            "dense_state": dense_state, "param_groups": first["param_groups"], "tables": tables}


def _interleave(blocks: list[torch.Tensor], rows: int) -> torch.Tensor:
    """The whole table from the blocks of rows s, s+S, ... (block s holds whole[s::S])."""
    whole = torch.empty((rows, *blocks[0].shape[1:]), dtype=blocks[0].dtype)
    for server, block in enumerate(blocks):
        whole[server::len(blocks)] = block
    return whole


def dense_part(whole: dict, pieces: list, numel: int) -> tuple[torch.Tensor, dict]:
    """(flat shard, optimizer state over it) of a server that owns ``pieces`` (``numel`` elements)."""
    dtype = whole["params"][0].dtype if whole["params"] else torch.float32
    shard = gather_shard(whole["params"], pieces, torch.empty(numel, dtype=dtype))
    state = {}
    for key, value in whole["dense_state"].items():
        if isinstance(value, list):
            state[key] = gather_shard(value, pieces, torch.empty(numel, dtype=value[0].dtype))
        else:
            state[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return shard, state


def table_part(table: dict, server: int, servers: int) -> dict:
    """A table's block and per-row state on server ``server`` of ``servers``."""
    return {"block": table["rows"][server::servers].clone(), "t": table["t"],
            "state": {key: value[server::servers].clone() for key, value in table["state"].items()}}
