"""CUDA tensors through host memory (comm/host_staging.py) and the choice of path (device_path.py).

Without a GPU: the choice from every rank's GPU as a table, and the staging path's copies and
bookkeeping run on CPU tensors (GRADSYNC_HOST_STAGING=cpu): every collective against the closed
form, the meter's staged bytes against their count, DDP and ZeRO-1 against one process with the
global batch. With a GPU (marker ``cuda``, skipped here): the same with 2, 3 and 4 ranks sharing
cuda:0, torch's DDP on the "gradsync" backend against gloo's, and no NCCL communicator made.
"""

from datetime import timedelta

import pytest
import torch

import staging_fns
from gradsync.group import device_path

STAGE_CPU = {"GRADSYNC_HOST_STAGING": "cpu"}


# -- the choice -----------------------------------------------------------------------------------
def test_the_path_follows_the_ranks_gpus():
    own, shared = ["h#a", "h#b", "g#a"], ["h#a", "h#b", "h#a", "h#c"]
    assert device_path.choose(None, None, "auto", True) == (None, "gloo")
    assert device_path.choose(own, None, "auto", True) == ("nccl", "cpu:gloo,cuda:nccl")
    assert device_path.choose(shared, None, "auto", True) == ("host", "gloo")
    assert device_path.choose(own, None, "auto", False) == ("host", "gloo")          # no NCCL in this torch
    assert device_path.choose(own, None, "host", True) == ("host", "gloo")
    assert device_path.choose(own, None, "auto", True, live=True) == ("host", "gloo")
    assert device_path.choose(own, "gloo", "auto", True) == ("host", "gloo")         # the program asked for gloo
    assert device_path.choose(own, "nccl", "auto", True) == ("nccl", "cpu:gloo,cuda:nccl")   # CPU traffic on gloo
    assert device_path.choose(own, "cpu:gloo,cuda:nccl", "auto", True) == ("nccl", "cpu:gloo,cuda:nccl")
    assert device_path.choose(["h#a", None, "h#c"], None, "auto", True) == ("host", "gloo")   # a rank with none
    assert device_path.sharing(shared) == [[0, 2]]
    assert device_path.sharing(["h#a", None, None, "h#a"]) == [[0, 3]]   # ranks with no GPU share nothing


def test_init_with_backend_nccl_keeps_a_cpu_backend(monkeypatch):
    # gradsync's own traffic (the transport between hosts, the parameter server) is CPU tensors: "nccl"
    # alone would leave them no backend, so init() asks torch for "cpu:gloo,cuda:nccl"
    from gradsync.group import runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runtime._resolve_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert runtime._resolve_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert runtime._resolve_backend("gloo") == "gloo"


