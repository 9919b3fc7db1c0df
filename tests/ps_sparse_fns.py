"""Rank functions for the sparse parameter-server tests (module level so ranks can import them)."""

import time

import torch
from torch import nn

import gradsync as gs
from gradsync.comm.world_transport import default_transport
from gradsync.ps import protocol as wire
from gradsync.ps import sparse_wire

import ps_fns

EMB_ROWS, BAG_ROWS, DIM, BAG_LEN, CLASSES = 50, 30, 4, 3, 3
HOT_EMB, HOT_BAG = 40, 24
"""Batches only draw ids below these: rows HOT.. are never touched (the 'never sent' check)."""


class SparseNet(nn.Module):
    """A sparse nn.Embedding and a sparse nn.EmbeddingBag (sum) feeding a dense linear classifier."""

    def __init__(self, seed=0, dtype=torch.float64, sparse=True):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(EMB_ROWS, DIM, sparse=sparse)
        self.bag = nn.EmbeddingBag(BAG_ROWS, DIM, mode="sum", sparse=sparse)
        self.out = nn.Linear(2 * DIM, CLASSES)
        self.to(dtype)

    def forward(self, ids, bags):
        return self.out(torch.cat([self.emb(ids), self.bag(bags)], 1))


def global_data(steps, workers, local_batch):
    """Per step: ids (W*b,), bags (W*b, L), labels (W*b,); ids skewed towards low rows (Zipf-like)."""
    g = torch.Generator().manual_seed(11)
    n = workers * local_batch
    ids = (torch.rand(steps, n, generator=g) ** 3 * HOT_EMB).long()
    bags = (torch.rand(steps, n, BAG_LEN, generator=g) ** 2 * HOT_BAG).long()
    labels = torch.randint(0, CLASSES, (steps, n), generator=g)
    return ids, bags, labels


def optimizer_fn(kind):
    if kind == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.5)
    if kind == "adagrad":
        return lambda params: torch.optim.Adagrad(params, lr=0.3, lr_decay=0.01, initial_accumulator_value=0.1)
    raise ValueError(kind)


def single_process(opt_kind, steps, workers, local_batch, clip=None):
    """The oracle: one process, torch's own optimizer on the sparse gradients, batch W*b. ``clip``:
    (max_norm, norm_type) for torch.nn.utils.clip_grad_norm_ before each step, which takes no sparse
    gradient, so the tables are dense then (plain SGD moves untouched rows by 0 either way)."""
    model = SparseNet(sparse=clip is None)
    optimizer = optimizer_fn(opt_kind)(list(model.parameters()))
    ids, bags, labels = global_data(steps, workers, local_batch)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(ids[step], bags[step]), labels[step]).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), *clip)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(mode, opt_kind, steps, local_batch, num_servers, straggler_sleep_s=0.0, clip=None):
    """Workers pull the rows of their next batch, backward, push; one final whole pull. The last worker
    sleeps ``straggler_sleep_s`` after each push, so the others run ahead (ssp) before its next pull.
    ``clip``: (max_grad_norm, norm_type) for the ParameterServer.

    Returns ("server", stats, traffic) or ("worker", params, stats, traffic, untouched_ok) where
    untouched_ok says rows this worker never asked for kept the NaN it planted in them."""
    w = gs.world()
    model = SparseNet(seed=w.rank)   # rank 0's parameters win the broadcast
    clipping = dict(max_grad_norm=clip[0], norm_type=clip[1]) if clip else {}
    ps = gs.ParameterServer(model, optimizer_fn(opt_kind), num_servers=num_servers, mode=mode, **clipping)
    gs.traffic_reset()
    if ps.is_server:
        ps.serve()
        return "server", ps.stats(), gs.traffic()
    workers = w.world_size - num_servers
    index = w.rank - num_servers
    ids, bags, labels = global_data(steps, workers, local_batch)
    with torch.no_grad():
        model.emb.weight.fill_(float("nan"))
        model.bag.weight.fill_(float("nan"))
    for step in range(steps):
        my_ids, my_bags = ids[step].chunk(workers)[index], bags[step].chunk(workers)[index]
        ps.pull(rows={"emb.weight": my_ids, "bag.weight": my_bags.reshape(-1)})
        loss = nn.functional.cross_entropy(model(my_ids, my_bags), labels[step].chunk(workers)[index])
        assert torch.isfinite(loss), "a row the batch needs was not pulled"
        loss.backward()
        ps.push()
        if w.rank == w.world_size - 1:
            time.sleep(straggler_sleep_s)
    untouched_ok = bool(model.emb.weight[HOT_EMB:].isnan().all()) and bool(model.bag.weight[HOT_BAG:].isnan().all())
    traffic = gs.traffic()
    ps.pull()
    ps.close()
    return "worker", {n: p.detach().clone() for n, p in model.named_parameters()}, ps.stats(), traffic, untouched_ok


