"""gs.DiLoCo (diloco.py) against DiLoCo written out in one process (diloco_fns.reference), float64.

3 ranks, 3 rounds of H=3 AdamW steps each on their own shards, every rank starting from its own
random model (DiLoCo starts them from rank 0's): after each outer step every rank holds the same
parameters, bit for bit, equal to the reference's within float64 rounding; the ring all-reduce
sends 2(N-1)/N * M bytes at each outer step and nothing between; a run stopped mid-round and
resumed from its state_dict ends where the uninterrupted run ends, bit for bit.
"""

import pytest
import torch

import diloco_fns


def _assert_close(ours: dict, theirs: dict, tolerance: float, what: str) -> None:
    for name, expected in theirs.items():
        worst = ((ours[name] - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()
        assert worst <= tolerance, f"{what}: {name} differs by {worst:.3g}"


@pytest.mark.timeout(300)
def test_outer_steps_equal_the_one_process_reference_and_keep_replicas_identical(world_of):
    results = world_of(3).run(diloco_fns.train)
    expected = diloco_fns.reference(3)
    assert all(len(r["after_outer"]) == diloco_fns.ROUNDS for r in results)
    for round_index in range(diloco_fns.ROUNDS):
        first = results[0]["after_outer"][round_index]
        for r in results[1:]:
            assert all(torch.equal(r["after_outer"][round_index][n], first[n]) for n in first), round_index
        _assert_close(first, expected[round_index], 1e-12, f"round {round_index}")


@pytest.mark.timeout(300)
def test_only_the_outer_steps_send_and_each_sends_the_rings_bytes(world_of):
    n = 3
    for rank, r in enumerate(world_of(n).run(diloco_fns.train, diloco_fns.ROUNDS, "ring")):
        m = r["bytes_per_sync"]
        elements = m // 8
        chunks = [elements // n + (1 if j < elements % n else 0) for j in range(n)]
        # ring: reduce-scatter sends every chunk but the one rank r ends with, all-gather all but one
        ring = (sum(chunks) - chunks[(rank + 1) % n] + sum(chunks) - chunks[rank]) * 8
        for step, sent in enumerate(r["sent"]):
            assert sent == (ring if (step + 1) % diloco_fns.H == 0 else 0), (rank, step, r["sent"])


@pytest.mark.timeout(300)
def test_a_run_resumed_mid_round_from_state_dict_ends_where_it_would_have(world_of):
    world = world_of(2)
    whole = world.run(diloco_fns.train)
    stopped = world.run(diloco_fns.train, diloco_fns.ROUNDS, "auto", diloco_fns.H + 1)  # mid round 2
    checkpoints = [s["checkpoint"] for s in stopped]
    finished = world.run(diloco_fns.train, diloco_fns.ROUNDS, "auto", None, checkpoints)
    for a, b in zip(whole, finished):
        assert len(b["after_outer"]) == diloco_fns.ROUNDS - 1  # the rounds after the stop
        last_a, last_b = a["after_outer"][-1], b["after_outer"][-1]
        assert all(torch.equal(last_a[k], last_b[k]) for k in last_a)


@pytest.mark.timeout(120)
def test_bad_diloco_settings_are_refused_with_the_valid_range(world_of):
    errors = world_of(2).run(diloco_fns.refusals)[0]
    assert errors["h0"][0] == "ValueError" and "integer >= 1" in errors["h0"][1]
    assert errors["lr"][0] == "ValueError" and "> 0" in errors["lr"][1]
    assert errors["momentum"][0] == "ValueError" and "[0, 1)" in errors["momentum"][1]
