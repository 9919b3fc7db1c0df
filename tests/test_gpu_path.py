"""The GPU path's decisions, where a CPU can show them (docs/gpus.md: what a GPU run still has to show).

    NCCL's point-to-point   the ring and halving-doubling's exchanges posted as one group where
                            messages travel on NCCL (nccl_model.py: a model of its in-order, unbuffered
                            streams in which the other orders deadlock), their results against the
                            closed form; the bitwise reductions NCCL lacks staged through the host
    between hosts           a CUDA tensor never goes to the second (gloo) group of the TCP transport
    single-copy reads       a tensor the kernel will not read where it lies (pinned memory a driver
                            mapped as device memory) turns both single-copy collectives into their
                            staged twins on every rank, with the same results
    live state transfer     a joiner receives each optimizer state tensor where rank 0 holds it (its
                            own parameter's device, or the CPU), so every rank stages the same tensors
    the host path's check   "no NCCL made" asked of the group's backend for CUDA, not of whether it has one
"""

import mmap
from types import SimpleNamespace

import pytest
import torch

import gpu_path_fns
import staging_fns
from cases import contribution, expected_sum
from nccl_model import run_ranks
from gradsync.comm import collectives
from gradsync.comm.context import CommContext
from gradsync.comm.allreduce_halving_doubling import allreduce_halving_doubling
from gradsync.comm.allreduce_ring import all_gather_ring, allreduce_ring, reduce_scatter_ring, ring_chunks
from gradsync.comm.broadcast import broadcast_binomial
from gradsync.comm.transport.shm import single_copy
from gradsync.comm.transport.torch_distributed import TorchTransport


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is a CUDA tensor: what the decisions below look at."""

    @property
    def is_cuda(self):
        return True


# -- NCCL's point-to-point ------------------------------------------------------------------------
def _ring_reduce_scatter(numel: int):
    def job(transport):
        flat = contribution(transport.rank, numel, torch.float64)
        chunks = reduce_scatter_ring(flat, transport, "rs", segment_bytes=64)   # several segments a chunk
        return chunks.view(flat, transport.rank).clone()
    return job


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_pipelined_ring_deadlocks_on_unbuffered_in_order_streams(world_size):
    # the model is worth its name: the ring as gloo and shared memory run it (each rank's sends posted
    # before its receives) waits for ever there, as it would on NCCL past its buffers
    with pytest.raises(TimeoutError, match="a deadlock"):
        run_ranks(world_size, False, _ring_reduce_scatter(100), timeout=1.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_paired_exchanges_end_with_the_closed_form(world_size):
    for numel in (0, 1, world_size - 1, 100, 1001):
        want = expected_sum(world_size, numel, torch.float64)
        chunks = ring_chunks(numel, world_size)
        shards = run_ranks(world_size, True, _ring_reduce_scatter(numel))
        for rank, shard in enumerate(shards):
            assert torch.equal(shard, chunks.view(want, rank)), (world_size, numel, rank)

        def gather(transport, numel=numel):
            full = torch.zeros(numel, dtype=torch.float64)
            chunks.view(full, transport.rank).copy_(chunks.view(want, transport.rank))
            all_gather_ring(full, chunks, transport, "ag")
            return full
        assert all(torch.equal(full, want) for full in run_ranks(world_size, True, gather)), (world_size, numel)

        for algorithm in (allreduce_ring, allreduce_halving_doubling):
            def reduce(transport, numel=numel, algorithm=algorithm):
                flat = contribution(transport.rank, numel, torch.float64)
                algorithm(flat, transport)
                return flat
            assert all(torch.equal(t, want) for t in run_ranks(world_size, True, reduce)), (algorithm, numel)

        def broadcast(transport, numel=numel):   # one-way messages down a tree: in order is enough
            flat = contribution(transport.rank, numel, torch.float64)
            broadcast_binomial(flat, world_size - 1, transport)
            return flat
        for flat in run_ranks(world_size, False, broadcast):
            assert torch.equal(flat, contribution(world_size - 1, numel, torch.float64))


def test_bitwise_reductions_of_cuda_tensors_on_nccl_are_staged():
    # NCCL has no BAND, BOR or BXOR: a CUDA tensor of a world on NCCL goes through host staging for
    # them (the CPU algorithms have them) and to NCCL for the rest
    place = SimpleNamespace(world=SimpleNamespace(cuda_path="nccl", world_size=1),
                            transport=SimpleNamespace(context=CommContext()))
    on_gpu = torch.zeros(4, dtype=torch.int64).as_subclass(_OnGpu)
    for op in ("band", "bor", "bxor"):
        assert collectives._staging(place, on_gpu, op) is not None, op
    for op in ("sum", "avg", "max", "min", "product", None):
        assert collectives._staging(place, on_gpu, op) is None, op


def test_a_cuda_tensor_never_takes_the_gloo_group_between_hosts(monkeypatch):
    # across hosts, tag-0 messages to a lower rank take a second group, gloo's: it takes CPU tensors
    # only, so a CUDA tensor (NCCL) stays on the world's group whatever its direction
    transport = TorchTransport.__new__(TorchTransport)
    transport.world, transport.downward = SimpleNamespace(joined=False), "gloo, downward"
    monkeypatch.setattr("gradsync.comm.transport.torch_distributed.transfer_group", lambda world: "the world's")
    assert transport._group(torch.zeros(2), 3, 1, 0) == "gloo, downward"
    assert transport._group(torch.zeros(2).as_subclass(_OnGpu), 3, 1, 0) == "the world's"
    assert transport._group(torch.zeros(2).as_subclass(_OnGpu), 1, 3, 0) == "the world's"


# -- single-copy reads ------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_readable_says_no_where_the_kernel_cannot_read_the_pages():
    # process_vm_readv refuses (EFAULT) pages it cannot pin; PROT_NONE pages stand in for a driver's
    # device-memory mapping here (the tensor over them is never touched, only its address read)
    assert single_copy.readable(torch.arange(100_000, dtype=torch.float64))
    assert single_copy.readable(torch.empty(0))
    untouchable = mmap.mmap(-1, 1 << 16, prot=0)   # PROT_NONE
    verdict = single_copy.readable(torch.frombuffer(untouchable, dtype=torch.uint8))
    assert verdict is False, "readable() said yes to pages the kernel cannot read"   # (no tensor repr: it would read them)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("unreadable", [0, 2])
def test_a_tensor_that_cannot_be_read_where_it_lies_is_staged_on_every_rank(world_of, unreadable):
    pool = world_of(3)
    results = pool.run(gpu_path_fns.single_copy_with_an_unreadable_rank, unreadable, 200_000)
    if not results[0][0]:
        pytest.skip("single-copy reads are off on this machine (the kernel refuses process_vm_readv)")
    for rank, (_, right) in enumerate(results):
        assert right == [True] * 4, (rank, right)


# -- the live state transfer ------------------------------------------------------------------------
def test_a_joiner_receives_each_state_tensor_where_rank_0_holds_it():
    # rank 0's moments lie on its parameter's device (here "meta" stands in for a GPU), Adam's step
    # count on the CPU: a joiner allocates each where its own parameter and rank 0 put them, so every
    # rank's broadcasts are staged alike (a CUDA one is; staging's regions are allocated by every rank)
    from gradsync.live.transfer import _describe, state_tensor

    on_device, on_cpu = torch.nn.Parameter(torch.empty(3, 2, device="meta")), torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.Adam([on_device, on_cpu])
    optimizer.state[on_device] = {"exp_avg": torch.empty(3, 2, device="meta"), "step": torch.tensor(5.0)}
    optimizer.state[on_cpu] = {"exp_avg": torch.zeros(4, dtype=torch.float64)}
    lines, _, tensors = _describe(optimizer, {})
    joiners = [on_device, on_cpu]   # the joiner's own parameters, on the same devices
    received = [state_tensor(line.split(" "), joiners) for line in lines if line.split(" ")[3] == "tensor"]
    assert [(t.device, t.dtype, t.shape) for t in received] == [(t.device, t.dtype, t.shape) for t in tensors]


# -- the host path's check ----------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_gloo_world_sends_no_cuda_tensor_to_nccl(world_of):
    # gloo is registered for CUDA tensors too: the check asks which backend takes them
    assert world_of(2).run(staging_fns.nccl_communicators_made) == [False, False]
