"""gradsync's PowerSGD hook (ddp/powersgd.py) against torch's powerSGD_hook and a one-process reference.

- beside torch: torch's DDP (gloo) with torch's powerSGD_hook and gradsync's wrapper with
  powersgd_hook, rank 2, compression from step 2, error feedback and warm start, 6 SGD steps,
  float64, 2 ranks: the same parameters (the two follow the same arithmetic; 2 ranks sum exactly).
- the algorithm itself: 3 ranks against PowerSGD written out in one process (powersgd_fns.reference,
  its own code, QR for orthonormalization), within float64 rounding.
- traffic: on the ring all-reduce each compressed step sends exactly (sum of (n + m) r over the
  compressed matrices + the other elements) x 8 bytes per rank at N=2, against the whole gradient
  before compression starts.
"""

import pytest
import torch

import powersgd_fns

DOUBLE = 1e-12


def _close(ours: dict, theirs: dict, tolerance: float, what: str) -> None:
    assert ours.keys() == theirs.keys(), what
    for name, expected in theirs.items():
        worst = ((ours[name] - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()
        assert worst <= tolerance, f"{what}: {name} differs by {worst:.3g} (relative)"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.0006])
def test_powersgd_hook_gives_torch_powersgd_hooks_parameters(world_of, bucket_cap_mb):
    for rank, result in enumerate(world_of(2).run(powersgd_fns.beside_torch, bucket_cap_mb)):
        _close(result["ours"], result["torch"], DOUBLE, f"rank {rank}, buckets of {bucket_cap_mb} MiB")


@pytest.mark.timeout(300)
def test_powersgd_hook_equals_the_algorithm_written_out_in_one_process(world_of):
    results = world_of(3).run(powersgd_fns.ours_and_replicas)
    for result in results[1:]:  # the replicas are bit-identical
        assert all(torch.equal(result["params"][n], results[0]["params"][n]) for n in result["params"])
    expected = powersgd_fns.reference(3, results[0]["order"])
    _close(results[0]["params"], expected, 1e-9, "3 ranks against the one-process reference")
    plain = powersgd_fns.reference(3, results[0]["order"], start=powersgd_fns.STEPS)  # never compressed
    assert any(not torch.allclose(plain[n], expected[n], rtol=1e-6) for n in plain)  # compression did happen


@pytest.mark.timeout(300)
def test_a_compressed_step_sends_the_factors_bytes_exactly(world_of):
    for result in world_of(2).run(powersgd_fns.traffic_per_step, "ring"):
        compressed, whole = result["elements"]
        start = powersgd_fns.START
        assert compressed < whole / 1.2
        # ring all-reduce at N=2: each rank sends exactly the n elements of each message once
        assert result["sent"][0] == whole * 8, result["sent"]
        # step 1 may also carry the bucket rebuild's broadcast of rank 0's ready order (once, small)
        assert 0 <= result["sent"][1] - whole * 8 <= 64, result["sent"]
        assert result["sent"][start:] == [compressed * 8] * (powersgd_fns.STEPS - start), result["sent"]


@pytest.mark.timeout(120)
def test_bad_powersgd_settings_are_refused_with_the_valid_range(world_of):
    errors = world_of(2).run(powersgd_fns.refusals)[0]
    assert errors["rank0"][0] == "ValueError" and ">= 1" in errors["rank0"][1]
    assert errors["start1"][0] == "ValueError" and ">= 2" in errors["start1"][1]
    assert errors["too_big"][0] == "ValueError" and "between 1 and 16" in errors["too_big"][1], errors["too_big"]
    assert errors["fits"] is None and errors["comm_hook"] is None
