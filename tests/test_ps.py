"""Parameter server against independent oracles: one process with the global batch, gradsync DDP,
closed-form traffic (W*M each way per step), and the SSP bound checked from the clocks the server
records at every answer and those the workers record."""

import pytest
import torch

import ddp_fns
import ps_fns
from gradsync.ps.sharding import plan_shards
from world_pool import RankFailure, WorldPool


def relative_error(ours: dict, oracle: dict) -> float:
    return max(((ours[n] - oracle[n]).abs().max() / oracle[n].abs().max().clamp_min(1e-30)).item() for n in oracle)


def workers_of(results):
    return [r for r in results if r[0] == "worker"]


def servers_of(results):
    return [r for r in results if r[0] == "server"]


# -- sharding (no processes) -----------------------------------------------------------------------
@pytest.mark.parametrize("numels,servers", [([12800, 200, 6000, 30, 90, 3], 2), ([12800, 200, 6000, 30, 90, 3], 3),
                                            ([1000, 30, 10, 3], 2), ([5, 7, 11], 4), ([100], 1)])
def test_shards_cover_every_element_once_and_balance(numels, servers):
    plan = plan_shards(numels, servers)
    covered = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for pieces in plan.pieces:
        for piece in pieces:
            covered[piece.param][piece.start:piece.start + piece.length] += 1
    assert all(bool((c == 1).all()) for c in covered), "every element belongs to exactly one server"
    loads = plan.shard_numels
    if sum(numels) >= 10 * servers:
        assert max(loads) - min(loads) <= max(1, sum(numels) // (10 * servers))


def test_shard_example_from_the_docstring():
    assert plan_shards([1000, 30, 10, 3], 2).shard_numels == [530, 513]



# -- a checkpoint's state cut for S servers, loaded on S' (no processes) -----------------------------
@pytest.mark.parametrize("before,after", [(3, 2), (2, 3), (1, 4), (4, 1)])
def test_a_state_cut_for_s_servers_loads_element_for_element_on_s_prime(before, after):
    """ps/resharding.py: parts written by S servers make the whole state (every dense parameter, every
    per-element optimizer tensor, every table and its per-row state whole; the scalars once), and the
    part of each of S' servers taken from it holds exactly its own elements and rows. The oracle: the
    pieces' elements sliced out of the parameters here, and table row r on server r mod S by a mask."""
    from gradsync.ps import resharding

    shapes = [(40, 5), (13,), (2, 3, 4), (1,), (30,)]   # 40x5 is cut into pieces for every S here
    numels = [torch.Size(shape).numel() for shape in shapes]
    params, offset = [], 0
    for shape, numel in zip(shapes, numels):   # every element a different value
        params.append(torch.arange(offset, offset + numel, dtype=torch.float64).view(shape))
        offset += numel
    rows = 11
    table = torch.arange(rows * 3, dtype=torch.float64).view(rows, 3)

    def elements(values, pieces):
        return torch.cat([values[p.param].reshape(-1)[p.start:p.start + p.length] for p in pieces])

    def rows_of(values, server, servers):
        return values[torch.arange(rows) % servers == server]

    parts = [{"shard": elements(params, pieces), "version": 5, "clocks": [5, 4],
              "dense_state": {"exp_avg": -elements(params, pieces), "step": torch.tensor(5.0)},
              "param_groups": [{"lr": 0.1}],
              "tables": {"emb": {"block": rows_of(table, s, before), "t": 5,
                                 "state": {"sum": rows_of(table * table, s, before)}}}}
             for s, pieces in enumerate(plan_shards(numels, before).pieces)]
    whole = resharding.whole_state(parts, numels, shapes)
    assert (whole["servers"], whole["version"], whole["clocks"], whole["param_groups"]) == (before, 5, [5, 4],
                                                                                            [{"lr": 0.1}])
    assert all(torch.equal(got, want) for got, want in zip(whole["params"], params))
    assert all(torch.equal(got, -want) for got, want in zip(whole["dense_state"]["exp_avg"], params))
    assert torch.equal(whole["dense_state"]["step"], torch.tensor(5.0))
    assert torch.equal(whole["tables"]["emb"]["rows"], table) and whole["tables"]["emb"]["t"] == 5
    assert torch.equal(whole["tables"]["emb"]["state"]["sum"], table * table)
    for s, pieces in enumerate(plan_shards(numels, after).pieces):
        shard, state = resharding.dense_part(whole, pieces, sum(p.length for p in pieces))
        assert torch.equal(shard, elements(params, pieces)), f"server {s} of {after}: dense shard"
        assert torch.equal(state["exp_avg"], -elements(params, pieces)), f"server {s} of {after}: exp_avg"
        assert torch.equal(state["step"], torch.tensor(5.0))
        part = resharding.table_part(whole["tables"]["emb"], s, after)
        assert torch.equal(part["block"], rows_of(table, s, after)), f"server {s} of {after}: table rows"
        assert torch.equal(part["state"]["sum"], rows_of(table * table, s, after)) and part["t"] == 5

# -- the payload checksum (no processes) ------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [0, 3, 8, 44, 4096 + 5])
def test_checksum_is_the_sum_of_64_bit_words_whatever_the_alignment(nbytes):
    """protocol.checksum against a pure-Python oracle: the little-endian 64-bit words summed mod
    2**64, plus the trailing bytes, low 62 bits; the same bytes at another offset in memory (a view
    into a bigger buffer, as a flat bucket's shard is) give the same sum, and any one flipped bit
    changes it."""
    from gradsync.ps import protocol

    data = bytes(torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(nbytes),
                               dtype=torch.uint8).tolist())
    whole = nbytes // 8 * 8
    words = sum(int.from_bytes(data[i:i + 8], "little") for i in range(0, whole, 8)) % 2**64
    expected = (words - (2**64 if words >= 2**63 else 0) + sum(data[whole:])) % 2**62   # int64, then 62 bits
    for offset in (0, 1, 4, 8):
        buffer = torch.zeros(offset + nbytes, dtype=torch.uint8)
        buffer[offset:] = torch.tensor(list(data), dtype=torch.uint8)
        assert protocol.checksum(buffer[offset:]) == expected, offset
    if nbytes:
        flipped = torch.tensor(list(data), dtype=torch.uint8)
        flipped[nbytes // 2] ^= 4
        assert protocol.checksum(flipped) != expected
    big = torch.full((64,), 2**62, dtype=torch.int64)   # the 64-bit sum wraps; the result fits 62 bits
    assert protocol.checksum(big) == (64 * 2**62) % 2**64 % 2**62 and 0 <= protocol.checksum(-big) < 2**62


# -- sync equivalence ------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("world_size,servers", [(3, 1), (4, 2)])
def test_sync_equals_one_process_with_global_batch(world_of, optimizer, world_size, servers):
    steps, local_batch = 3, 4
    results = world_of(world_size).run(ps_fns.train, "sync", optimizer, steps, local_batch, servers)
    workers = world_size - servers
    ddp_opt = "sgd" if optimizer == "momentum" else "adam"   # ddp_fns: sgd = SGD(lr .1, momentum .9)
    oracle = ddp_fns.single_process("mlp", ddp_opt, steps, workers, local_batch, torch.float64, False)
    for _, params, stats, _ in workers_of(results):
        assert relative_error(params, oracle) <= 1e-12
        assert stats["steps"] == steps
    for _, stats, _ in servers_of(results):
        assert stats["version"] == steps and stats["staleness_histogram"] == {0: workers * steps}


@pytest.mark.timeout(300)
def test_sync_equals_gradsync_ddp(world_of):
    steps, local_batch = 3, 4
    ps = world_of(3).run(ps_fns.train, "sync", "adam", steps, local_batch, 1)
    ddp = world_of(2).run(ddp_fns.ddp_train, "mlp", "adam", steps, local_batch, torch.float64)
    for _, params, _, _ in workers_of(ps):
        assert relative_error(params, ddp[0][0]) <= 1e-12


# -- clipping (clipping.py) --------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,world_size,servers,norm_type,max_norm", [
    ("sync", 4, 2, 2.0, 0.05),            # two servers: the norm is taken over both shards
    ("sync", 4, 2, float("inf"), 0.01),
    ("sync", 3, 1, 2.0, 100.0),           # never bites
    ("async", 2, 1, 2.0, 0.05),           # one worker: its own gradient is the averaged one
    ("ssp", 2, 1, 3.0, 0.02)])
