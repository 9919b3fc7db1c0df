"""Sparse tables on the parameter server against independent oracles: one process with torch's own
optimizers on sparse gradients (batch W*b), torch.optim.SparseAdam, a hand-written lazy-momentum loop,
and byte counts computed from the batches themselves (unique rows x row bytes)."""

import pytest
import torch

import ps_sparse_fns as fns
from gradsync.ps import row_sharding
from gradsync.ps.sparse_optim import SparseRows, sparse_rule
from test_ps import relative_error, servers_of, workers_of


# -- row sharding and the sparse rules (no processes) ------------------------------------------------
def test_row_striping_example_from_the_docstring():
    assert [row_sharding.global_rows(s, 10, 3).tolist() for s in range(3)] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [row_sharding.rows_on(s, 10, 3) for s in range(3)] == [4, 3, 3]
    ids = torch.tensor([9, 4, 0, 5, 3])
    assert [ids[p].tolist() for p in row_sharding.split_by_owner(ids, 3)] == [[9, 0, 3], [4], [5]]
    assert row_sharding.to_local(torch.tensor([9, 0, 3]), 3).tolist() == [3, 0, 1]



def test_row_history_reads_each_snapshot_as_a_copy_of_the_block_taken_then():
    """ps/row_history.py: snapshots kept at three moments of a block written in place (random unique rows
    each write, as a push's) read back, for any rows in any order with repeats, exactly what a full copy
    of the block taken at that moment holds; a dropped snapshot is gone, the kept ones still right."""
    from gradsync.ps.row_history import RowHistory

    generator = torch.Generator().manual_seed(5)
    block = torch.randn(20, 4, dtype=torch.float64, generator=generator)
    history = RowHistory(block)
    copies = {}
    for key in range(9):
        if key in (0, 3, 7):
            history.keep(key)
            copies[key] = block.clone()   # the oracle: the whole block copied
        rows = torch.randperm(20, generator=generator)[:int(torch.randint(1, 8, (1,), generator=generator))]
        history.before_write(rows)
        block[rows] += torch.randn(len(rows), 4, dtype=torch.float64, generator=generator)
    asked = torch.tensor([19, 0, 5, 5, 12, 3, 0, 7, 18, 1])
    for key, copy in copies.items():
        assert torch.equal(history.read(key, asked), copy[asked]), f"snapshot {key}"
        assert torch.equal(history.read(key, torch.arange(20)), copy), f"snapshot {key}, every row"
    history.drop({3, 7})
    assert sorted(history.snapshots) == [3, 7]
    for key in (3, 7):
        assert torch.equal(history.read(key, asked), copies[key][asked]), f"snapshot {key} after the drop"

def test_the_whole_table_flag_is_refused_anywhere_but_on_a_pull_for_every_row_held():
    """A whole-table request section (FLAG_WHOLE_TABLE) is accepted only as a pull request for all the
    rows the server holds, with no bytes; on a push, on a PULL header itself, or for fewer rows it is a
    ProtocolError naming the sender (no processes: the wire functions on headers made here)."""
    from gradsync.ps import protocol as wire
    from gradsync.ps import sparse_wire
    from gradsync.ps.protocol import Header, ProtocolError
    from gradsync.ps.sparse_tables import TableSpec

    spec = TableSpec(0, "emb.weight", 10, 4, 8)
    ids = row_sharding.global_rows(1, 10, 3)   # rows 1, 4, 7: server 1 of 3
    request = sparse_wire.section_header(sparse_wire.REQUEST_SECTION, 5, 1, spec, ids, None, whole=True)
    assert (request.numel, request.nbytes, request.flags) == (3, 0, wire.FLAG_WHOLE_TABLE)
    assert wire.decode(request.encode(), 5) == request
    sparse_wire.check_section_header(request, sparse_wire.REQUEST_SECTION, spec, 1, 3, 5, "server rank 1")
    for section, header in [(sparse_wire.PUSH_SECTION, request), (sparse_wire.REQUEST_SECTION,
                            Header(wire.ROWS, 5, 0, 1, 2, 0, 0, wire.FLAG_WHOLE_TABLE))]:
        with pytest.raises(ProtocolError, match="whole-table flag belongs only on a pull request") as info:
            sparse_wire.check_section_header(header, section, spec, 1, 3, 5, "server rank 1")
        assert info.value.sender == 5
    with pytest.raises(ProtocolError, match="only ROWS carries FLAG_WHOLE_TABLE"):
        wire.decode(Header(wire.PULL, 5, 0, 1, flags=wire.FLAG_WHOLE_TABLE).encode(), 5)


