"""gradsync's DistributedDataParallel speaks torch DDP's training API: each feature against torch's
DDP on gloo in the same world (same seeds, data and optimizer, float64). Two ranks add and average
in one order only, so there the parameters must be bit-identical; with three, within 1e-12
relative (the division and the first backward's summation order differ in the last bits)."""

import pytest
import torch

import ddp_api_fns
from test_ddp import assert_close


def assert_equal(ours: dict, oracle: dict, what: str):
    assert ours.keys() == oracle.keys()
    for name in oracle:
        same = torch.equal(ours[name], oracle[name])
        assert same, f"{what}: {name} differs by {(ours[name] - oracle[name]).abs().max():.3g}"


# -- communication hooks ---------------------------------------------------------------------------
# torch's own hooks, unchanged, on our wrapper. "powersgd" runs with one bucket (torch's DDP deadlocks
# on gloo under PowerSGD with several: its Future callbacks wait for nested collectives); the
# "_buckets"/"batched_" cases have three, torch's side waiting for each bucket inside the hook.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["allreduce", "fp16", "bf16", "powersgd", "powersgd_buckets", "batched_powersgd"])
def test_torch_hooks_give_torch_ddps_parameters(world_of, case):
    results = world_of(2).run(ddp_api_fns.hook_case, case)
    for r in results:
        assert_equal(r["ours"]["params"], r["torch"]["params"], case)
        # the buckets the hooks saw, after both rebuilt them in the order gradients became ready
        assert r["ours"]["buckets"] == r["torch"]["buckets"]
        assert len(r["ours"]["buckets"]) == (1 if case == "powersgd" else 3)


@pytest.mark.timeout(300)
def test_buckets_are_rebuilt_once_in_the_order_gradients_became_ready(world_of):
    # Shuffled registers its layers late, early, mid and uses them early, mid, late: the first buckets
    # (reverse registration order) are not the ready order; after the first backward they are
    r = world_of(2).run(ddp_api_fns.hook_case, "allreduce")[0]
    # float64 bytes: mid 128 + 2048, early 128 + 1024, late 32 + 512; a bucket closes at 629 B or more
    assert r["ours"]["initial"] == [["mid.bias", "mid.weight"], ["early.bias", "early.weight"],
                                    ["late.bias", "late.weight"]]
    assert r["ours"]["buckets"] == r["torch"]["buckets"] == [["late.bias", "late.weight", "mid.bias"], ["mid.weight"],
                                                             ["early.bias", "early.weight"]]


@pytest.mark.timeout(300)
def test_builtin_fp16_hook_equals_torchs_fp16_compress_hook(world_of):
    for r in world_of(2).run(ddp_api_fns.builtin_fp16_case):
        assert_equal(r["ours"], r["torch"], "comm_hook='fp16'")


@pytest.mark.timeout(300)
def test_hook_misuse_is_refused_with_the_reason(world_of):
    for r in world_of(2).run(ddp_api_fns.misuse_errors):
        assert r["twice"][0] == "RuntimeError" and "once" in r["twice"][1]
        assert r["mixed_precision"][0] == "RuntimeError" and "mixed_precision" in r["mixed_precision"][1]
        assert r["old_signature"][0] == "TypeError" and "register_comm_hook(state, hook)" in r["old_signature"][1]
        assert r["not_a_future"][0] == "TypeError" and "torch.futures.Future" in r["not_a_future"][1]
        assert r["never_completes"][0] == "TimeoutError" and "bucket 0" in r["never_completes"][1]


# -- uneven inputs ------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["ddp", "buffers_divide_by_alive", "torch_hook", "sharded_with_ddp", "sharded_alone",
                                  "sharded_alone_clip"])
def test_join_with_uneven_inputs_gives_torch_joins_parameters(world_of, case):
    results = world_of(3).run(ddp_api_fns.join_case, case)
    for rank, r in enumerate(results):
        assert r["ours"]["steps"] == r["torch"]["steps"] == 6 + 3 * rank
        assert r["ours"]["clipped_steps"] == r["torch"]["clipped_steps"]
        if case == "sharded_alone_clip":
            assert r["torch"]["clipped_steps"] >= 3, "the clipping case should clip"
        assert_close(r["ours"]["params"], r["torch"]["params"], 1e-12, f"Join {case}")
        if "buffers" in r["torch"]:
            assert_close(r["ours"]["buffers"], r["torch"]["buffers"], 1e-12, f"Join {case} buffers")
    for r in results[1:]:   # every rank ends with the last joiner's model
        assert_equal(r["ours"]["params"], results[0]["ours"]["params"], "replicas after Join")


@pytest.mark.timeout(300)
def test_join_throw_on_early_termination_raises_where_torch_does(world_of):
    for r in world_of(3).run(ddp_api_fns.join_case, "throw"):
        assert r["ours"] == r["torch"] and r["ours"]["steps"] == 6


# -- mixed precision, subgroups ------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(ddp_api_fns.MIXED_PRECISION_CASES))
def test_mixed_precision_gives_torchs_arithmetic(world_of, case):
    for r in world_of(2).run(ddp_api_fns.mixed_precision_case, case):
        assert_equal(r["ours"], r["torch"], f"mixed precision {case}")
        assert_equal(r["ours buffers"], r["torch buffers"], f"mixed precision {case} buffers")
        assert set(r["dtypes"]["in forward"]) == {str(ddp_api_fns.MIXED_PRECISION_CASES[case][1])}  # param_dtype
        assert set(r["dtypes"]["after"]) == set(r["dtypes"]["grads"]) == {"torch.float64"}


@pytest.mark.timeout(300)
def test_subgroup_process_group_trains_its_members_like_torch(world_of):
    results = world_of(3).run(ddp_api_fns.subgroup_case, (0, 2))
    for rank in (0, 2):
        assert_equal(results[rank]["ours"], results[rank]["torch"], f"subgroup, rank {rank}")
    outside = results[1]["outside"]
    assert outside["torch"] is not None, "torch's DDP raises on a rank outside the group"
    assert outside["ours"][0] == "ValueError" and "not a member of process_group" in outside["ours"][1]


# -- torch.compile ---------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ["compile(DDP(m))", "DDP(compile(m))"])
def test_compiled_wrapper_gives_torch_ddps_losses(world_of, order):
    for r in world_of(2).run(ddp_api_fns.compile_case, order, case_timeout=120):
        assert r["graphs"] >= 1, "dynamo compiled nothing"
        assert r["ours"] == r["torch"]
        assert_equal(r["ours params"], r["torch params"], order)
