"""init/world/shutdown in this process (a world of one) and their errors."""

import pytest
import torch

import gradsync as gs


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    yield
    gs.shutdown()


def test_world_of_one_by_default():
    w = gs.init(timeout=5)
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size) == (0, 1, 0, 1)
    assert gs.world() is w and w.backend == "gloo" and w.timeout == 5.0
    t = torch.arange(5.0)
    assert torch.equal(gs.all_reduce(t, op="avg"), torch.arange(5.0))


def test_reads_torchrun_environment(monkeypatch):
    from gradsync.group.runtime import free_port
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    w = gs.init()
    assert w.world_size == 1 and w.timeout == 60.0


def test_init_twice_same_is_fine_different_raises():
    first = gs.init(timeout=5)
    assert gs.init(timeout=5) is first
    with pytest.raises(RuntimeError, match="already called with .*timeout=5.0.*now called with .*timeout=7.0"):
        gs.init(timeout=7)


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 0, "rank": 0}, "world_size must be an integer >= 1"),
    ({"world_size": 2, "rank": 2, "master_port": 1}, r"rank must satisfy 0 <= rank < world_size=2"),
    ({"world_size": 2}, "rank was not"),
    ({"timeout": 0}, "timeout must be a positive number"),
    ({"backend": "mpi"}, "unknown backend 'mpi'"),
    ({"world_size": 2, "rank": 0}, "needs MASTER_PORT"),
])
def test_bad_init_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gs.init(**kwargs)


def test_world_before_init_is_a_clear_error():
    with pytest.raises(RuntimeError, match="not initialised"):
        gs.world()
    with pytest.raises(RuntimeError, match="not initialised"):
        gs.all_reduce(torch.ones(3))


def test_bad_collective_arguments_in_a_world_of_one():
    gs.init(timeout=5)
    with pytest.raises(ValueError, match="unknown algorithm 'fastest'; choose one of auto, ring"):
        gs.all_reduce(torch.ones(3), algorithm="fastest")
    with pytest.raises(ValueError, match="unknown op 'mean'; choose one of sum, avg, product, max, min, band, bor, bxor"):
        gs.all_reduce(torch.ones(3), op="mean")
    with pytest.raises(TypeError, match="op='avg' needs a floating dtype"):
        gs.all_reduce(torch.ones(3, dtype=torch.int64), op="avg")
    with pytest.raises(TypeError, match="op='bxor' is a bitwise operation and needs an integer or bool dtype, got float32"):
        gs.all_reduce(torch.ones(3), op="bxor")
    with pytest.raises(TypeError, match="dtype complex64 is not supported; use one of float32, .*, bool, uint8, int8"):
        gs.all_reduce(torch.ones(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="needs a torch.Tensor"):
        gs.all_reduce([1.0, 2.0])
    with pytest.raises(ValueError, match="src must be a rank in 0..0"):
        gs.broadcast(torch.ones(3), src=1)


def test_a_program_that_remakes_its_world_gets_gradsync_rejoined(monkeypatch):
    """A world of one that the program makes, uses through gradsync, destroys and makes again:
    gradsync joins each (a joined World never outlives the group it joined)."""
    import torch.distributed as dist

    from gradsync.group.runtime import free_port

    for attempt in range(2):
        store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        t = torch.full((3,), 2.0)
        gs.all_reduce(t, op="max")  # joins the program's world on first use
        assert gs.world().joined and torch.equal(t, torch.full((3,), 2.0))
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="not initialised"):
        gs.world()  # the program's world is gone, and gradsync left with it


def test_joining_takes_the_programs_rank_size_and_timeout_and_leaves_its_group():
    import datetime

    import torch.distributed as dist

    from gradsync.group.runtime import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=77))
    try:
        w = gs.init()
        assert (w.rank, w.world_size, w.timeout, w.backend, w.joined) == (0, 1, 77.0, "gloo", True)
        assert gs.init() is w  # a second init() in the same joined world is the same World
        with pytest.raises(RuntimeError, match="contradicts the torch.distributed world"):
            gs.init(backend="nccl")
        gs.shutdown()
        assert dist.is_initialized()  # the program's group is the program's to destroy
    finally:
        gs.shutdown()
        dist.destroy_process_group()