@pytest.mark.parametrize("servers", [1, 3])
def test_row_ids_at_every_boundary_are_accepted_or_refused_by_name(servers):
    """The server's id check (sparse_wire.check_ids) at every boundary of a 10-row table: rows 0 and
    R-1 = 9 accepted on the server that holds each; R = 10 and -1 refused, naming the id, the table
    and its range, whichever server they reach, and the sender; a section of as many rows as the
    server holds accepted, one more refused (no processes)."""
    from gradsync.ps import sparse_wire
    from gradsync.ps.protocol import ProtocolError
    from gradsync.ps.sparse_tables import TableSpec

    rows = 10
    spec = TableSpec(0, "emb.weight", rows, 4, 8)
    for row in (0, rows - 1):
        for unique in (True, False):
            sparse_wire.check_ids(torch.tensor([row]), spec, row % servers, servers, 5, "server", unique)
    for row in (rows, -1):
        for server in range(servers):
            with pytest.raises(ProtocolError) as info:
                sparse_wire.check_ids(torch.tensor([3 * servers, row]), spec, server, servers, 5, "server", True)
            assert f"rank 5 sent row id {row} for table emb.weight, which has rows 0..9; refused" in str(info.value)
            assert info.value.sender == 5
    held = row_sharding.rows_on(0, rows, servers)
    ids = row_sharding.global_rows(0, rows, servers)
    for numel, accepted in ((held, True), (held + 1, False)):
        header = sparse_wire.section_header(sparse_wire.PUSH_SECTION, 5, 0, spec, torch.arange(numel),
                                            torch.zeros(numel, 4, dtype=torch.float64))
        if accepted:
            sparse_wire.check_section_header(header, sparse_wire.PUSH_SECTION, spec, 0, held, 5, "server")
            sparse_wire.check_ids(ids, spec, 0, servers, 5, "server", True)
        else:
            with pytest.raises(ProtocolError, match=f"carries at most {held} rows"):
                sparse_wire.check_section_header(header, sparse_wire.PUSH_SECTION, spec, 0, held, 5, "server")


def _sparse_steps(rows_per_step, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.tensor(rows), torch.randn(len(rows), 3, dtype=torch.float64, generator=g))
            for rows in rows_per_step]


STEPS = [[0, 2], [2, 5], [], [0, 1, 5], [5]]


@pytest.mark.parametrize("make", [lambda p: torch.optim.SparseAdam(p, lr=0.1, betas=(0.8, 0.95), eps=1e-6),
                                  lambda p: torch.optim.Adagrad(p, lr=0.2, lr_decay=0.1, eps=1e-8,
                                                                initial_accumulator_value=0.3),
                                  lambda p: torch.optim.SGD(p, lr=0.2)])
def test_sparse_rules_equal_torch_on_sparse_gradients(make):
    table = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    oracle = torch.nn.Parameter(table.clone())
    torch_opt = make([oracle])
    ours = table.clone()
    probe = make([torch.nn.Parameter(torch.zeros(1))])
    rows_rule = SparseRows(sparse_rule(probe), ours, probe.param_groups[0])
    with torch.sparse.check_sparse_tensor_invariants():   # torch's optimizers build sparse tensors too
        for rows, grad in _sparse_steps(STEPS):
            oracle.grad = torch.sparse_coo_tensor(rows.view(1, -1), grad, (6, 3))
            torch_opt.step()
            rows_rule.step(rows, grad)
    assert torch.allclose(ours, oracle.detach(), rtol=1e-13, atol=1e-15)


