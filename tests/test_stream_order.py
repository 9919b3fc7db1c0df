"""Host staging's order against the caller's kernels (comm/host_staging.py: gloo's discipline), shown
without a GPU: stream_order.Recorder stands in for the CUDA runtime, plays streams and events on CPU
tensors, and finds every pair of accesses to the same memory that no stream order, event or
synchronization orders. Every case must find none, having staged through the stand-in.

    the DDP wrapper's hooks   the default average, fp16 and bf16 compression, PowerSGD (its warm-up
                              and compressed steps), mixed precision: each hook's kernels come after
                              the bucket's gradients, its staging copies after its own kernels, and
                              the optimizer's step after all of them
    the "gradsync" backend    operations issued on a stream of the caller's own, waited for there or
                              on another: the copies after the input was written, the output read after
    a collective              called on a stream of the caller's own
    registration              the shared regions page-locked, unlocked before they close; a refusal
                              warns once and the collectives stay right
Both modes: overlap (events) and sync (GRADSYNC_STAGING_MODE=sync).
"""

import pytest

import stream_order_fns

STAGED = {"GRADSYNC_HOST_STAGING": "cpu"}
MODES = {"overlap": {}, "sync": {"GRADSYNC_STAGING_MODE": "sync"}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["overlap", "sync"])
def test_every_hook_stages_after_its_own_kernels_and_before_the_step(world_of, mode):
    pool = world_of(1, **STAGED, **MODES[mode])
    for hook in ("none", "fp16", "bf16", "powersgd", "mixed"):
        [found] = pool.run(stream_order_fns.ddp_steps, hook)
        assert found["copies"] > 0, (hook, "nothing was staged through the stand-in")
        assert found["race_count"] == 0, (hook, found["races"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["overlap", "sync"])
@pytest.mark.parametrize("wait_elsewhere", [False, True])
def test_backend_operations_follow_the_callers_stream(world_of, mode, wait_elsewhere):
    [found] = world_of(1, **STAGED, **MODES[mode]).run(stream_order_fns.backend_operations, wait_elsewhere)
    assert found["copies"] > 0 and found["right"]
    assert found["race_count"] == 0, found["races"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["overlap", "sync"])
def test_a_collective_on_the_callers_own_stream(world_of, mode):
    [found] = world_of(1, **STAGED, **MODES[mode]).run(stream_order_fns.collective_on_a_side_stream)
    assert found["copies"] > 0 and found["right"]
    assert found["race_count"] == 0, found["races"]


@pytest.mark.timeout(300)
def test_regions_are_page_locked_and_unlocked_before_they_close(world_of):
    pool = world_of(2, **STAGED)
    for rank, found in enumerate(pool.run(stream_order_fns.regions_registered, False, 1000)):
        assert all(found["right"]) and not found["warned"], (rank, found)
        # two shapes, each a region of its own, registered once, unregistered before the regions close
        assert found["registered"] == ["register 4000", "register 4028", "unregister 4000", "unregister 4028",
                                       "regions closed"], (rank, found["registered"])


@pytest.mark.timeout(300)
def test_a_refused_registration_warns_once_and_the_sums_stay_right(world_of):
    pool = world_of(2, **STAGED)
    for rank, found in enumerate(pool.run(stream_order_fns.regions_registered, True, 1000)):
        assert all(found["right"]), (rank, found)
        assert len(found["warned"]) == 1 and found["registered"][-1] == "regions closed", (rank, found)
        assert "unregister" not in " ".join(found["registered"]), (rank, found)   # nothing was registered
