"""The cost model against closed forms and the textbook example; the simulate and figures commands."""

import time

import pytest

from gradsync.cli import main
from gradsync.sim import cost
from gradsync.sim.cost import STRATEGIES, Link, allreduce_time, ddp_step_time, strategy_cost

GBIT_200 = Link(alpha=5e-6, beta=8 / 200e9, gamma=0.0)
M_7B_BF16 = 7e9 * 2


def test_textbook_parameter_server_vs_ring():
    ps = strategy_cost("ps", M_7B_BF16, 64, GBIT_200, 0.25)
    assert ps.busiest_link_bytes == pytest.approx(896e9)            # 64 x 14 GB in, and as much out
    assert 35.0 < ps.comm_s < 36.5                                   # 896 GB / 25 GB/s = 35.8 s
    assert 130 < ps.comm_s / 0.25 < 150                              # ~140:1 against compute
    ring = strategy_cost("ring", M_7B_BF16, 64, GBIT_200, 0.25)
    assert ring.busiest_link_bytes == pytest.approx(2 * 63 / 64 * 14e9)   # 27.6 GB
    assert ring.comm_s == pytest.approx(1.1, rel=0.01)


def test_more_servers_divide_the_server_link():
    one = strategy_cost("ps", M_7B_BF16, 64, GBIT_200, 0.25)
    eight = strategy_cost("ps", M_7B_BF16, 64, GBIT_200, 0.25, servers=8)
    assert eight.busiest_link_bytes == pytest.approx(one.busiest_link_bytes / 8)


def test_hierarchical_with_one_host_is_an_intra_host_ring():
    fast = Link(alpha=1e-6, beta=1 / 300e9, gamma=0.0)
    cost = strategy_cost("hierarchical", 1e9, 8, GBIT_200, 0.1, ranks_per_host=8, intra=fast)
    assert cost.comm_s == pytest.approx(allreduce_time("ring", 1e9, 8, fast))
    assert cost.busiest_link_bytes == 0.0                              # nothing crosses hosts


def test_ddp_overlap_limits():
    link = Link(alpha=20e-6, beta=8 / 100e9, gamma=0.0)
    m, n, c = 400e6, 64, 0.25
    ring = allreduce_time("ring", m, n, link)
    one_bucket, exposed = ddp_step_time(m, n, link, c, bucket_bytes=m)
    assert one_bucket == pytest.approx(c + ring) and exposed == pytest.approx(ring)   # nothing hidden
    best = min(ddp_step_time(m, n, link, c, 2 ** k)[0] for k in range(16, 30))
    tiny = ddp_step_time(m, n, link, c, 2 ** 16)[0]
    assert c <= best < one_bucket < tiny                               # the U-shaped bucket curve


def test_simulating_1024_ranks_takes_under_a_second():
    started = time.perf_counter()
    for strategy in STRATEGIES:
        strategy_cost(strategy, M_7B_BF16, 1024, GBIT_200, 0.25)
    assert time.perf_counter() - started < 1.0


def test_simulate_command_reproduces_the_textbook_table(capsys):
    assert main(["simulate", "--params", "7e9", "--dtype", "bf16", "--workers", "64", "--bandwidth", "200Gbit",
                 "--compute", "250ms"]) == 0
    out = capsys.readouterr().out
    assert "896 GB" in out and "27.6 GB" in out and "143.4:1" in out and "35.840" in out


@pytest.mark.parametrize("argv, message", [
    (["--bandwidth", "fast"], "not a bandwidth"),
    (["--compute", "soon"], "not a duration"),
    (["--strategy", "ring,gossip"], "unknown ['gossip']"),
])
def test_simulate_bad_input(argv, message, capsys):
    try:
        code = main(["simulate", "--params", "7e9", "--workers", "64", *argv])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2 and message in capsys.readouterr().err