def test_sgd_momentum_is_lazy():
    """Oracle: the rule written out per row; untouched rows keep their velocity and do not move."""
    lr, mu = 0.1, 0.9
    table = torch.zeros(6, 3, dtype=torch.float64)
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr, momentum=mu)
    rule = SparseRows(sparse_rule(probe), table, probe.param_groups[0])
    expected = torch.zeros(6, 3, dtype=torch.float64)
    velocity = torch.zeros(6, 3, dtype=torch.float64)
    for rows, grad in _sparse_steps(STEPS):
        rule.step(rows, grad)
        for row, g in zip(rows.tolist(), grad):
            velocity[row] = mu * velocity[row] + g
            expected[row] -= lr * velocity[row]
    assert torch.allclose(table, expected, rtol=1e-14, atol=1e-15)
    assert bool((table[[3, 4]] == 0).all()), "rows never touched never move"


@pytest.mark.parametrize("make,words", [(lambda p: torch.optim.RMSprop(p, lr=0.1), "RMSprop"),
                                        (lambda p: torch.optim.AdamW(p, lr=0.1), "weight_decay=0.01"),
                                        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
                                         "nesterov=True")])
def test_unsupported_sparse_optimizers_are_refused_by_name(make, words):
    with pytest.raises(RuntimeError, match=words):
        sparse_rule(make([torch.nn.Parameter(torch.zeros(1))]))


# -- sync equivalence and traffic -------------------------------------------------------------------
_RUNS: dict[tuple, list] = {}


def sync_run(world_of, optimizer, world_size, servers, steps=3, local_batch=4):
    """fns.train in sync mode, run once per argument tuple and shared by the tests that read it."""
    key = (optimizer, world_size, servers, steps, local_batch)
    if key not in _RUNS:
        _RUNS[key] = world_of(world_size).run(fns.train, "sync", optimizer, steps, local_batch, servers)
    return _RUNS[key]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("world_size,servers", [(3, 1), (4, 2)])
def test_sparse_sync_equals_one_process_with_global_batch(world_of, optimizer, world_size, servers):
    steps, local_batch = 3, 4
    results = sync_run(world_of, optimizer, world_size, servers, steps, local_batch)
    workers = world_size - servers
    oracle = fns.single_process(optimizer, steps, workers, local_batch)
    for _, params, stats, _, _ in workers_of(results):
        assert relative_error(params, oracle) <= 1e-12
        assert stats["steps"] == steps
    for _, stats, _ in servers_of(results):
        assert stats["version"] == steps and stats["staleness_histogram"] == {0: workers * steps}
        if optimizer == "adagrad":   # one accumulator per element held: the dense shard's and each block's, once
            held = stats["shard_elements"] + sum(rows * fns.DIM for rows in stats["tables"].values())
            assert stats["optimizer_state_bytes"] == held * 8, (stats["optimizer_state_bytes"], held * 8)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,world_size,servers", [("sync", 4, 2), ("async", 2, 1)])
def test_clipping_counts_the_touched_rows_in_the_norm(world_of, mode, world_size, servers):
    """max_grad_norm with sparse tables: the norm covers the dense shard and every touched row (sync:
    the servers' mean rows, over both servers; async with one worker: the rows it pushes). Oracle: one
    process with dense tables and torch.nn.utils.clip_grad_norm_; 0.5 is below every step's norm
    (1.4-1.8, of which the rows are about 0.2)."""
    steps, local_batch = 3, 4
    results = world_of(world_size).run(fns.train, mode, "sgd", steps, local_batch, servers, 0.0, (0.5, 2.0))
    oracle = fns.single_process("sgd", steps, world_size - servers, local_batch, clip=(0.5, 2.0))
    unclipped = fns.single_process("sgd", steps, world_size - servers, local_batch)
    assert relative_error(unclipped, oracle) > 1e-2
    for _, params, stats, _, _ in workers_of(results):
        assert relative_error(params, oracle) <= 1e-12, f"worker rank {stats['rank']}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,servers", [(3, 1), (4, 2)])
