"""comm/transport/shm/single_copy.py against a real second process: what read() takes out of its memory, and
probe() saying why when it cannot work."""

import multiprocessing as mp
import os

import pytest
import torch

from gradsync.comm.transport.shm import single_copy


def _holder(conn) -> None:
    """Hold a float64 tensor of 0..n-1, send its pid and address, and wait to be told to exit."""
    tensor = torch.arange(1000, dtype=torch.float64)
    conn.send((os.getpid(), tensor.data_ptr()))
    conn.recv()


@pytest.fixture()
def holder():
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_holder, args=(child,), daemon=True)
    process.start()
    try:
        assert parent.poll(60), "the holder process did not start"
        yield parent, process, *parent.recv()
    finally:
        process.kill()
        process.join(10)


@pytest.mark.timeout(120)
def test_read_another_process_tensor_and_probe(holder):
    conn, process, pid, address = holder
    problem = single_copy.probe(pid, address, torch.arange(2, dtype=torch.float64).numpy().tobytes())
    if problem is not None and "Operation not permitted" in problem:
        pytest.skip(f"the kernel refuses cross-process reads here: {problem}")
    assert problem is None

    into = torch.empty(300, dtype=torch.float64)
    single_copy.read(pid, address + 100 * 8, into)            # elements 100..399, as the holder has them
    assert torch.equal(into, torch.arange(100, 400, dtype=torch.float64))

    # probe reads back what it was told to expect
    assert "other bytes than expected" in single_copy.probe(pid, address, b"\x01" * 16)
    conn.send("done")
    process.join(30)
    with pytest.raises(single_copy.SingleCopyError, match="process_vm_readv with pid"):
        single_copy.read(pid, address, into)
    assert "process_vm_readv with pid" in single_copy.probe(pid, address, b"\x00" * 8)