def test_clipping_equals_one_process_with_global_batch_and_torch_clip(world_of, mode, world_size, servers,
                                                                      norm_type, max_norm):
    steps, local_batch, workers = 3, 4, world_size - servers
    results = world_of(world_size).run(ps_fns.train, mode, "momentum", steps, local_batch, servers, 0, None, 0.0,
                                       "mlp", torch.float64, (max_norm, norm_type))
    oracle, norms = ps_fns.one_process_clipped("momentum", steps, workers, local_batch, max_norm, norm_type)
    assert [norm > max_norm for norm in norms] == [max_norm < 1] * steps, "clipping bites at every step, or never"
    for _, params, stats, _ in workers_of(results):
        assert relative_error(params, oracle) <= 1e-12, f"worker rank {stats['rank']}"
        if mode != "sync":   # the worker clipped what it pushed
            assert stats["last_grad_norm"] == pytest.approx(norms[-1], rel=1e-12)
    for _, stats, traffic in servers_of(results):
        if mode == "sync":   # every server saw the same global norm and clipped when it was above max_norm
            assert stats["last_grad_norm"] == pytest.approx(norms[-1], rel=1e-12), f"server rank {stats['rank']}"
            assert stats["clipped_versions"] == (steps if max_norm < 1 else 0)
            # S-1 float64 scalars out per version (with one server, none)
            assert traffic["per_op"].get("ps/clip", {"sent": 0})["sent"] == steps * (servers - 1) * 8


