"""The benchmark commands run, print ours beside the baseline, and their measured bytes match the formulas."""

import json

import pytest
import torch

from gradsync.bench.collectives import parse_size
from gradsync.cli import main


def test_parse_size():
    assert parse_size("4K") == 4096 and parse_size("16M") == 16 << 20 and parse_size("100") == 100
    with pytest.raises(ValueError, match="K/M/G suffix"):
        parse_size("lots")


@pytest.mark.timeout(180)
def test_bench_collectives_rows(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GRADSYNC_TRANSPORT", raising=False)   # --transport tcp,shm would contradict a pinned one
    out = tmp_path / "rows.json"
    assert main(["bench", "collectives", "--workers", "3", "--sizes", "4K,96K", "--reps", "2", "--transport", "tcp,shm",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["memory_copy_GBps"] > 0
    by_transport = {t: {r["algorithm"] for r in rows if r["transport"] == t} for t in ("gloo", "tcp", "shm")}
    assert by_transport == {"gloo": {"native"}, "tcp": {"ring", "halving_doubling", "tree", "naive", "auto"},
                            "shm": {"ring", "halving_doubling", "tree", "naive", "shared_memory", "auto"}}
    # auto shows what it picked: on one host over shared memory, the shared-memory all-reduce
    assert {r["picked"] for r in rows if r["algorithm"] == "auto" and r["transport"] == "shm"} == {"shared_memory"}
    n_ranks = 3
    for r in rows:
        # the same untimed warm-up on both sides; each call reduces fresh ones, so the last result is N
        assert r["warmup_calls"] == 1 and r["result_correct"], r
        if r["algorithm"] == "native":
            assert r["bytes_per_rank"] is None and r["ratio_vs_native"] == 1.0
            continue
        # the busiest rank's bytes, in closed form (the meter's, and the formula column the bench prints)
        n = r["size"] // 4
        if r["algorithm"] == "ring":
            # each rank sends every chunk but one in the reduce-scatter and every chunk but one in the
            # all-gather; with 3 ranks one rank leaves out both other ranks' chunks: 2n - c1 - c2 floats
            chunks = [n // n_ranks + (1 if i < n % n_ranks else 0) for i in range(n_ranks)]
            expected = 4 * max(2 * n - chunks[(k + 1) % n_ranks] - chunks[(k - 1) % n_ranks] for k in range(n_ranks))
        elif r["algorithm"] == "naive":   # rank 0 sends the result to each of the others
            expected = (n_ranks - 1) * r["size"]
        elif "shared_memory" in (r["algorithm"], r["picked"]):
            # 4K and 96K are below docs/transports.md's bound: the direct all-reduce reads all of both others'
            expected = (n_ranks - 1) * r["size"]
        else:
            continue
        assert r["bytes_per_rank"] == r["formula_bytes"] == expected, r
    printed = capsys.readouterr().out
    assert "native" in printed and "ring" in printed and "memory copy on this host" in printed
    assert "ours/MPI" not in printed   # without --peers gloo,mpi the table is as it always was


@pytest.mark.timeout(180)
def test_bench_collectives_measures_the_transport_gradsync_transport_names(tmp_path, monkeypatch):
    """GRADSYNC_TRANSPORT=tcp gradsync bench collectives (the documented TCP command) measures TCP."""
    monkeypatch.setenv("GRADSYNC_TRANSPORT", "tcp")
    out = tmp_path / "rows.json"
    assert main(["bench", "collectives", "--workers", "2", "--sizes", "4K", "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["algorithm"], r["transport"]) for r in rows} == {
        ("native", "gloo"), ("ring", "tcp"), ("halving_doubling", "tcp"), ("tree", "tcp"), ("naive", "tcp"),
        ("auto", "tcp")}


@pytest.mark.timeout(60)
def test_bench_collectives_refuses_a_transport_that_contradicts_gradsync_transport(monkeypatch, capsys):
    monkeypatch.setenv("GRADSYNC_TRANSPORT", "tcp")
    assert main(["bench", "collectives", "--workers", "2", "--sizes", "4K", "--reps", "1", "--transport", "tcp,shm"]) == 2
    assert "--transport shm contradicts GRADSYNC_TRANSPORT=tcp" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_simulate_check_measures_every_row_over_one_transport(monkeypatch):
    from gradsync.bench import predict
    from gradsync.sim.cost import Link

    monkeypatch.setenv("GRADSYNC_TRANSPORT", "tcp")
    result = predict.run(Link(), [2], [4096], reps=1, batch=2)
    assert [(r["what"], r["transport"]) for r in result["rows"]] == [
        ("ring all-reduce", "tcp"), ("DDP step (mlp, 25 MiB)", "tcp")]


@pytest.mark.timeout(60)
def test_simulate_check_refuses_a_calibration_of_another_transport(tmp_path, monkeypatch, capsys):
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"alpha": 1e-5, "beta": 1e-10, "gamma": 1e-11, "transport": "shm"}))
    monkeypatch.setenv("GRADSYNC_CALIBRATION", str(calibration))
    monkeypatch.setenv("GRADSYNC_TRANSPORT", "tcp")
    assert main(["simulate", "--params", "1", "--workers", "2", "--calibrated", "--check", "2"]) == 2
    assert "fitted over shm but this check measures tcp" in capsys.readouterr().err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backends", ["gradsync", pytest.param("gloo,gradsync", marks=pytest.mark.slow)])
def test_bench_ddp_of_torch_ddp_on_each_backend(tmp_path, capsys, backends):
    """`gradsync bench ddp --backend gloo,gradsync` (docs/backend.md): torch's own DDP in a torchrun of its own per
    backend, the first one the baseline, and on gradsync the API layer beside gs.all_reduce. The
    default run takes the gradsync backend alone (one torchrun; gloo's side is torch's own code), -m
    slow both, as that page's command does."""
    out = tmp_path / "backends.json"
    assert main(["bench", "ddp", "--backend", backends, "--workers", "2", "--model", "mlp", "--steps", "1",
                 "--rounds", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["backend"], r["program"]): r for r in result["steps"]}
    programs = ["torch DDP", "no communication", "torch DDP, no-op hook", "torch DDP, bucket views"]
    assert list(rows) == [(b, p) for b in backends.split(",") for p in programs]
    first = backends.split(",")[0]
    for program in programs:
        assert rows[(first, program)]["ratio"] == 1.0
        assert rows[("gradsync", program)]["ratio"] == pytest.approx(
            rows[("gradsync", program)]["step_ms"] / rows[(first, program)]["step_ms"])
    for b in backends.split(","):
        assert rows[(b, "torch DDP")]["comm_ms"] == pytest.approx(
            rows[(b, "torch DDP")]["step_ms"] - rows[(b, "torch DDP, no-op hook")]["step_ms"])
        assert rows[(b, "no communication")]["vs_floor"] == 1.0
    assert all(r["step_ms"] > 0 and len(r["runs_ms"]) == 1 for r in rows.values())
    assert [r["bytes"] for r in result["api"]] == [4 << 10, 64 << 10, 1 << 20, 16 << 20]
    assert all(r["api_us"] > 0 and r["direct_us"] > 0 for r in result["api"])
    assert "api/direct" in capsys.readouterr().out


@pytest.mark.timeout(180)
def test_bench_ddp_rows(tmp_path):
    out = tmp_path / "ddp.json"
    assert main(["bench", "ddp", "--workers", "2", "--model", "cnn", "--steps", "2", "--bucket-mb", "0.1,25",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["impl"] for r in rows] == ["torch DDP", "gradsync 0.1 MiB", "gradsync 25 MiB", "no communication",
                                         "+ one gradient copy"]
    params_bytes = rows[0]["params"] * 4
    for r in rows[1:3]:
        assert r["bytes_per_step"] == params_bytes  # ring, N=2: 2(N-1)/N * M = M (when every bucket splits evenly)


def test_the_one_copy_reference_copies_every_gradient_of_each_backward():
    from gradsync.bench.ddp import _copy_each_gradient

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    flat = _copy_each_gradient(model)
    for seed in (1, 2):   # the second backward accumulates: the copy is of the accumulated gradient
        model(torch.randn(7, 5, generator=torch.Generator().manual_seed(seed))).square().sum().backward()
        assert torch.equal(flat, torch.cat([p.grad.reshape(-1) for p in model.parameters()]))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers, steps", [(2, 1), pytest.param(3, 2, marks=pytest.mark.slow)])   # slow: a larger world
def test_bench_ps_rows_and_exact_link_bytes(tmp_path, workers, steps):
    out = tmp_path / "ps.json"
    assert main(["bench", "ps", "--workers", str(workers), "--steps", str(steps), "--batch-size", "8",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["impl"], r["straggler"]) for r in rows] == [
        (impl, straggler) for straggler in (False, True) for impl in ("ps-sync", "ssp s=2", "ps-async", "ring DDP")]
    delays = {r["delay_s"] for r in rows if r["straggler"]}
    assert len(delays) == 1 and delays.pop() > 0   # every strategy's straggler is delayed the same
    assert {r["delay_s"] for r in rows if not r["straggler"]} == {0.0}
    # the bench's MLP, 256 -> 1024 -> 1024 -> 10 in float32: M bytes
    m_bytes = 4 * (256 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10)
    for r in rows:
        # measured by the meter on the server (PS: W pushes in + W pulls out a step: 2 W M) or the
        # rank (ring: sent, 2(W-1)/W M), against the closed forms and the bench's formula column
        expected = 2 * workers * m_bytes if r["impl"] != "ring DDP" else 2 * (workers - 1) / workers * m_bytes
        assert r["link_bytes_per_step"] == pytest.approx(expected, rel=1e-12) == r["formula_bytes"], r
        assert r["samples_per_s"] > 0
        assert r["transport"] == "tcp" if r["impl"] != "ring DDP" else r["transport"] in ("tcp", "shm")


@pytest.mark.slow   # another route: test_ps_sparse.py trains word2vec's sparse rows under the PS by default
@pytest.mark.timeout(300)
def test_bench_ps_word2vec_rows(tmp_path, monkeypatch):
    """`gradsync bench ps --model word2vec` on a small corpus (the bench reads 4M tokens; here the first
    100,000): every implementation trains the same samples from the same tables with Adagrad, so the
    synchronous ones end on the same held-out loss; the dense ring's busiest link carries
    2 x 2(W-1)/W x 2 V D x 4 bytes a step (sent and received), the sparse PS's a small part of it."""
    from gradsync.bench import ps_sparse

    monkeypatch.setattr(ps_sparse, "BENCH_TOKENS", 100_000)
    monkeypatch.setattr(ps_sparse, "HELD_OUT_SAMPLES", 2_000)
    out = tmp_path / "w2v.json"
    assert main(["bench", "ps", "--model", "word2vec", "--workers", "2", "--steps", "2", "--rounds", "1",
                 "--batch-size", "16", "--json", str(out)]) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"sparse PS S=1 sync", "sparse PS S=1 async", "sparse PS S=2 sync", "sparse PS S=2 async",
                         "ring DDP (dense)", "torch DDP (sparse, gloo)"}
    ring = rows["ring DDP (dense)"]
    v, d = ring["table_rows"], ring["dim"]
    assert ring["busiest_link_bytes"] == 2 * 2 * (2 - 1) / 2 * 2 * v * d * 4
    sync = [rows[name]["held_out_loss"] for name in ("sparse PS S=1 sync", "sparse PS S=2 sync", "ring DDP (dense)",
                                                      "torch DDP (sparse, gloo)")]
    assert max(sync) - min(sync) <= 1e-5 * abs(sync[0]), sync
    for name in ("sparse PS S=1 sync", "sparse PS S=2 sync"):
        assert 0 < rows[name]["busiest_link_bytes"] < ring["busiest_link_bytes"] / 10, rows[name]   # 33x here


@pytest.mark.timeout(180)
def test_bench_zero1_rows(tmp_path):
    out = tmp_path / "zero1.json"
    assert main(["bench", "zero1", "--workers", "2", "--steps", "1", "--batch-size", "2", "--json", str(out)]) == 0
    ddp, zero = json.loads(out.read_text())
    assert (ddp["impl"], zero["impl"]) == ("ddp + AdamW", "zero1 AdamW")
    assert ddp["state_bytes"] == 8 * ddp["params"]              # AdamW m and v in float32
    assert abs(zero["state_bytes"] - ddp["state_bytes"] / 2) <= 8 * 2   # 1/N, up to one element per bucket
    assert zero["bytes_sent_per_step"] == ddp["params"] * 4     # N=2: 2(N-1)/N*M = M


@pytest.mark.slow   # another route to test_preempt.py's trials
@pytest.mark.timeout(300)
def test_bench_faults_preempt_trial(tmp_path):
    """`gradsync bench faults --preempt` (docs/reliability.md), one trial of the one-process strategy:
    SIGTERM, exit 75 with the checkpoint at the last trained step, the printed resume command run, and
    the interrupted epoch's samples each trained once over both runs."""
    out = tmp_path / "preempt.json"
    assert main(["bench", "faults", "--preempt", "--strategies", "local", "--trials", "1", "--workers", "1",
                 "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["strategy"] == "local" and row["clean"] and row["exit_code"] == 75, row
    assert row["steps_lost"] == 0 and row["samples_missing"] == 0 and row["samples_repeated"] == 0, row
    assert 0 < row["signal_to_exit_s"] and 0 < row["restart_to_first_step_s"], row


def test_mpi_launch_sets_root_variables_and_oversubscribe_only_when_needed(monkeypatch):
    from gradsync.bench import mpi_peer

    monkeypatch.setattr(mpi_peer, "usable_cores", lambda: 2)
    monkeypatch.setattr(mpi_peer.os, "geteuid", lambda: 0)
    args, env, notes = mpi_peer.launch_settings(4)
    assert args == ["--oversubscribe"] and env == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    assert "--oversubscribe (4 ranks > 2 cores)" in notes
    monkeypatch.setattr(mpi_peer.os, "geteuid", lambda: 1000)
    assert mpi_peer.launch_settings(2) == ([], {}, [])


def test_peers_must_name_known_baselines_and_gloo(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "collectives", "--peers", "mpi"])
    assert "choose baselines from gloo, mpi" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_bench_collectives_with_mpi_requested_and_missing_is_an_error_with_the_install_command(tmp_path, capsys,
                                                                                              monkeypatch):
    """--peers gloo,mpi where mpirun is missing: exit 2 before anything is measured, one line with the
    reason and the install command exactly as a shell takes it (brackets included)."""
    from gradsync.bench import collectives, mpi_peer

    monkeypatch.setattr(mpi_peer, "find_mpirun", lambda: None)
    monkeypatch.setattr(collectives, "run", lambda *a, **k: pytest.fail("a benchmark ran"))
    out = tmp_path / "rows.json"
    assert main(["bench", "collectives", "--workers", "2", "--sizes", "4K", "--reps", "1", "--algorithms", "ring",
                 "--peers", "gloo,mpi", "--json", str(out)]) == 2
    printed = capsys.readouterr()
    assert printed.err.count("\n") == 1 and "no mpirun beside this Python or on PATH" in printed.err, printed.err
    assert 'pip install -e ".[bench]"' in printed.err and not out.exists()


def test_the_mpi_peer_reduces_memory_from_torchs_allocator_as_ours_does():
    """numpy's own arrays of 4 MiB and more get huge pages and torch's tensors do not (mpi_peer.py):
    the peer's buffers must be torch tensors' memory, so both sides run on the same kind of page."""
    import numpy as np
    import torch
    from gradsync.bench import mpi_peer

    source, buffer = mpi_peer._buffers(8 << 20)
    assert isinstance(source, np.ndarray) and source.dtype == np.float32 and source.size == 2 << 20
    assert isinstance(source.base, torch.Tensor) and isinstance(buffer.base, torch.Tensor)
    assert buffer.size == source.size and (source == 1).all()


def test_the_bench_says_which_pages_both_sides_ran_on(monkeypatch):
    from gradsync.bench import mpi_peer

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert "4 KiB pages" in mpi_peer.pages()
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "true")   # torch reads only 1 as on
    assert "4 KiB pages" in mpi_peer.pages()
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert "huge pages (THP_MEM_ALLOC_ENABLE=1)" in mpi_peer.pages()


@pytest.mark.timeout(180)
def test_bench_collectives_with_mpi_as_a_peer(tmp_path, capsys):
    from gradsync.bench import mpi_peer

    reason = mpi_peer.unavailable()
    if reason:
        pytest.skip(f"MPI peer not installed here: {reason}")
    out = tmp_path / "rows.json"
    assert main(["bench", "collectives", "--workers", "2", "--sizes", "4K,96K", "--reps", "2", "--algorithms", "ring",
                 "--peers", "gloo,mpi", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    mpi = [r for r in rows if r["transport"] == "mpi"]
    assert [(r["algorithm"], r["size"]) for r in mpi] == [("MPI_Allreduce", 4096), ("MPI_Allreduce", 96 << 10)]
    for r in mpi:   # the same warm-up and repetitions as ours, and the closed-form result N
        assert r["warmup_calls"] == 1 and len(r["times_s"]) == 2 and r["result_correct"], r
        assert r["ratio_vs_mpi"] == 1.0 and r["ratio_vs_native"] > 0
    assert all(r["ratio_vs_mpi"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "ours/MPI" in printed and "both sides on torch's memory" in printed


def _row(size, algorithm, transport, time_s, correct=True):
    return {"size": size, "workers": 2, "algorithm": algorithm, "transport": transport, "time_s": time_s,
            "times_s": [time_s], "result_correct": correct, "bytes_per_rank": None, "formula_bytes": None}


def test_rounds_combine_into_the_median_of_each_rows_round_medians():
    from gradsync.bench import collectives

    rounds = [[_row(4096, "native", "gloo", 4e-4), _row(4096, "ring", "shm", 1e-4)],
              [_row(4096, "native", "gloo", 9e-4), _row(4096, "ring", "shm", 5e-4, correct=False)],
              [_row(4096, "native", "gloo", 5e-4), _row(4096, "ring", "shm", 2e-4)]]
    native, ring = collectives.combine_rounds(rounds)   # medians, not means (6e-4 and 2.67e-4)
    assert native["round_times_s"] == [4e-4, 9e-4, 5e-4] and native["time_s"] == 5e-4
    assert ring["round_times_s"] == [1e-4, 5e-4, 2e-4] and ring["time_s"] == 2e-4
    assert ring["times_s"] == [1e-4, 5e-4, 2e-4] and not ring["result_correct"] and native["result_correct"]
    assert ring["ratio_vs_native"] == pytest.approx(5e-4 / 2e-4)   # from the combined medians
    assert ring["algbw_GBps"] == pytest.approx(4096 / 2e-4 / 1e9)
    with pytest.raises(ValueError, match="different sizes"):
        collectives.combine_rounds([rounds[0], rounds[1][::-1]])


def test_bench_collectives_rounds_repeat_the_run_and_show_each_round(tmp_path, capsys, monkeypatch):
    """The command's loop and table; each run is a stand-in that returns the next round's rows (real
    runs: the other bench tests), so the test spawns no ranks."""
    from gradsync.bench import collectives

    calls = []

    def one_run(workers, sizes, algorithms, reps, fit, transport):
        calls.append((workers, sizes, algorithms, reps))
        k = len(calls)
        return {"rows": [{**_row(4096, "native", "gloo", 1e-3 * k), "times_s": [1e-3 * k] * reps},
                         {**_row(4096, "ring", "shm", 1e-4 * k), "times_s": [1e-4 * k] * reps,
                          "bytes_per_rank": 4096, "formula_bytes": 4096.0}], "fit": None}

    monkeypatch.setattr(collectives, "run", one_run)
    out = tmp_path / "rows.json"
    assert main(["bench", "collectives", "--workers", "2", "--sizes", "4K", "--reps", "2", "--algorithms", "ring",
                 "--rounds", "3", "--json", str(out)]) == 0
    assert calls == [(2, [4096], ["ring"], 2)] * 3
    result = json.loads(out.read_text())
    assert result["rounds"] == 3 and [r["algorithm"] for r in result["rows"]] == ["native", "ring"]
    native, ring = result["rows"]
    assert ring["round_times_s"] == pytest.approx([1e-4, 2e-4, 3e-4]) and ring["time_s"] == pytest.approx(2e-4)
    assert len(ring["times_s"]) == 6 and ring["ratio_vs_native"] == pytest.approx(10.0)
    printed = capsys.readouterr().out
    assert "median of 3 rounds" in printed and "each round (us)" in printed and "100 / 200 / 300" in printed
    assert main(["bench", "collectives", "--rounds", "2", "--fit"]) == 2
    assert "--rounds 2 repeats one run: use it without --fit" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_bench_slowlinks_rows_and_bytes_per_step(tmp_path, capsys):
    """`gradsync bench slowlinks` on digits, 2 ranks, 16 steps: one row per strategy, and every step's
    bytes (rank 0's traffic meter, the curves' bytes_sent) in closed form, at N=2 where the ring's
    2(N-1)/N * X is X: ring DDP sends the whole gradient M each step; PowerSGD r=2 M for its 10 plain
    steps, then sum over matrices of (n + m) r (compressed when (n + m) r * 2 < n m) + the other
    elements; DiLoCo H=4 nothing but at every 4th step, then M. Every step after the first adds the
    step-boundary verdict, a 2-element float64 all-reduce (train/preempt.py); the second step DDP's
    one-off bucket order broadcast (left out); after the 10th (--log-every's default) the all-gather of
    each rank's timings, 4 float64 per rank, (N-1) x 32 = 32 bytes at N=2, read in step 11's figure."""
    from gradsync.train.models import DigitsCNN

    out, png = tmp_path / "slow.json", tmp_path / "slow.png"
    assert main(["bench", "slowlinks", "--tasks", "digits", "--steps", "16", "--sync-every", "4",
                 "--out", str(tmp_path / "runs"), "--json", str(out), "--figure", str(png)]) == 0
    result = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in result["rows"]}
    assert [r["strategy"] for r in result["rows"]] == ["ring", "powersgd", "diloco"]
    shapes = [p.shape for p in DigitsCNN().parameters()]
    m = 4 * sum(torch.Size(s).numel() for s in shapes)

    def factors(shape) -> int:
        n, rest = shape[0], torch.Size(shape[1:]).numel()
        return (n + rest) * 2 if len(shape) > 1 and (n + rest) * 2 * 2 < n * rest else n * rest

    compressed = 4 * sum(factors(s) for s in shapes)
    verdict = 16
    timings = {11: 32}   # the per-rank timings gathered after step 10 (train/loop.py _record_ranks)
    expected = {"ring": lambda k: m, "powersgd": lambda k: m if k <= 10 else compressed,
                "diloco": lambda k: m if k % 4 == 0 else 0}
    for strategy, curve in result["curves"]["digits"].items():
        sent = curve["bytes_sent"]
        assert curve["step"] == list(range(1, 17)), strategy
        per_step = [sent[0]] + [b - a for a, b in zip(sent, sent[1:])]
        for k, nbytes in enumerate(per_step, 1):
            if k != 2 or strategy == "diloco":
                assert nbytes == expected[strategy](k) + (verdict if k > 1 else 0) + timings.get(k, 0), \
                    (strategy, k, per_step)
    assert rows["powersgd"]["vs_ring"] == rows["powersgd"]["bytes_per_rank"] / rows["ring"]["bytes_per_rank"]
    assert rows["diloco"]["bytes_per_rank"] < rows["powersgd"]["bytes_per_rank"] < rows["ring"]["bytes_per_rank"]
    assert rows["diloco"]["target"].startswith("not met: accuracy") and rows["ring"]["target"] is None
    assert png.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "PowerSGD r=2" in printed and "DiLoCo H=4, outer lr 0.4" in printed and "1 (baseline)" in printed
