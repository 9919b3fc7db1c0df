"""ZeRO-1 against independent oracles: one process with the global batch and a plain torch optimizer
(parameters and the gathered optimizer state), the ring traffic formula, and the unsharded
optimizer's state size."""

import pytest
import torch

import ddp_fns
import zero_fns
from test_ps import relative_error


def assert_state_dict_close(ours: dict, oracle: dict, rel: float):
    """``ours`` (ShardedOptimizer.state_dict()) against a plain torch optimizer's state_dict(): the same
    groups and entries; per-element tensors within ``rel`` of the oracle's largest element, scalars equal."""
    assert ours["param_groups"] == oracle["param_groups"]
    assert ours["state"].keys() == oracle["state"].keys()
    for index, expected in oracle["state"].items():
        got = ours["state"][index]
        assert got.keys() == expected.keys(), f"parameter {index}"
        for key, value in expected.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert got[key].shape == value.shape and got[key].dtype == value.dtype, f"parameter {index} {key}"
                err = ((got[key] - value).abs().max() / value.abs().max().clamp_min(1e-30)).item()
                assert err <= rel, f"parameter {index} {key} differs by {err:.3g} relative"
            else:
                assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(value)), f"parameter {index} {key}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("optimizer", ["momentum", "adam", "adamw"])
@pytest.mark.parametrize("bucket_cap_mb", [25, 0.001])
def test_zero1_equals_one_process_with_full_optimizer(world_of, world_size, optimizer, bucket_cap_mb):
    steps, local_batch = 3, 4
    results = world_of(world_size).run(zero_fns.zero_train, optimizer, steps, local_batch, bucket_cap_mb)
    model, opt = zero_fns.one_process(optimizer, *ddp_fns.global_data(steps, world_size, local_batch, torch.float64))
    oracle = {n: p.detach() for n, p in model.named_parameters()}
    # the gathered state (m and v, or the momentum buffer, and the step count) is the oracle's
    assert_state_dict_close(results[0]["state_dict"], opt.state_dict(), 1e-12)
    assert all(r["state_dict"] is None for r in results[1:]), "only rank 0 holds the gathered state"
    full_state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0)
    for r in results:
        assert relative_error(r["params"], oracle) <= 1e-12
        assert r["sent"] == r["expected_bytes"], "reduce-scatter + all-gather must send exactly their formula's bytes"
        # state is 1/N of the unsharded state, up to one element per bucket and state tensor
        per_element = full_state / sum(p.numel() for p in oracle.values())
        assert abs(r["state_bytes"] - full_state / world_size) <= r["buckets"] * per_element, (r["state_bytes"], full_state)
        for shard_sizes in r["shard_sizes"]:
            assert max(shard_sizes) - min(shard_sizes) <= 1
    assert len({r["buckets"] for r in results}) == 1
    if bucket_cap_mb < 1:
        assert results[0]["buckets"] > 1, "a tiny cap must give several buckets"


# On one host each bucket's gradients live in a shared region: step() copies a new gradient in once
# and makes .grad its view, so with zero_grad(set_to_none=False) backward writes straight into the
# buffer; the reduce-scatter reads the buffers where they lie. The parameters are views of shared
# values, which the all-gather fills in place. Either way, exactly one process's result.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero1_gradients_live_in_shared_memory_and_backward_writes_into_them(world_of, set_to_none):
    steps, local_batch = 3, 4
    results = world_of(3).run(zero_fns.zero_copy_train, "momentum", steps, local_batch, 0.25, set_to_none)
    model, _ = zero_fns.one_process("momentum", *ddp_fns.global_data(steps, 3, local_batch, torch.float64),
                                    model_name="big_mlp")
    oracle = {n: p.detach() for n, p in model.named_parameters()}
    for r in results:
        assert relative_error(r["params"], oracle) <= 1e-12
        assert len(r["placed"]) > 1 and all(r["placed"]), "every bucket's gradients in a shared region"
        assert r["after_step"] == [True] * steps
        # the first backward makes new gradients; later ones accumulate into the views unless set to None
        assert r["after_backward"] == [False] + [not set_to_none] * (steps - 1)
        # the parameters live in shared values too, and step() takes in data a program replaced
        assert all(r["values_placed"]) and r["params_in_place"] == [True, False, True]
    for r in results[1:]:
        assert all(torch.equal(r["params"][n], results[0]["params"][n]) for n in oracle), "replicas differ"