def test_a_rank_without_a_gpu_publishes_and_touches_no_cuda(monkeypatch):
    # a rank that sees no GPU, or one that set none up before init() (--device cpu on a GPU machine),
    # publishes "none" without asking CUDA which GPU it has (which opens a context), so the others do
    # not wait for it; the world then takes the host path, and asking for NCCL names the rank
    store = torch.distributed.HashStore()
    store.set_timeout(timedelta(seconds=2))
    store.set("gradsync/gpu/1", "h#gpu-b")   # rank 1 has a GPU of its own
    assert device_path.settle(store, 0, 2, 5.0, None) == (None, "gloo")
    assert store.get("gradsync/gpu/0") == b"none"

    def no_context(*_):
        raise AssertionError("asked CUDA for this rank's GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(device_path, "gpu_identity", no_context)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    store = torch.distributed.HashStore()
    store.set("gradsync/gpu/1", "h#gpu-b")
    assert device_path.settle(store, 0, 2, 5.0, None) == ("host", "gloo")
    assert store.get("gradsync/gpu/0") == b"none"
    with pytest.raises(RuntimeError, match="rank 0 set up no GPU before init"):
        device_path.choose([None, "h#gpu-b"], "cpu:gloo,cuda:nccl", "auto", True)


def test_a_live_world_stays_on_the_host_path(monkeypatch):
    # mark_live() (gs.spawn's live ranks; a live program under torchrun calls it before init) makes
    # init() choose as a rejoin does: the host path, and NCCL refused
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(device_path, "gpu_identity", lambda: "h#gpu-a")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(device_path, "_LIVE", [False])
    store = torch.distributed.HashStore()
    store.set("gradsync/gpu/1", "h#gpu-b")
    assert device_path.settle(store, 0, 2, 5.0, None) == ("nccl", "cpu:gloo,cuda:nccl")
    device_path.mark_live()
    assert device_path.settle(store, 0, 2, 5.0, None) == ("host", "gloo")


@pytest.mark.parametrize("backend,wanted", [(None, "nccl"), ("nccl", "auto"), ("cpu:gloo,cuda:nccl", "auto")])
def test_nccl_where_ranks_share_a_gpu_is_refused_naming_them(backend, wanted):
    with pytest.raises(RuntimeError, match="ranks 0 and 2 share a GPU"):
        device_path.choose(["h#a", "h#b", "h#a"], backend, wanted, True)
    with pytest.raises(RuntimeError, match="live fault tolerance runs on host staging"):
        device_path.choose(["h#a", "h#b"], backend, wanted, True, live=True)


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv("GRADSYNC_CUDA_PATH", "pcie")
    with pytest.raises(ValueError, match="choose one of auto, host, nccl"):
        device_path.requested()
    monkeypatch.setenv("GRADSYNC_HOST_STAGING", "gpu")
    with pytest.raises(ValueError, match="give cpu"):
        device_path.stage_cpu_tensors()


# -- the staging path on CPU tensors ---------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_collective_through_the_staging_copies(world_of, world_size):
    numels, dtypes = [0, 1, world_size + 1, 1000, 70_001], [torch.float32, torch.float64, torch.bfloat16, torch.int64]
    pool = world_of(world_size, **STAGE_CPU)
    assert pool.run(staging_fns.world_path) == [(None, "gloo", True)] * world_size
    for rank, (wrong, to_host, to_device) in enumerate(pool.run(staging_fns.every_collective, numels, dtypes)):
        assert wrong == [], (rank, wrong)
        # per call: all_reduce M in and out, reduce_scatter M in and its shard out, all_gather the shard
        # in and M out, broadcast M in and out, and on floats a max all-reduce M in and out
        counted = 0
        for dtype in dtypes:
            size = torch.empty((), dtype=dtype).element_size()
            for numel in numels:
                shard = numel // world_size + (rank < numel % world_size)
                counted += 2 * size * (3 * numel + shard + (numel if dtype.is_floating_point else 0))
        assert to_host == to_device == counted, (rank, to_host, to_device, counted)


@pytest.mark.timeout(300)
def test_ddp_and_zero1_through_the_staging_copies_equal_one_process(world_of):
    pool = world_of(3, **STAGE_CPU)
    reference = staging_fns.one_process_steps(3, 10, 4)
    for params in pool.run(staging_fns.ddp_steps, 10, 4):
        for got, want in zip(params, reference):
            assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)
    reference = staging_fns.one_process_adam(3, 10, 4)
    for params in pool.run(staging_fns.zero1_steps, 10, 4):
        for got, want in zip(params, reference):
            assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)