def test_sparse_bytes_are_the_touched_and_requested_rows(world_of, world_size, servers):
    steps, local_batch, esize = 3, 4, 8
    results = sync_run(world_of, "sgd", world_size, servers, steps, local_batch)
    workers = world_size - servers
    ids, bags, _ = fns.global_data(steps, workers, local_batch)
    dense_bytes = sum(p.numel() for p in fns.SparseNet().out.parameters()) * esize
    row_bytes = fns.DIM * esize
    for _, _, stats, traffic, untouched_ok in workers_of(results):
        index = stats["rank"] - servers
        unique = [torch.unique(ids[s].chunk(workers)[index]).numel() + torch.unique(bags[s].chunk(workers)[index]).numel()
                  for s in range(steps)]
        # push: (8 + D*esize) per unique touched row, plus the whole dense part, per step
        assert traffic["per_op"]["ps/push"]["sent"] == sum(u * (8 + row_bytes) + dense_bytes for u in unique)
        # pull (before the final whole pull): exactly the requested rows, plus the dense part
        assert traffic["per_op"]["ps/pull"]["received"] == sum(u * row_bytes + dense_bytes for u in unique)
        assert traffic["per_op"]["ps/pull/ids"]["sent"] == sum(u * 8 for u in unique)
        assert untouched_ok, "rows the worker never asked for were written"
    # each server receives 8 bytes per row a worker asked it for by name and nothing more: the final
    # whole-table pull (rows=None) names no row (FLAG_WHOLE_TABLE), so it costs its header alone; the
    # headers are every worker's steps PULLs, steps PUSHes, the final PULL and the CLOSE, each one
    # message of 1 + 2 headers (a header and one ROWS section per table) of 8 int64 words
    for server, (_, _, traffic) in enumerate(servers_of(results)):
        named = sum(int((torch.unique(ids[s].chunk(workers)[w]) % servers == server).sum())
                    + int((torch.unique(bags[s].chunk(workers)[w]) % servers == server).sum())
                    for s in range(steps) for w in range(workers))
        assert traffic["per_op"]["ps/pull/ids"]["received"] == named * 8, (server, named)
        assert traffic["control_bytes_received"] == workers * (2 * steps + 2) * 3 * 8 * 8, server
    touched = {int(r) for r in ids.reshape(-1)} | {fns.EMB_ROWS + int(r) for r in bags.reshape(-1)}
    rows_in = sum(stats["rows_in"] for _, stats, _ in servers_of(results))
    per_worker_unique = sum(torch.unique(ids[s].chunk(workers)[w]).numel() + torch.unique(bags[s].chunk(workers)[w]).numel()
                            for s in range(steps) for w in range(workers))
    assert rows_in == per_worker_unique
    assert max(touched) < fns.EMB_ROWS + fns.HOT_BAG and all(t < fns.HOT_EMB or t >= fns.EMB_ROWS for t in touched)


# -- stopping early and re-cutting the servers' state ------------------------------------------------
@pytest.mark.timeout(300)
def test_a_stop_on_one_server_resumes_on_two_servers_equal_to_one_process(world_of):
    """1 server + 2 workers, Adagrad: the server asks to stop once it is at version 2 (serve(stop)
    polls between messages, so the ask is read when version 3 is stepped); both workers close on
    clock 3; the state (rows, per-row accumulators, dense Adagrad state, clocks) is
    the same on every rank and, loaded by 2 servers + 2 workers, finishes equal to one process with
    torch's Adagrad over all 5 steps (1e-12). Re-cutting without the accumulators fails it."""
    steps, local_batch = 5, 4
    stopped = world_of(3).run(fns.stop_and_save, "adagrad", steps, local_batch, 1, 2)
    clocks = [clock for role, clock, _ in stopped if role == "worker"]
    assert clocks == [3, 3], clocks
    states = [state for _, _, state in stopped]
    assert states[0]["version"] == 3 and states[0]["clocks"] == [3, 3] and states[0]["servers"] == 1
    for other in states[1:]:
        for name, table in states[0]["tables"].items():
            assert torch.equal(table["rows"], other["tables"][name]["rows"])
            assert torch.equal(table["state"]["sum"], other["tables"][name]["state"]["sum"])
    finished = world_of(4).run(fns.resume_and_finish, "adagrad", steps, local_batch, 2, states[0])
    oracle = fns.single_process("adagrad", steps, 2, local_batch)
    for role, params in finished:
        if role == "worker":
            assert relative_error(params, oracle) <= 1e-12