@pytest.mark.timeout(120)
def test_a_server_lost_while_clipping_is_named_and_nothing_hangs():
    pool = WorldPool(4, timeout=5.0)   # a world of its own: server 0 waits at most this long for server 1's sum
    with pytest.raises(RankFailure) as info:
        pool.run(ps_fns.dead_server_while_clipping, 1, 2, case_timeout=60)
    errors = info.value.errors
    assert errors[1][0] == "died"
    assert errors[0][0] == "RuntimeError" and "no power sum from server rank 1 for clipping version 2" in errors[0][1]
    for worker in (2, 3):   # the workers hear it from server 0 (or see server 1 gone), naming the rank
        assert "rank 1" in errors[worker][1], errors[worker]


# -- traffic ---------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,servers", [(3, 1), (4, 1), (4, 2)])
def test_server_traffic_is_w_times_m_each_way(world_of, world_size, servers):
    steps, local_batch = 2, 4
    results = world_of(world_size).run(ps_fns.train, "sync", "sgd", steps, local_batch, servers, 0, None, 0.0, "uneven")
    workers = world_size - servers
    model_bytes = sum(p.numel() for p in ps_fns.Uneven().parameters()) * 8
    shard_bytes = []
    for _, stats, traffic in servers_of(results):
        shard_bytes.append(stats["shard_bytes"])
        # steps pushes in, steps + 1 pulls out (the final pull) per worker, all payload counted by the meter
        assert traffic["per_op"]["ps/push"]["received"] == workers * steps * stats["shard_bytes"]
        assert traffic["per_op"]["ps/pull"]["sent"] == workers * (steps + 1) * stats["shard_bytes"]
        assert stats["bytes_in_per_step"] == workers * stats["shard_bytes"]
        assert traffic["control_bytes_received"] > 0 and "ps/header" not in traffic["per_op"]
    assert sum(shard_bytes) == model_bytes
    if servers == 1:
        assert shard_bytes == [model_bytes]
    assert max(shard_bytes) <= 1.1 * min(shard_bytes), f"unbalanced shards {shard_bytes}"
    for _, _, _, traffic in workers_of(results):
        assert traffic["per_op"]["ps/push"]["sent"] == steps * model_bytes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_server_finishes_its_sends_instead_of_piling_them_up(world_of, mode):
    # gloo calls a send finished only once it is waited for: a server that only polled its sends kept
    # every answer it ever sent (and its tensor) in flight, 2 more per worker per step
    steps, local_batch = 12, 4
    results = world_of(3).run(ps_fns.train, mode, "sgd", steps, local_batch, 1, 0, None, 0.0, "uneven")
    (_, stats, _), = servers_of(results)
    assert stats["version"] == (steps if mode == "sync" else 2 * steps)
    assert 0 < stats["most_sends_in_flight"] <= 2 * 2   # one answer (header + payload) per worker at most