@pytest.mark.timeout(300)
def test_zero1_over_tcp_keeps_plain_buffers_and_equals_one_process(world_of):
    # no shared memory between the ranks: gradients gathered into an ordinary flat buffer per bucket,
    # the ring's reduce-scatter and all-gather, and the result copied into the parameters
    steps, local_batch = 3, 4
    results = world_of(3, GRADSYNC_TRANSPORT="tcp").run(zero_fns.zero_train, "adam", steps, local_batch, 0.001)
    model, _ = zero_fns.one_process("adam", *ddp_fns.global_data(steps, 3, local_batch, torch.float64))
    oracle = {n: p.detach() for n, p in model.named_parameters()}
    for r in results:
        assert relative_error(r["params"], oracle) <= 1e-12
        assert r["sent"] == r["expected_bytes"] and r["buckets"] > 1


# The program changes the parameters between steps (model.load_state_dict(), then new .data): each
# step must start from them as they are. Over TCP the shard is a copy, refreshed from the parameters
# at every step (ShardedOptimizer._refresh_shard); over shared memory it is the parameters' shared
# values, which take in a replaced .data. 3 ranks and 1 KB buckets: every rank's shard of every
# bucket ends somewhere else inside the parameters.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_zero1_takes_parameters_changed_between_steps_as_torch_zero_redundancy_optimizer(world_of, transport):
    steps = 4
    env = {"GRADSYNC_TRANSPORT": "tcp"} if transport == "tcp" else {}
    results = world_of(3, **env).run(zero_fns.changed_between_steps, "adam", steps, 4, 0.001)
    for rank, got in enumerate(results):
        assert got["buckets"] > 1 and got["values_placed"] == [transport == "shm"] * got["buckets"], got
        for step in range(steps):
            error = relative_error(got["ours"][step], got["torch"][step])
            assert error <= 1e-12, f"rank {rank}, after step {step}: {error:.3g} from torch's ZeroRedundancyOptimizer"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("saved_by,loaded_by", [(2, 3), (3, 2), (2, 2)])
def test_state_dict_reshards_onto_another_world_size(world_of, saved_by, loaded_by):
    saved = world_of(saved_by).run(zero_fns.zero_train, "adam", 3, 4, 0.001)
    full_state, params = saved[0]["state_dict"], saved[0]["params"]
    # oracle: one process, a plain Adam over the same global batches, before and after the resume
    model, adam = zero_fns.one_process("adam", *ddp_fns.global_data(3, saved_by, 4, torch.float64))
    assert_state_dict_close(full_state, adam.state_dict(), 1e-12)
    # loading keeps each rank's slices of the saved state: gathered again (other buckets, other N), it is the same
    regathered = world_of(loaded_by).run(zero_fns.round_trip, full_state)
    assert_state_dict_close(regathered[0], full_state, 0.0)
    resumed = world_of(loaded_by).run(zero_fns.load_and_continue, full_state, params, 2)
    zero_fns.one_process_steps(model, adam, *zero_fns.resume_data(2))
    oracle = {n: p.detach() for n, p in model.named_parameters()}
    for params_after in resumed:
        assert relative_error(params_after, oracle) <= 1e-12


# -- the memory model (no processes): hand-computed values ----------------------------------------
def test_memory_model_matches_hand_computed_values():
    from gradsync.sim.memory import model_state_bytes

    psi, n = 70e9, 64
    assert model_state_bytes(psi, n, "plain DP").total == pytest.approx(1.12e12)          # 16 * 70e9
    assert model_state_bytes(psi, n, "ZeRO-1").total == pytest.approx(70e9 * (2 + 2 + 12 / 64))
    assert model_state_bytes(psi, n, "ZeRO-2").total == pytest.approx(70e9 * (2 + 14 / 64))
    assert model_state_bytes(psi, n, "ZeRO-3").total == pytest.approx(17.5e9)
    assert model_state_bytes(1e9, 8, "ZeRO-1", "adam", "fp32").total == pytest.approx(1e9 * (4 + 4 + 8 / 8))
    assert model_state_bytes(1e9, 4, "plain DP", "sgd", "mixed").optimizer == pytest.approx(8e9)
    with pytest.raises(ValueError, match="choose one of"):
        model_state_bytes(1e9, 4, "ZeRO-4")


def test_memory_command_prints_the_table(capsys):
    from gradsync.cli import main

    assert main(["memory", "--params", "70e9", "--workers", "64"]) == 0
    out = capsys.readouterr().out
    assert "1.12 TB" in out and "293 GB" in out and "17.5 GB" in out