def straggling_async(steps, sync_dir):
    """Async, one server, workers 1 and 2: rank 2 pushes its first step only after rank 1's last pull.

    Returns ("server", stats) or ("worker", rank)."""
    w = gs.world()
    model = SparseNet()
    ps = gs.ParameterServer(model, optimizer_fn("sgd"), num_servers=1, mode="async")
    if ps.is_server:
        ps.serve()
        return "server", ps.stats()
    ids, bags, labels = global_data(steps, 2, 4)
    for step in range(steps):
        ps_fns._mark(sync_dir, w.rank, step)
        my_ids, my_bags = ids[step].chunk(2)[w.rank - 1], bags[step].chunk(2)[w.rank - 1]
        ps.pull(rows={"emb.weight": my_ids, "bag.weight": my_bags.reshape(-1)})
        nn.functional.cross_entropy(model(my_ids, my_bags), labels[step].chunk(2)[w.rank - 1]).backward()
        if w.rank == 2 and step == 0:
            ps_fns._wait_for_marks(sync_dir, [1], steps)
        ps.push()
    ps_fns._mark(sync_dir, w.rank, steps)
    ps.pull()
    ps.close()
    return "worker", w.rank


def bad_pull_rows():
    """Each bad pull(rows=...) a worker can make, and the error it gets (no message leaves the worker)."""
    model = SparseNet()
    ps = gs.ParameterServer(model, optimizer_fn("sgd"), num_servers=1, mode="sync")
    if ps.is_server:
        ps.serve()
        return "server"
    errors = []
    for rows in ({"out.weight": torch.tensor([0])}, {"emb.weight": torch.tensor([EMB_ROWS])},
                 {"emb.weight": torch.tensor([-1])}, {"emb.weight": torch.tensor([1.0])},
                 {"emb.weight": torch.tensor([[1, 2]])}, [1, 2]):
        try:
            ps.pull(rows=rows)
            errors.append(("no error", ""))
        except (ValueError, TypeError) as exc:
            errors.append((type(exc).__name__, str(exc)))
    initial = SparseNet().emb.weight.detach()
    for row in (0, EMB_ROWS - 1):   # the boundary ids a pull may name
        with torch.no_grad():
            model.emb.weight[row] = -1.0
        ps.pull(rows={"emb.weight": torch.tensor([row])})
        same = torch.equal(model.emb.weight[row].detach(), initial[row])
        errors.append(("no error", "") if same else ("wrong row", f"row {row} differs from the server's"))
    ps.close()
    return errors


