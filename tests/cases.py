"""Functions the test worlds run on every rank (module level, so child processes can import them)."""

import torch

import gradsync as gs


def contribution(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank r contributes (r+1) * (1 + i mod 3) at element i: small integers, exact in every dtype."""
    pattern = 1 + torch.arange(numel) % 3
    return (pattern * (rank + 1)).to(dtype)


def expected_sum(world_size: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Closed form: sum over r of (r+1) * (1 + i mod 3) = N(N+1)/2 * (1 + i mod 3)."""
    return ((1 + torch.arange(numel) % 3) * (world_size * (world_size + 1) // 2)).to(dtype)


def all_reduce_case(numel: int, dtype: torch.dtype, op: str, algorithm: str, repeats: int = 2):
    """Ours (twice in a row) next to torch.distributed's own all_reduce on the same input."""
    w = gs.world()
    ours = []
    for _ in range(repeats):
        t = contribution(w.rank, numel, dtype)
        gs.all_reduce(t, op=op, algorithm=algorithm)
        ours.append(t)
    reference = contribution(w.rank, numel, dtype)
    if w.world_size > 1 and numel > 0 and dtype != torch.bfloat16:  # gloo has no bfloat16 sum
        torch.distributed.all_reduce(reference)
    else:
        reference = expected_sum(w.world_size, numel, dtype)
    if op == "avg":
        reference = reference / w.world_size
    return ours, reference


def scatter_gather_case(numel: int, dtype: torch.dtype, op: str):
    w = gs.world()
    shard = gs.reduce_scatter(contribution(w.rank, numel, dtype), op=op)
    full = gs.all_gather(shard)
    again = gs.all_gather(gs.reduce_scatter(contribution(w.rank, numel, dtype), op=op))
    direct = gs.all_reduce(contribution(w.rank, numel, dtype), op=op, algorithm="ring")
    return shard.numel(), full, again, direct


def traffic_case(numel: int, dtype: torch.dtype, algorithm: str):
    w = gs.world()
    t = contribution(w.rank, numel, dtype)
    gs.traffic_reset()
    gs.all_reduce(t, algorithm=algorithm)
    return gs.traffic()


def broadcast_case(shape: tuple, src: int, transpose: bool):
    w = gs.world()
    t = torch.full(shape, float(w.rank)) + torch.arange(shape[-1])
    if transpose:
        t = t.t()
    gs.broadcast(t, src=src)
    return t


def raise_on(rank: int, fn, *args):
    if gs.world().rank == rank:
        return fn(*args)
    return None


def mismatched_all_reduce(kind: str, algorithm: str):
    """Rank 1 disagrees with the others about the tensor's size or dtype."""
    w = gs.world()
    numel, dtype = 12, torch.float32
    if w.rank == 1:
        numel, dtype = (13, dtype) if kind == "size" else (numel, torch.int32)
    gs.all_reduce(torch.ones(numel, dtype=dtype), algorithm=algorithm)


def any_source_case():
    """Rank 0 receives one message from every other rank without naming the sender."""
    from gradsync.comm.transport import default_transport
    w, transport = gs.world(), default_transport()
    if w.rank != 0:
        transport.isend(torch.full((3,), float(w.rank)), 0, "test/any").wait()
        return None
    seen = {}
    for _ in range(w.world_size - 1):
        buf = torch.empty(3)
        source = transport.irecv(buf, None, "test/any").wait()
        seen[source] = buf
    return seen, gs.traffic()["per_peer"]


def transport_kind() -> str:
    """The class of the transport this rank's collectives use."""
    from gradsync.comm.transport import default_transport
    return type(default_transport()).__name__
