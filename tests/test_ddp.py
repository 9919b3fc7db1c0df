"""gradsync DDP against independent oracles: one process with the global batch, and torch DDP."""

import pytest
import torch

import ddp_fns
from world_pool import RankFailure


def assert_close(ours: dict, oracle: dict, rel: float, what: str):
    assert ours.keys() == oracle.keys()
    for name in oracle:
        scale = oracle[name].abs().max().clamp_min(1e-30)
        err = (ours[name] - oracle[name]).abs().max() / scale
        assert err <= rel, f"{what}: {name} differs by {err:.3g} relative (allowed {rel})"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model", ["mlp", "cnn_bn", "tied", "reused", "frozen"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_n_ranks_equal_one_process_with_global_batch(world_of, world_size, model, optimizer):
    steps, local_batch = 3, 4
    # A bucket closes once it holds the cap (torch's rule, ddp/buckets.py): frozen's two trainable
    # parameters (32 + 256 bytes) would share any bucket of more than 32 bytes.
    cap = 0.00002 if model == "frozen" else 0.0002
    results = world_of(world_size).run(ddp_fns.ddp_train, model, optimizer, steps, local_batch, torch.float64, cap)
    # BatchNorm normalises per rank, so its oracle averages the per-shard losses (see single_process)
    oracle = ddp_fns.single_process(model, optimizer, steps, world_size, local_batch, torch.float64,
                                    per_shard_loss=(model == "cnn_bn"))
    for params, _, n_buckets in results:
        assert_close(params, oracle, 1e-12, f"{model}/{optimizer}/N={world_size}")
        assert n_buckets > 1, "a tiny cap must give several buckets"
    for params, _, _ in results[1:]:
        assert all(torch.equal(params[n], results[0][0][n]) for n in params), "replicas not bit-identical"


# The MLP's parameters in the order backward produces them, with their float32 bytes:
# net.4.bias 16, net.4.weight 256, net.2.bias 64, net.2.weight 1024, net.0.bias 64, net.0.weight 512.
# A bucket closes once it holds at least the cap (torch's rule); torch's DDP builds its buckets so
# after the first backward, which ours then have too (rebuilt in the ready order).
REVERSED_MLP = ["net.4.bias", "net.4.weight", "net.2.bias", "net.2.weight", "net.0.bias", "net.0.weight"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bucket_cap_mb, layout", [
    (100, [REVERSED_MLP]),                                         # everything fits one bucket
    (0.0006, [REVERSED_MLP[:4], REVERSED_MLP[4:]]),                 # 629 B: 16+256+64+1024 | 64+512 (left open)
    (0.00001, [[name] for name in REVERSED_MLP]),                  # 10 B, smaller than any parameter: one each
])
def test_matches_torch_ddp(world_of, bucket_cap_mb, layout):
    results = world_of(2).run(ddp_fns.torch_ddp_vs_ours, 4, 8, bucket_cap_mb)
    for r in results:
        assert_close(r["ours"], r["torch"], 1e-6, f"vs torch DDP, cap {bucket_cap_mb} MiB")
        assert r["ours buckets"] == r["torch buckets"] == layout, f"cap {bucket_cap_mb} MiB"


@pytest.mark.timeout(300)
def test_no_sync_accumulates_like_one_large_batch(world_of):
    micro_steps, local_batch, world_size = 3, 4, 2
    results = world_of(world_size).run(ddp_fns.no_sync_train, micro_steps, local_batch)
    model = ddp_fns.make_model("mlp", torch.float64)
    opt = ddp_fns.make_optimizer("sgd", model.parameters())
    xs, ys = ddp_fns.global_data(micro_steps, world_size, local_batch, torch.float64)
    opt.zero_grad()
    for k in range(micro_steps):
        torch.nn.functional.cross_entropy(model(xs[k]), ys[k]).backward()
    opt.step()
    for params in results:
        assert_close(params, {n: p.detach() for n, p in model.named_parameters()}, 1e-12, "no_sync")


# no_sync's own value, against torch's DDP in the same world: .grad after every backward (under
# no_sync each rank's own gradient, accumulated; after the synchronised one the average of the sums)
# and the parameters after every step, over 3 windows of 3 micro-batches on 3 ranks; then with an
# optimizer step after every micro-batch (local SGD), where the replicas drift apart under no_sync.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("local_steps", [False, True])
def test_no_sync_leaves_the_same_gradients_and_parameters_as_torch_ddp(world_of, local_steps):
    results = world_of(3).run(ddp_fns.no_sync_against_torch, 3, 3, 4, local_steps)
    for rank, got in enumerate(results):
        (our_grads, our_params), (their_grads, their_params) = got["ours"], got["torch"]
        assert len(our_grads) == len(their_grads) == 9 and len(our_params) == len(their_params) == (9 if local_steps
                                                                                                      else 3)
        for k, (ours, theirs) in enumerate(zip(our_grads, their_grads)):
            assert_close(ours, theirs, 1e-12, f"rank {rank}, .grad after backward {k} (micro-batch {k % 3})")
        for k, (ours, theirs) in enumerate(zip(our_params, their_params)):
            assert_close(ours, theirs, 1e-12, f"rank {rank}, parameters after step {k}")
    first = [got["torch"][0][0] for got in results]   # under no_sync: each rank's own gradient
    assert any(not torch.equal(first[0][n], first[1][n]) for n in first[0]), "the ranks' shards gave equal gradients"


