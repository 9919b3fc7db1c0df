"""Modern torch programs on the "gradsync" backend give gloo's numbers (backend_programs_script.py).

One torchrun launch of 2 ranks runs every program twice, on gradsync's default group and on a gloo
group over the same ranks (the oracle), and saves both; see the script's docstring for what runs.
float64 throughout and 2 ranks: every reduced element is a + b on both backends (commutative, so
rounded alike) and averages divide by 2, so the runs agree bit for bit; any difference fails.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
LAUNCH_TIMEOUT = 300
SHORT = 3.0  # the watchdog groups' timeout in the script
WATCHDOG_PERIOD = 0.3  # min(1, timeout / 10)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("programs")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GRADSYNC_STALL_SECONDS": "0"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(HERE / "backend_programs_script.py"), str(out)]
    log = out / "log"
    with open(log, "w") as sink:  # a file, not a pipe: nothing waits for a reader
        launcher = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=out,
                                    start_new_session=True)
    try:
        launcher.wait(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        for pid_file in out.glob("pid_rank*"):  # every thread's stack into the log, then the end
            os.kill(int(pid_file.read_text()), signal.SIGUSR1)
        time.sleep(2)
        os.killpg(launcher.pid, signal.SIGKILL)  # the ranks die with their launcher (PR_SET_PDEATHSIG)
        launcher.wait()
        pytest.fail(f"the programs ran past {LAUNCH_TIMEOUT} s; progress and stacks:\n{log.read_text()[-12000:]}")
    assert launcher.returncode == 0, f"torchrun failed ({launcher.returncode}):\n{log.read_text()[-12000:]}"
    return [torch.load(out / f"programs_rank{rank}.pt", weights_only=False) for rank in range(2)]


def _same(ours, theirs, what: str) -> None:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), (what, ours)
        assert torch.equal(ours, theirs), f"{what}: largest difference {(ours - theirs).abs().max().item()}"
    else:
        assert ours == theirs, (what, ours, theirs)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("order", ["wrap_then_compile", "compile_then_wrap"])
def test_torch_compile_over_torch_ddp_gives_gloos_parameters(ranks, kind, order):
    for rank, found in enumerate(ranks):
        ours, theirs = found[f"compile/{kind}/{order}"]
        _same(ours["losses"], theirs["losses"], f"rank {rank} {kind} {order} losses")
        _same(ours["params"], theirs["params"], f"rank {rank} {kind} {order} parameters")
        # the compiler was handed the same graphs; DDPOptimizer split the forward at the buckets
        assert ours["graphs"] == theirs["graphs"] and len(ours["graphs"]) >= 2, (ours["graphs"], theirs["graphs"])


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_ddp_optimizer_is_what_splits_the_graph(ranks):
    with_split = ranks[0]["compile/gpt/wrap_then_compile"][0]["graphs"]
    assert len(ranks[0]["compile/gpt/no_ddp_optimizer_graphs"]) == 1 < len(with_split)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_compiled_autograd_with_the_python_reducer_all_reduces_through_gradsync(ranks):
    gradient_bytes = (16 * 512 + 512 + 512 * 512 + 512 + 512 * 4 + 4) * 8
    for rank, found in enumerate(ranks):
        ours, theirs = found["compiled_autograd"]
        _same(ours["losses"], theirs["losses"], f"rank {rank} losses")
        _same(ours["params"], theirs["params"], f"rank {rank} parameters")
        # 3 steps, each rank sends at least the other's half of every gradient (M/2 at N=2)
        assert ours["gradsync_bytes_sent"] >= 3 * gradient_bytes // 2, ours["gradsync_bytes_sent"]
        assert theirs["gradsync_bytes_sent"] == 0


HOOKS = ["allreduce", "fp16", "bf16", "powersgd", "batched_powersgd", "post_localsgd", "chained",
         "allreduce/several_buckets", "fp16/several_buckets"]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("hook", HOOKS)
def test_torch_comm_hooks_on_torch_ddp_give_gloos_result(ranks, hook):
    for rank, found in enumerate(ranks):
        ours, theirs = found[f"hook/{hook}"]
        _same(ours, theirs, f"rank {rank} hook {hook}")
    if hook == "batched_powersgd":  # torch 2.13's batched hook fails on gloo too: the same error here
        assert "AssertionError" in ranks[0]["hook/batched_powersgd"][1]
    elif hook == "bf16":  # torch refuses it on CPU, on gloo too: the same error here
        assert "BF16 all reduce communication hook required CUDA" in ranks[0]["hook/bf16"][1]
    else:
        assert isinstance(ranks[0][f"hook/{hook}"][1], torch.Tensor), ranks[0][f"hook/{hook}"][1]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("hook", ["powersgd", "chained"])
def test_hooks_that_wait_in_callbacks_run_with_several_buckets_and_keep_the_replicas_equal(ranks, hook):
    # gloo hangs here (its worker threads block in the callbacks), so the oracles are the replica
    # invariant and the one-bucket run on gloo: the same training, other buckets, close parameters
    first, second = (found[f"hook/{hook}/several_buckets/ours_only"] for found in ranks)
    assert isinstance(first, torch.Tensor), first
    assert torch.equal(first, second)
    one_bucket = ranks[0][f"hook/{hook}"][1]
    assert not torch.equal(first, one_bucket)  # really another bucket layout
    assert (first - one_bucket).norm() < 0.05 * one_bucket.norm(), (first - one_bucket).norm() / one_bucket.norm()


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_the_watchdog_names_the_missing_rank_within_the_timeout(ranks):
    message, waited = ranks[0]["watchdog/peer_never_calls"]
    assert "all_reduce" in message and "not arrived: rank 1" in message, message
    assert waited < SHORT + 2.0, waited


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_the_watchdog_ends_a_callback_that_waits_for_itself(ranks):
    for found in ranks:
        message, waited = found["watchdog/callback_waits_for_queued"]
        assert "watchdog aborted this process group" in message and "callback" in message, message
        assert "allreduce" in message, message  # names the operation behind it
        assert SHORT - 0.1 < waited < SHORT + WATCHDOG_PERIOD + 2.0, waited
        assert "watchdog aborted this process group" in found["watchdog/later_call"]