# -- async and ssp -----------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_sparse_ssp_bound_zero_behaves_as_sync(world_of):
    """The straggler sleeps between its push and its next pull, so the fast worker's next push is applied
    before the straggler pulls: bound 0 must answer from the tables as they were at the clock boundary.
    SSP applies each push on its own (gradient / W), which plain SGD makes equal to one averaged step."""
    steps, local_batch = 4, 4
    ssp = world_of(3).run(fns.train, "ssp", "sgd", steps, local_batch, 1, 0.05)
    oracle = fns.single_process("sgd", steps, 2, local_batch)
    for _, params, _, _, _ in workers_of(ssp):
        assert relative_error(params, oracle) <= 1e-12


@pytest.mark.timeout(300)
def test_sparse_async_records_staleness(world_of, tmp_path):
    steps = 5
    results = world_of(3).run(fns.straggling_async, steps, str(tmp_path))
    (_, stats), = servers_of(results)
    assert sum(stats["staleness_histogram"].values()) == 2 * steps
    assert max(stats["staleness_histogram"]) == steps, "the straggler's first push lands on version 5"


# -- bad input ---------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_bad_pull_rows_are_refused_with_the_reason(world_of):
    results = world_of(2).run(fns.bad_pull_rows)
    errors = results[1]
    assert errors[0][0] == "ValueError" and "out.weight" in errors[0][1] and "emb.weight" in errors[0][1]
    assert errors[1][0] == "ValueError" and "50" in errors[1][1] and "0..49" in errors[1][1]
    assert errors[2][0] == "ValueError" and "-1" in errors[2][1]
    assert errors[3][0] == "ValueError" and "int64" in errors[3][1]
    assert errors[4][0] == "ValueError" and "1-D" in errors[4][1]
    assert errors[5][0] == "TypeError" and "dict" in errors[5][1]
    # the first and last rows are no error, and come back as the server holds them
    assert errors[6:] == [("no error", ""), ("no error", "")], errors[6:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,words", [("out_of_range", "row id 50 for table emb.weight, which has rows 0..49"),   # row R
                                        ("duplicate", "row 3 of table emb.weight more than once")])
def test_bad_sparse_push_is_refused_names_the_worker_and_changes_nothing(world_of, kind, words):
    pool = world_of(3)
    try:
        results = pool.run(fns.malformed_push, kind)
    finally:
        pool.close()   # the refused messages stay queued in gloo: start the next case on a fresh world
    name, message, sender, version, unchanged = results[0]
    assert name == "ProtocolError" and sender == 2 and "rank 2" in message and words in message, message
    assert version == 0 and unchanged, "a refused push must not touch the tables"
    assert results[1][0] == "ServerAbortedError" and results[1][2] == 2


# -- word2vec: the sparse workload -------------------------------------------------------------------
SYNTACTIC_PARTNERS = [("True", "False"), ("==", "!="), ("<", ">"), ("+", "-"), ("try", "except"), ("if", "elif"),
                      ("int", "str"), ("keys", "values")]
"""Token pairs that Python code uses in the same places. On 3,000 steps of one process (batch 256,
Adagrad 0.2) their partner ranks were 1, 3, 2, 1, 2, 6, 14, 47 among 31,314 tokens; untrained, the
expected rank is ~15,000."""


