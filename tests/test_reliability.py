"""Faults for real: a rank SIGKILLed in the middle of `gradsync train`, for every strategy; what the
launcher reports about the other ranks; a long soak of collectives without growth."""

import pytest

from gradsync.bench import faults


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", faults.STRATEGIES)
def test_sigkill_of_a_random_rank_ends_the_job_cleanly(strategy):
    result = faults.kill_trial(strategy, seed=7, workers=3, timeout=10.0)
    assert result["clean"], f"{result.get('why')}\n{result.get('stderr')}"
    assert result["detection_s"] < 10.0, "every other rank must be gone within the configured timeout"
    assert result["exit_code"] != 0


@pytest.mark.timeout(600)
def test_soak_2000_collectives_without_growth(world_of):
    import spawn_fns

    marks = world_of(4).run(spawn_fns.soak, 2000, 300, 11, case_timeout=500)
    for rank, m in enumerate(marks):
        (rss_warm, fds_warm), (rss_end, fds_end) = m["after_warmup"], m["end"]
        assert fds_end == fds_warm, f"rank {rank}: open file descriptors went from {fds_warm} to {fds_end}"
        assert rss_end - rss_warm < 16 << 20, f"rank {rank}: RSS grew by {(rss_end - rss_warm) >> 20} MiB"