def server_in_step(world_of, tmp_path, mode: str, workers: int, steps: int, late_answer_s: float = 0.0) -> dict:
    """The server's stats after ps_fns.in_step with ``workers`` workers; every push was applied."""
    results = world_of(1 + workers).run(ps_fns.in_step, mode, steps, str(tmp_path), 0.05, late_answer_s)
    (_, stats), = [r for r in results if r[0] == "server"]
    assert stats["version"] == (steps if mode == "sync" else workers * steps)
    return stats


@pytest.mark.parametrize("mode, expected", [("sync", 2), ("async", 1), ("ssp", 1)])
def test_sync_server_reads_two_pushes_at_once_async_one(world_of, tmp_path, mode, expected):
    # ps/server.py, PUSHES_IN_FLIGHT: both workers' PUSH headers reach the server before either
    # worker's next message (ps_fns.in_step), so a sync server posts the second push's receives
    # while the first is still in flight; async and ssp finish the first push before they take the
    # next (two at once kept their workers in step and slowed them, docs/benchmarks.md)
    assert server_in_step(world_of, tmp_path, mode, workers=2, steps=4)["most_pushes_in_flight"] == expected


@pytest.mark.parametrize("mode, expected", [("sync", 3), ("async", 2), ("ssp", 2)])
def test_async_server_keeps_two_answers_in_flight_sync_sends_all(world_of, tmp_path, mode, expected):
    # ps/server.py, ANSWERS_IN_FLIGHT: three workers' PULLs all reach the server before any worker's
    # next message (ps_fns.in_step), and each worker posts the receive of its answer only 0.3 s after
    # its PULL, so no answer completes meanwhile: an async or SSP server sends two and holds the
    # third until one is received; a sync server sends a version's three answers at once (no limit)
    stats = server_in_step(world_of, tmp_path, mode, workers=3, steps=2, late_answer_s=0.3)
    assert stats["most_answers_in_flight"] == expected and stats["pulls"] == 3 * (2 + 1)


# -- consistency models ----------------------------------------------------------------------------
def largest_gap_seen_by_workers(results) -> int:
    """From the workers' own records (ps_fns.paced): the largest c - k such that a worker's pull at
    clock c returned while another worker had started only k pushes. The server counts a push only
    after it started, and answers a pull before it returns, so the server's gap for that pull
    (c - the slowest open worker's clock) was at least this."""
    records = {rank: (pulls, pushes) for _, rank, pulls, pushes, _ in workers_of(results)}
    gaps = [0]
    for rank, (pulls, _) in records.items():
        for clock, returned in enumerate(pulls):
            for other, (_, other_pushes) in records.items():
                if other != rank:
                    gaps.append(clock - sum(started < returned for started in other_pushes))
    return max(gaps)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bound", [0, 1, 2])
def test_ssp_never_exceeds_its_bound(world_of, tmp_path, bound):
    steps = 8
    # the straggler (rank 3) pushes step k only once the two other workers wait in their pull at
    # clock k + bound + 1, which the bound must hold back; so the gap reaches the bound exactly. The
    # server records, for every pull it answers, the puller's clock minus the slowest open worker's
    # (stats' clock_gap_histogram): never above the bound, and at it; the workers' own records agree
    results = world_of(4).run(ps_fns.paced, "ssp", bound, steps, 3, bound + 1, str(tmp_path))
    (_, stats, _), = servers_of(results)
    gaps = stats["clock_gap_histogram"]
    assert sum(gaps.values()) == stats["pulls"] == 3 * (steps + 1), (gaps, stats["pulls"])
    assert max(gaps) <= bound, f"the server answered a pull {max(gaps)} clocks ahead of the slowest worker: {gaps}"
    gave_up = [at for *_, at in workers_of(results) if at is not None]
    assert not gave_up, (f"the other workers never reached their pull at clock {gave_up[0]}: the server held them "
                         f"back before the bound {bound} (gaps it answered at: {gaps})")
    assert max(gaps) == bound == stats["max_clock_gap"], f"the gap never reached the bound {bound}: {gaps}"
    gap = largest_gap_seen_by_workers(results)
    assert gap == bound, f"the workers saw a pull answered {gap} clocks ahead of the slowest worker (bound {bound})"
    assert stats["pushes"] == 3 * steps
    assert max(stats["staleness_histogram"]) <= 3 * bound + 2, stats["staleness_histogram"]


