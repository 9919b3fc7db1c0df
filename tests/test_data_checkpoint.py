"""DistributedSampler against torch's own sampler, and checkpoints that are whole or refused."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import gradsync as gs
from gradsync import checkpoint


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 200), replicas=st.integers(1, 9), shuffle=st.booleans(), drop_last=st.booleans(),
       seed=st.integers(0, 5), epoch=st.integers(0, 3))
def test_sampler_shards_are_disjoint_cover_and_equal_in_length(n, replicas, shuffle, drop_last, seed, epoch):
    dataset = list(range(n))
    if n < replicas:
        with pytest.raises(ValueError, match="fewer than the"):
            gs.DistributedSampler(dataset, num_replicas=replicas, rank=0)
        return
    shards = []
    for rank in range(replicas):
        s = gs.DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        shards.append(list(s))
    assert len({len(shard) for shard in shards}) == 1, "every rank must run the same number of steps"
    flat = [i for shard in shards for i in shard]
    if drop_last:
        assert len(set(flat)) == len(flat) == (n // replicas) * replicas
    else:
        assert set(flat) == set(range(n)), "every sample is seen each epoch"
        assert len(flat) - len(set(flat)) < replicas, "padding repeats fewer than R samples"
    if not shuffle:  # torch's sampler is an independent oracle for the deterministic order
        for rank in range(replicas):
            torch_shard = list(TorchSampler(dataset, num_replicas=replicas, rank=rank, shuffle=False, drop_last=drop_last))
            assert shards[rank] == torch_shard


def test_sampler_reshuffles_per_epoch_and_is_deterministic():
    s = gs.DistributedSampler(list(range(100)), num_replicas=2, rank=0, seed=3)
    s.set_epoch(0)
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first
    s.set_epoch(0)
    assert list(s) == first


def test_sampler_bad_arguments():
    with pytest.raises(ValueError, match="0 <= rank < num_replicas=2"):
        gs.DistributedSampler(list(range(10)), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas must be an integer >= 1"):
        gs.DistributedSampler(list(range(10)), num_replicas=0, rank=0)


def test_checkpoint_roundtrip_and_refusals(tmp_path):
    path = tmp_path / "ckpt.pt"
    state = {"w": torch.arange(10.0), "step": 7, "nested": {"m": torch.ones(2, 2)}}
    checkpoint.save(path, state)
    loaded = checkpoint.load(path)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    with pytest.raises(checkpoint.CheckpointError, match="truncated"):
        checkpoint.load(path)
    flipped = bytearray(data)
    flipped[-3] ^= 0x01
    path.write_bytes(bytes(flipped))
    with pytest.raises(checkpoint.CheckpointError, match="checksum"):
        checkpoint.load(path)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="bad header"):
        checkpoint.load(path)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        checkpoint.load(tmp_path / "missing.pt")


def test_interrupted_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, {"step": 1})

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(OSError):
        checkpoint.save(path, {"step": 2})
    assert checkpoint.load(path)["step"] == 1


@pytest.mark.timeout(120)
def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """A real SIGKILL while a 400 MB checkpoint is being written over a small one."""
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, {"step": 1, "w": torch.arange(5.0)})
    writer = subprocess.Popen([sys.executable, "-c", (
        "import torch; from gradsync import checkpoint; "
        f"checkpoint.save({str(path)!r}, {{'step': 2, 'w': torch.ones(100_000_000)}})")])
    started = time.monotonic()
    while not any(p.name.startswith(".ckpt.pt.tmp-") for p in tmp_path.iterdir()):   # the write has begun
        assert writer.poll() is None and time.monotonic() - started < 60, "the writer never started writing"
        time.sleep(0.01)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert writer.returncode == -signal.SIGKILL
    loaded = checkpoint.load(path)
    assert loaded["step"] == 1 and torch.equal(loaded["w"], torch.arange(5.0))