def test_figures_are_written_with_their_csv(tmp_path):
    import json

    measured = tmp_path / "check.json"
    measured.write_text(json.dumps({"rows": [
        {"what": "ring all-reduce", "workers": 2, "size": 1 << 20, "measured_s": 0.004, "predicted_s": 0.003,
         "error": -0.25},
        {"what": "DDP step (mlp, 25 MiB)", "workers": 2, "size": 1 << 20, "measured_s": 0.09, "predicted_s": 0.08,
         "error": -0.11}]}))
    assert main(["figures", "--out", str(tmp_path / "figs"), "--measured", str(measured)]) == 0
    for name in ("traffic_vs_ranks", "step_time_vs_ranks", "bucket_size", "measured_vs_predicted"):
        png, csv = tmp_path / "figs" / f"{name}.png", tmp_path / "figs" / f"{name}.csv"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert len(csv.read_text().splitlines()) >= 3
    ranks_csv = (tmp_path / "figs" / "traffic_vs_ranks.csv").read_text().splitlines()
    assert ranks_csv[-1].startswith("1024,") and float(ranks_csv[-1].split(",")[1]) == pytest.approx(1024 * 14e9)


@pytest.mark.parametrize("service,think", [(0.224, 0.288), (0.01, 1.0), (1.0, 0.01), (0.05, 0.05)])
def test_the_async_closed_loop_against_its_closed_forms(service, think):
    """sim/cost.py, closed_loop_step (ps-async): one worker pays its own part and one service,
    z + s; two pay z + s(z + 2s)/(z + s) (mean value analysis by hand: Q_1 = s/(z + s),
    R_2 = s(1 + Q_1)); any W lies between max(W*s, z + s) and z + W*s, and many workers tend to
    the bound that binds: the servers' W*s, or z + s when the servers are fast."""
    s, z = service, think
    assert cost.closed_loop_step(1, s, z) == pytest.approx(z + s)
    assert cost.closed_loop_step(2, s, z) == pytest.approx(z + s * (z + 2 * s) / (z + s))
    for w in (2, 3, 4, 6, 16):
        step = cost.closed_loop_step(w, s, z)
        assert max(w * s, z + s) <= step * (1 + 1e-12) and step <= (z + w * s) * (1 + 1e-12), w
    assert cost.closed_loop_step(2000, s, z) == pytest.approx(2000 * s, rel=0.01)   # server-bound at last
    assert cost.closed_loop_step(3, s * 1e-6, z) == pytest.approx(z, rel=1e-3)        # no queue


def test_powersgd_and_diloco_rows_follow_their_closed_forms():
    from gradsync.sim.cost import Link, strategy_cost

    link = Link(alpha=1e-5, beta=1e-9, gamma=2e-10)
    m, n, c = 4e9, 16, 0.25
    ring = 2 * (n - 1) * 1e-5 + 2 * (n - 1) / n * m * 1e-9 + (n - 1) / n * m * 2e-10
    diloco = strategy_cost("diloco", m, n, link, c, sync_every=8)
    assert diloco.step_s == pytest.approx(c + ring / 8) and diloco.busiest_link_bytes == pytest.approx(
        2 * 15 / 16 * m / 8)
    sent = 0.01 * m   # P with the uncompressed tensors, then Q: two all-reduces a bucket, 1% of the bytes
    for bucket_bytes, buckets in ((m, 1), (m / 3, 3), (m / 2.5, 3)):
        powersgd = strategy_cost("powersgd", m, n, link, c, powersgd_ratio=0.01, bucket_bytes=bucket_bytes)
        expected = 2 * buckets * 2 * (n - 1) * 1e-5 + 2 * (n - 1) / n * sent * 1e-9 + (n - 1) / n * sent * 2e-10
        assert powersgd.comm_s == pytest.approx(expected) and powersgd.busiest_link_bytes == pytest.approx(
            2 * 15 / 16 * sent)
    with pytest.raises(ValueError, match="integer >= 1"):
        strategy_cost("diloco", m, n, link, c, sync_every=0)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        strategy_cost("powersgd", m, n, link, c, powersgd_ratio=0.0)