@pytest.mark.timeout(300)
def test_ssp_with_a_huge_bound_runs_ahead_like_async(world_of, tmp_path):
    steps = 8
    # the straggler (rank 2) pushes its first step only after the other worker's last pull
    results = world_of(3).run(ps_fns.paced, "ssp", 10**9, steps, 2, steps, str(tmp_path))
    gap = largest_gap_seen_by_workers(results)
    assert gap == steps, f"the fast worker should run {steps} clocks ahead of the straggler, the workers saw {gap}"
    (_, stats, _), = servers_of(results)
    assert stats["max_clock_gap"] == steps, stats["clock_gap_histogram"]
    assert max(stats["staleness_histogram"]) == steps, "the straggler's first push lands on version 8"


@pytest.mark.timeout(300)
def test_ssp_bound_zero_behaves_as_sync(world_of):
    steps, local_batch = 3, 4
    ssp = world_of(3).run(ps_fns.train, "ssp", "sgd", steps, local_batch, 1, 0, 2, 0.02)
    sync = world_of(3).run(ps_fns.train, "sync", "sgd", steps, local_batch, 1)
    for (_, a, _, _), (_, b, _, _) in zip(workers_of(ssp), workers_of(sync)):
        assert relative_error(a, b) <= 1e-12


@pytest.mark.timeout(300)
def test_async_records_staleness(world_of, tmp_path):
    steps = 6
    # the straggler (rank 2) pushes its first step, computed on version 0, after the other worker's last pull
    results = world_of(3).run(ps_fns.paced, "async", 0, steps, 2, steps, str(tmp_path))
    (_, stats, _), = servers_of(results)
    assert sum(stats["staleness_histogram"].values()) == 2 * steps
    assert max(stats["staleness_histogram"]) == steps, "a straggler's push arrives on an old version"


# -- failures --------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async", pytest.param("ssp", marks=pytest.mark.slow)])   # ssp: as async
def test_dead_worker_is_named_and_nothing_hangs(mode):
    # a world of its own: the server names the dead worker after this timeout at the latest; under
    # async and ssp the worker dies with the server's answer to it moving in the outbox
    pool = WorldPool(3, timeout=8.0)
    with pytest.raises(RankFailure) as info:
        pool.run(ps_fns.dead_worker, 2, 1, mode, case_timeout=60)
    errors = info.value.errors
    assert errors[2][0] == "died"
    assert errors[0][0] == "WorkerLostError" and "worker rank 2" in errors[0][1], errors[0]
    assert errors[1][0] == "ServerAbortedError" and "rank 2" in errors[1][1], errors[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,words", [("bad_magic", "not a gradsync parameter-server header"),
                                        ("bad_checksum", "checksum"), ("wrong_length", "elements"),
                                        ("push_twice", "once per version")])
def test_malformed_message_is_refused_and_named(world_of, kind, words):
    pool = world_of(3)
    try:
        results = pool.run(ps_fns.malformed, kind)
    finally:
        pool.close()   # the refused messages stay queued in gloo: start the next case on a fresh world
    name, message, sender, version, unchanged = results[0]
    assert name == "ProtocolError" and sender == 2 and "rank 2" in message and words in message
    if kind != "push_twice":  # (there the first, valid push may complete a step, depending on timing)
        assert version == 0 and unchanged, "a refused message must not touch the parameters"
    assert results[1][0] == "ServerAbortedError" and results[1][2] == 2
    assert results[2][0] == "ServerAbortedError" and "refused" in results[2][1], "the sender learns why too"