@pytest.mark.timeout(300)
def test_train_zero1_reaches_accuracy_and_resumes_exactly(tmp_path):
    from gradsync.train.config import TrainConfig
    from gradsync.train.launcher import run

    full = run(TrainConfig(workers=2, strategy="zero1", out=str(tmp_path / "full"), quiet=True))
    assert full[0]["summary"]["accuracy"] >= 0.95
    assert full[0]["digest"] == full[1]["digest"]
    common = dict(workers=2, strategy="zero1", steps=30, batch_size=64, quiet=True)
    straight = run(TrainConfig(out=str(tmp_path / "a"), **common))
    run(TrainConfig(out=str(tmp_path / "b"), **{**common, "steps": 13}))
    resumed = run(TrainConfig(out=str(tmp_path / "b"), resume=True, **common))
    assert straight[0]["digest"] == resumed[0]["digest"], "resume must be bit-identical"


# -- clip_grad_norm_ ---------------------------------------------------------------------------------
INF = float("inf")
CLIP_CASES = [  # (optimizer, norm_type, max_norm, bucket_cap_mb): the first three clip every step
    ("adam", 2.0, 0.05, 25), ("momentum", INF, 0.01, 0.001), ("adamw", 3.0, 0.02, 0.001),
    ("momentum", 2.0, 100.0, 25)]


@pytest.mark.timeout(300)
def test_clip_grad_norm_equals_torch_ddp_zero_redundancy_optimizer_and_clip(world_of):
    # oracle: torch's DDP + ZeroRedundancyOptimizer + torch.nn.utils.clip_grad_norm_ on gloo, same world
    steps = 4
    results = world_of(3).run(zero_fns.clip_against_torch, CLIP_CASES, steps, 4)
    for rank, per_case in enumerate(results):
        for (opt_kind, norm_type, max_norm, cap), got in zip(CLIP_CASES, per_case):
            case = f"rank {rank}, {opt_kind}, norm_type {norm_type}, max_norm {max_norm}"
            assert got["our_norms"] == pytest.approx(got["torch_norms"], rel=1e-12, abs=0), case
            bites = [norm > max_norm for norm in got["torch_norms"]]
            assert bites == [max_norm < 1] * steps, f"{case}: clipping must bite at every step, or never"
            assert relative_error(got["ours"], got["torch"]) <= 1e-12, case
            # one reduce-scatter + all-gather per step and one scalar all-reduce: never reduced twice
            assert got["sent"] == got["expected_bytes"], case
    for per_case in results[1:]:   # one coefficient on every rank: the replicas stay identical
        for got, first in zip(per_case, results[0]):
            assert all(torch.equal(got["ours"][n], first["ours"][n]) for n in got["ours"])


# A NaN or inf on one rank, in another rank's shard (its last element), for each rank as the owner:
# the inf-norm combines the ranks' maxima with an all-reduce "max", which must keep a NaN wherever it
# is, so every rank raises, as torch's clip_grad_norm_(error_if_nonfinite=True) does.
@pytest.mark.timeout(120)
def test_a_nonfinite_gradient_in_any_ranks_shard_is_an_error_on_every_rank(world_of):
    for rank, got in enumerate(world_of(3).run(zero_fns.nonfinite_in_each_shard)):
        assert len(got) == 12
        for (norm_type, value, owner), what in got.items():
            assert isinstance(what, str) and what.startswith(f"The total norm of order {norm_type} for gradients"), (
                f"rank {rank}: a {value} in rank {owner}'s shard, norm {norm_type}: {what}")


@pytest.mark.timeout(300)
def test_clip_in_the_wrong_place_is_loud_and_bad_arguments_are_refused(world_of):
    results = world_of(2).run(zero_fns.clip_misuse)
    for rank, got in enumerate(results):
        for layout in ("True", "False"):   # fresh gradients, and gradients that are views of the buckets
            assert got[f"ours_warnings_{layout}"] == [], f"rank {rank}"
            warned = got[f"torch_warnings_{layout}"]
            assert len(warned) == 3 and all("torch.nn.utils.clip_grad_norm_" in w for w in warned), (rank, warned)
        for case in ("backward_after_clip", "model_zero_grad_after_clip"):
            assert got[case].startswith("RuntimeError") and "changed after clip_grad_norm_" in got[case], got[case]
        assert got["zero_grad_starts_over"] == "nothing raised"
        for value, message in got["bad_max_norm"].items():
            assert message.startswith("ValueError: max_norm must be a finite number > 0"), (value, message)
        for value, message in got["bad_norm_type"].items():
            assert message.startswith("ValueError: norm_type") and "p > 0 (1.0, 2.0, ...) or inf" in message, message
        assert "non-finite" in got["nonfinite"], f"rank {rank}: {got['nonfinite']}"