# -- on a GPU -----------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_overlapped_staging_equals_synchronous_staging_bit_for_bit(world_of):
    # GRADSYNC_STAGING_MODE=sync synchronizes the device around every copy (obviously right); the
    # overlapped default orders them by events alone: every collective, hook and backend operation
    # must give the same bytes (a copy that raced its producer would not)
    overlap = world_of(2).run(staging_fns.staged_digests, case_timeout=240)
    sync = world_of(2, GRADSYNC_STAGING_MODE="sync").run(staging_fns.staged_digests, case_timeout=240)
    for rank, (ours, reference) in enumerate(zip(overlap, sync)):
        assert ours == reference, (rank, [i for i, (a, b) in enumerate(zip(ours, reference)) if a != b])


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_sharing_a_gpu_run_every_collective_through_the_host(world_of, world_size):
    pool = world_of(world_size)
    assert pool.run(staging_fns.world_path) == [("host", "gloo", False)] * world_size
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
    for rank, (wrong, to_host, to_device) in enumerate(
            pool.run(staging_fns.every_collective, [0, 1, world_size + 1, 1000, 300_001], dtypes)):
        assert wrong == [], (rank, wrong)
        assert to_host > 0 and to_device > 0
    assert pool.run(staging_fns.nccl_communicators_made) == [False] * world_size


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_and_zero1_on_a_shared_gpu_equal_one_process(world_of, world_size):
    pool = world_of(world_size)
    reference = staging_fns.one_process_steps(world_size, 10, 4)
    for params in pool.run(staging_fns.ddp_steps, 10, 4):
        for got, want in zip(params, reference):
            assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)
    reference = staging_fns.one_process_adam(world_size, 10, 4)
    for params in pool.run(staging_fns.zero1_steps, 10, 4):
        for got, want in zip(params, reference):
            assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_torch_ddp_on_the_gradsync_backend_with_a_cuda_module_equals_gloo(world_of):
    pool = world_of(2)
    ours = pool.run(staging_fns.torch_ddp_on_the_backend, "gradsync", 10, 4)
    gloo = pool.run(staging_fns.torch_ddp_on_the_backend, "gloo", 10, 4)
    for mine, theirs in zip(ours, gloo):
        for got, want in zip(mine, theirs):
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(600)
def test_the_main_job_through_the_staging_copies_ends_on_the_same_bits(world_of, tmp_path):
    # every strategy's collectives (buckets, PowerSGD's factors, ZeRO-1's shards, DiLoCo's outer
    # average, the evaluation) through host staging's copies on CPU tensors: with 2 ranks every sum
    # is the same two numbers in either order, so the parameters must equal the unstaged run's bit
    # for bit
    configs = [{"strategy": "ddp", "compress": "powersgd"}, {"strategy": "zero1"},
               {"strategy": "diloco", "sync_every": 3}, {"strategy": "ddp", "compress": "bf16"}]
    staged, plain = world_of(2, **STAGE_CPU), world_of(2)
    for index, config in enumerate(configs):
        config = {**config, "steps": 7, "seed": 3}
        ours = staged.run(staging_fns.train_digest, config, str(tmp_path / f"staged{index}"), case_timeout=300)
        theirs = plain.run(staging_fns.train_digest, config, str(tmp_path / f"plain{index}"), case_timeout=300)
        assert [r[:2] for r in ours] == [r[:2] for r in theirs], (config, ours, theirs)
        assert ours[0][0] == ours[1][0], (config, "replicas differ")
        assert all(r[2] > 0 for r in ours) and all(r[2] == 0 for r in theirs), (config, "staged bytes", ours, theirs)


@pytest.mark.multigpu
@pytest.mark.timeout(300)
def test_ranks_with_a_gpu_each_run_on_nccl_with_the_cpu_results(world_of):
    # two ranks, each bound to a GPU of its own before init (GRADSYNC_BIND_GPU, as gradsync train
    # --device cuda sets it): the world settles on NCCL, algorithm="auto" runs NCCL's own
    # all-reduce, and every collective and DDP equal the CPU's results and one process
    pool = world_of(2, GRADSYNC_BIND_GPU="1")
    assert pool.run(staging_fns.world_path) == [("nccl", "cpu:gloo,cuda:nccl", False)] * 2
    dtypes = [torch.float32, torch.float64, torch.int64]
    for rank, (wrong, to_host, to_device) in enumerate(
            pool.run(staging_fns.every_collective, [0, 1, 3, 1000, 300_001], dtypes)):
        assert wrong == [], (rank, wrong)
        assert to_host == to_device == 0   # nothing staged through the host
    reference = staging_fns.one_process_steps(2, 10, 4)
    for params in pool.run(staging_fns.ddp_steps, 10, 4):
        for got, want in zip(params, reference):
            assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.multigpu
@pytest.mark.timeout(300)
def test_nccl_point_to_point_past_its_buffers_and_the_bitwise_reductions(world_of):
    # 64 MiB messages: each step's send and receive posted as one NCCL group (else both ranks of a pair
    # wait in their sends); BOR staged through the host, NCCL having none
    pool = world_of(2, GRADSYNC_BIND_GPU="1")
    assert pool.run(staging_fns.past_nccls_buffers, 1 << 24, case_timeout=240) == [[], []]