def malformed_push(kind):
    """Rank 2 pushes rows no correct client sends; the server must refuse, name rank 2, change nothing.

    Returns, on the server: (error name, message, sender, version, tables unchanged)."""
    w = gs.world()
    model = SparseNet()
    ps = gs.ParameterServer(model, optimizer_fn("sgd"), num_servers=1, mode="sync")
    if ps.is_server:
        before = [t.block.detach().clone() for t in ps._server.shard.tables]
        try:
            ps.serve()
        except Exception as exc:  # noqa: BLE001 - the error is the result
            server = ps._server
            unchanged = all(torch.equal(t.block.detach(), b) for t, b in zip(server.shard.tables, before))
            return type(exc).__name__, str(exc), getattr(exc, "sender", None), server.version, unchanged
        return "no error", "", None, ps._server.version, None
    try:
        if w.rank == 2:
            client = ps._client
            transport = default_transport()
            dense = torch.zeros(sum(p.numel() for p in client.params), dtype=torch.float64)
            bad = {"out_of_range": [3, EMB_ROWS], "duplicate": [3, 5, 3]}[kind]   # row R: one past the last
            rows = [(torch.tensor(bad if spec.name == "emb.weight" else [1], dtype=torch.int64), spec)
                    for spec, _ in client.tables]
            rows = [(ids, torch.ones(len(ids), DIM, dtype=torch.float64), spec) for ids, spec in rows]
            sections = [sparse_wire.section_header(sparse_wire.PUSH_SECTION, 2, 0, spec, ids, values)
                        for ids, values, spec in rows]
            header = wire.Header(wire.PUSH, 2, 0, 0, dense.numel(), dense.numel() * 8, wire.checksum(dense))
            body = sparse_wire.pack([ids for ids, _, _ in rows], [values for _, values, _ in rows])
            sends = [transport.isend(wire.message(header, sections, len(client.tables)), 0, "test", control=True,
                                     tag=client.channel.header_tag),
                     transport.isend(dense, 0, "test", tag=client.channel.payload_tag),
                     transport.isend(body, 0, "test", tag=client.channel.payload_tag)]
            for handle in sends:
                handle.wait()
        else:
            ps.pull(rows=None)
            model(torch.tensor([1]), torch.tensor([[1, 2, 3]])).sum().backward()
            ps.push()
        time.sleep(0.1)
        ps.pull()
        ps.close()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return type(exc).__name__, str(exc), getattr(exc, "culprit", None), None, None
    return "no error", "", None, None, None


def stop_and_save(opt_kind, steps, local_batch, num_servers, stop_at_version):
    """sync training as ``train``, but the servers ask to stop (serve(stop)) once their version reaches
    ``stop_at_version``; workers close when a pull says so. Returns (role, clock or None, state_dict)."""
    w = gs.world()
    model = SparseNet()
    ps = gs.ParameterServer(model, optimizer_fn(opt_kind), num_servers=num_servers, mode="sync")
    if ps.is_server:
        ps.serve(stop=lambda: ps._server.version >= stop_at_version)
        return "server", None, ps.state_dict()
    clock = _train_from(ps, model, 0, steps, local_batch, w.world_size - num_servers, w.rank - num_servers)
    ps.close()
    return "worker", clock, ps.state_dict()


def resume_and_finish(opt_kind, steps, local_batch, num_servers, state):
    """Continue ``state`` (any number of servers wrote it) on this world; return the workers' final parameters."""
    w = gs.world()
    model = SparseNet()
    ps = gs.ParameterServer(model, optimizer_fn(opt_kind), num_servers=num_servers, mode="sync")
    ps.load_state_dict(state)
    if ps.is_server:
        ps.serve()
        return "server", None
    index = w.rank - num_servers
    _train_from(ps, model, state["clocks"][index], steps, local_batch, w.world_size - num_servers, index)
    ps.pull()
    ps.close()
    return "worker", {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_from(ps, model, first, steps, local_batch, workers, index):
    """Steps ``first``..``steps``-1 of the global batches (this worker's share); stops early when a
    pull says the job ends. Returns the worker's clock."""
    ids, bags, labels = global_data(steps, workers, local_batch)
    step = first
    while step < steps:
        my_ids, my_bags = ids[step].chunk(workers)[index], bags[step].chunk(workers)[index]
        ps.pull(rows={"emb.weight": my_ids, "bag.weight": my_bags.reshape(-1)})
        if ps.stopping:
            break
        nn.functional.cross_entropy(model(my_ids, my_bags), labels[step].chunk(workers)[index]).backward()
        ps.push()
        step += 1
    return step