@pytest.mark.timeout(300)
def test_unused_parameters_error_names_them(world_of):
    with pytest.raises(RankFailure) as info:
        world_of(2).run(ddp_fns.unused_without_flag, case_timeout=60)
    for name, message in info.value.errors.values():
        assert "unused_branch.weight" in message and "unused_branch.bias" in message
        assert "find_unused_parameters=True" in message


@pytest.mark.timeout(300)
def test_unused_parameters_with_flag_train_like_one_process(world_of):
    results = world_of(2).run(ddp_fns.ddp_train, "unused", "sgd", 3, 4, torch.float64, 25, "auto", True)
    oracle = ddp_fns.single_process("unused", "sgd", 3, 2, 4, torch.float64, per_shard_loss=False)
    for params, grads_none, _ in results:
        assert_close(params, oracle, 1e-12, "find_unused_parameters")
        assert sorted(grads_none) == ["unused_branch.bias", "unused_branch.weight"], "no gradient, as in one process"


@pytest.mark.timeout(300)
def test_different_models_are_refused_naming_rank_and_parameter(world_of):
    with pytest.raises(RankFailure) as info:
        world_of(3).run(ddp_fns.mismatched_models, case_timeout=60)
    for name, message in info.value.errors.values():
        assert name == "ReplicaMismatchError"
        assert "rank 1" in message and "net.0.weight" in message and "(17, 8)" in message


@pytest.mark.timeout(300)
def test_check_replicas_catches_one_ulp_of_divergence(world_of):
    with pytest.raises(RankFailure) as info:
        world_of(2).run(ddp_fns.diverged_replicas, case_timeout=60)
    for name, message in info.value.errors.values():
        assert name == "ReplicaMismatchError" and "net.2.bias" in message and "rank 1" in message


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hook, unit_roundoff", [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)])
def test_compression_hooks_within_stated_error(world_of, hook, unit_roundoff):
    world_size = 3
    results = world_of(world_size).run(ddp_fns.compressed_grads, hook, 5000)
    for compressed, exact in results:
        bound = (world_size + 1) * unit_roundoff * exact.abs().max()  # documented in ddp/hooks.py
        assert (compressed - exact).abs().max() <= bound
        assert not torch.equal(compressed, exact), "a compression hook that changes nothing is not compressing"
    assert all(torch.equal(r[0], results[0][0]) for r in results), "compressed results must agree across ranks"


@pytest.mark.timeout(300)
def test_timeline_shows_communication_during_backward(world_of, tmp_path):
    from gradsync.observe import trace
    results = world_of(2).run(ddp_fns.traced_overlap, 3)
    events = [e for r in results for e in r[0]]
    path = trace.write(tmp_path / "trace.json", events)
    import json
    loaded = json.loads(path.read_text())["traceEvents"]
    assert {e["pid"] for e in loaded} == {0, 1}
    for rank_events, overlap, n_buckets, rank in results:
        assert n_buckets >= 4
        names = [e["name"] for e in rank_events]
        assert "forward" in names and "optimizer" in names and "backward start" in names
        ends = [e["ts"] for e in rank_events if e["name"] == "backward end"]
        comm = [e for e in rank_events if e["name"].startswith("all_reduce bucket")]
        assert len(comm) == 3 * n_buckets
        # in the last iteration, the first bucket's reduction started before backward ended (backward
        # waits for it to start: ddp_fns.traced_overlap), so some communication time overlaps backward
        first_bucket = [e for e in comm if e["args"]["bucket"] == 0][-1]
        assert first_bucket["ts"] < ends[-1]
        assert overlap is not None and 0.0 < overlap <= 1.0


# On one host DDP's buckets live in shared regions and buckets of IN_PLACE_FROM_BYTES and more are
# all-reduced where backward wrote them (allreduce_in_place.py); smaller ones take the direct
# all-reduce. Both must train exactly like one process, byte counts as their docstrings say.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_zero_copy_buckets_train_like_one_process_with_exact_traffic(world_of, world_size):
    from gradsync.comm.allreduce_ring import ring_chunks
    from gradsync.comm.allreduce_in_place import IN_PLACE_FROM_BYTES

    steps, local_batch = 3, 4
    results = world_of(world_size).run(ddp_fns.zero_copy_train, steps, local_batch, 0.25)
    oracle = ddp_fns.single_process("big_mlp", "sgd", steps, world_size, local_batch, torch.float64, False)
    for rank, (params, placed, sizes, received) in enumerate(results):
        assert_close(params, oracle, 1e-12, f"zero-copy N={world_size}")
        assert all(placed), "every bucket is in a shared region"
        assert any(size >= IN_PLACE_FROM_BYTES for size in sizes) and any(size < IN_PLACE_FROM_BYTES for size in sizes)
        expected = 0
        for size in sizes:
            if size < IN_PLACE_FROM_BYTES:
                expected += (world_size - 1) * size
            else:
                chunks = ring_chunks(size // 8, world_size).sizes
                expected += sum(chunks[rank] + chunks[other] for other in range(world_size) if other != rank) * 8
        assert received == [expected] * steps
    for params, *_ in results[1:]:
        assert all(torch.equal(params[n], results[0][0][n]) for n in params), "replicas not bit-identical"


@pytest.mark.timeout(120)
def test_a_region_tensor_against_a_plain_one_is_a_mismatch(world_of):
    with pytest.raises(RankFailure) as info:
        world_of(3).run(ddp_fns.region_against_plain, 100_000, case_timeout=30)
    assert set(info.value.errors) == {0, 1, 2}
    for name, message in info.value.errors.values():
        assert name == "CollectiveMismatchError" and "shared_memory_in_place" in message and "rank 1" in message