@pytest.mark.timeout(300)
def test_word2vec_puts_syntactic_partners_near_each_other():
    """Robust by construction: it needs 5 of 8 partners within the nearest 50 of ~31,000 tokens (top
    0.2%); trained runs put 7 of 8 within 20, and a random table puts a partner there with probability
    50/31,000, so a pass by chance is about (8 choose 5) * (0.0016)^5 = 6e-13. The same check on the
    untrained table is the control."""
    from gradsync.train import tokens
    from gradsync.train.word2vec import SkipGram, negative_sampling_loss, neighbour_rank

    torch.set_num_threads(1)
    vocab = tokens.vocabulary()
    train, held_out = tokens.stdlib_tokens()
    torch.manual_seed(0)
    model = SkipGram(len(vocab), 64)
    model.make_sparse()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.2)

    def near(m):
        return sum(neighbour_rank(m, vocab, a, b) <= 50 for a, b in SYNTACTIC_PARTNERS)

    assert near(model) <= 1, "control: an untrained table must not pass"
    held_x = held_out.tensors[0][:20000]
    with torch.no_grad():
        untrained_loss = float(negative_sampling_loss(model(held_x)))
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    for step in range(3000):
        x, _ = train[order[step * 256:(step + 1) * 256]]
        optimizer.zero_grad()
        negative_sampling_loss(model(x)).backward()
        optimizer.step()
    with torch.no_grad():
        trained_loss = float(negative_sampling_loss(model(held_x)))
    assert trained_loss < 0.9 * untrained_loss, (trained_loss, untrained_loss)
    ranks = {f"{a}/{b}": neighbour_rank(model, vocab, a, b) for a, b in SYNTACTIC_PARTNERS}
    assert near(model) >= 5, ranks


@pytest.mark.timeout(300)
def test_word2vec_sparse_ps_sync_equals_one_dense_process(tmp_path):
    """gradsync train, ps-sync (1 server, 2 workers, batch 64 each, sparse rows) against --strategy local
    (batch 128, dense tables, torch's Adagrad): same samples, same parameters up to float32 rounding."""
    from gradsync.train.config import TrainConfig
    from gradsync.train.launcher import run

    common = dict(model="word2vec", steps=8, lr=0.2, lr_scaling="none", warmup_steps=4, quiet=True)
    ps = run(TrainConfig(workers=3, strategy="ps-sync", batch_size=64, out=str(tmp_path / "ps"), **common))
    local = run(TrainConfig(workers=1, strategy="local", batch_size=128, out=str(tmp_path / "local"), **common))
    server, worker = ps[0]["ps"], ps[1]
    assert server["role"] == "server" and server["rows_in"] > 0
    oracle = local[0]["params"]
    # float32, and Adagrad's g / (sqrt(sum g^2) + eps) turns the last-bit differences of a row whose
    # contributions nearly cancel (two halves summed vs one batch) into visible ones: rounding, not drift
    assert relative_error(worker["params"], oracle) <= 2e-3
    ours, theirs = worker["summary"]["test_loss"], local[0]["summary"]["test_loss"]
    assert abs(ours - theirs) <= 1e-4 * theirs, (ours, theirs)


# -- cost model (no processes) -----------------------------------------------------------------------
def test_sparse_cost_model_matches_the_docstring_example():
    from gradsync.sim.cost import Link
    from gradsync.sim.sparse import crossover_rows, sparse_costs

    link = Link(alpha=5e-6, beta=8 / 10e9, gamma=0.0)          # 10 Gbit/s
    table_bytes = 50_000 * 128 * 4
    ring_s = 2 * 3 * 5e-6 + 2 * 3 / 4 * table_bytes * 8 / 10e9  # 30.78 ms
    u_star = crossover_rows(50_000, 128, 4, link)
    assert u_star == pytest.approx((ring_s - 8 * 5e-6) / (4 * (16 + 1024) * 8 / 10e9))
    assert 9_000 < u_star < 9_400
    ps, ring, gather = sparse_costs(50_000, 128, u_star, 4, link, 0.0)
    assert ps.comm_s == pytest.approx(ring.comm_s) and ring.busiest_link_bytes == 2 * 3 / 4 * table_bytes
    ps, ring, gather = sparse_costs(50_000, 128, 1000, 4, link, 0.0)
    assert ps.busiest_link_bytes == 4 * 1000 * (8 + 512 + 8) + 4 * 1000 * 512
    assert gather.busiest_link_bytes == 3 * 1000 * (8 + 512)
    assert ring.comm_s / ps.comm_s > 9
    two_servers = sparse_costs(50_000, 128, 1000, 4, link, 0.0, servers=2)[0]
    assert two_servers.busiest_link_bytes == ps.busiest_link_bytes / 2
