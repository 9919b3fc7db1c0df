"""Third-party programs, unchanged, on the "gradsync" torch.distributed backend give gloo's numbers.

Each client kind runs in one launch (scripts tests/clients_*.py) that does the same work on
"gradsync" and on "gloo"; the gloo run is the oracle. Every rank writes its own numbers to a file
with torch.save, so no collective of either backend carries the results the test compares.

- torch FSDP2 (fully_shard) on CPU, 2 ranks: losses and every rank's local parameter shards after
  4 Adam steps, gradsync's default group against a gloo group over the same ranks.
- torch.distributed.checkpoint: the FSDP2 model saved on 2 ranks (gradsync) and loaded on 3 ranks
  (gradsync, resharded 5/5/3 rows) and on 1 process (no_dist); the loaded values must equal the
  shards the 2 ranks held, bit for bit, and a forward pass on the 3-rank model must match a plain
  nn.Module built here from those shards.
- PyTorch Lightning, Trainer(devices=2, strategy=DDPStrategy(process_group_backend=...)), its own
  launcher: per-rank losses and final parameters, gradsync against gloo.
- Hugging Face Accelerate under torchrun (DDP, gradient accumulation, gather): per-rank losses,
  gathered losses and final parameters, gradsync against gloo.

Tolerance, float64 throughout: 1e-12 relative. With 2 ranks every reduced element is a + b on
both backends (commutative, so rounded alike), and the averages divide by 2 (exact), so the runs
agree bit for bit today; the bound leaves room for a valid change of summation order and still
catches any real error (a result off by one part in 1e9 fails).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
TOLERANCE = 1e-12
LAUNCH_TIMEOUT = 240


def _launch(command: list[str], out: Path) -> None:
    """Run a launcher (torchrun, or a script whose Lightning Trainer starts the other rank) in a
    session of its own, so that a timeout ends every rank, not only the launcher."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(command + [str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=out, start_new_session=True) as launcher:
        try:
            stdout, stderr = launcher.communicate(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            stdout, stderr = launcher.communicate()
            pytest.fail(f"{command} ran past {LAUNCH_TIMEOUT} s:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    assert launcher.returncode == 0, f"{command} failed ({launcher.returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}"


def _torchrun(nproc: int, script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            str(HERE / script), *args]


def _load_ranks(out: Path, stem: str, n_ranks: int) -> list[dict]:
    return [torch.load(out / f"{stem}_rank{rank}.pt", weights_only=False) for rank in range(n_ranks)]


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(theirs, dtype=torch.float64)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-300)).item() if ours.numel() else 0.0


def _assert_same_run(ours: dict, theirs: dict, what: str) -> None:
    """ours/theirs: {"losses": [...], "params": {name: tensor}} from one rank."""
    assert len(ours["losses"]) == len(theirs["losses"]) > 0, what
    assert _relative_error(ours["losses"], theirs["losses"]) <= TOLERANCE, (what, ours["losses"], theirs["losses"])
    assert ours["params"].keys() == theirs["params"].keys(), what
    for name, param in theirs["params"].items():
        assert ours["params"][name].dtype == param.dtype == torch.float64, (what, name)
        assert _relative_error(ours["params"][name], param) <= TOLERANCE, (what, name)


# -- torch FSDP2 and torch.distributed.checkpoint -------------------------------------------------
@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """One 2-rank launch: FSDP2 on gradsync and on gloo, then a checkpoint of the gradsync model."""
    out = tmp_path_factory.mktemp("fsdp")
    _launch(_torchrun(2, "clients_fsdp.py", "train"), out)
    return out


def _fsdp_model():
    """clients_fsdp.make_model, built here in one process."""
    from torch import nn
    return nn.Sequential(nn.Linear(7, 13, dtype=torch.float64), nn.Tanh(), nn.Linear(13, 13, dtype=torch.float64),
                         nn.Tanh(), nn.Linear(13, 3, dtype=torch.float64))


def _full(shards_per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """FSDP2 shards dim 0 in rank order (torch.chunk): the full tensor is their concatenation."""
    return {name: torch.cat([shards[name] for shards in shards_per_rank]) for name in shards_per_rank[0]}


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_fsdp2_matches_gloo(fsdp_run):
    ranks = _load_ranks(fsdp_run, "fsdp", 2)
    for rank, row in enumerate(ranks):
        _assert_same_run({"losses": row["losses"]["gradsync"], "params": row["shards"]["gradsync"]},
                         {"losses": row["losses"]["gloo"], "params": row["shards"]["gloo"]}, f"fsdp2 rank {rank}")
    # the shards cover the model (13 rows: 7 + 6) and training moved every parameter
    torch.manual_seed(0)
    initial = _fsdp_model()
    trained = _full([row["shards"]["gloo"] for row in ranks])
    for name, param in initial.named_parameters():
        assert trained[name].shape == param.shape, name
        assert (trained[name] - param.detach()).abs().max() > 1e-4, f"{name} did not train"


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)  # the training launch too, when this test runs alone
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the 1-process load, as meant
def test_checkpoint_saved_on_2_ranks_loads_on_3_and_on_1(fsdp_run):
    import torch.distributed.checkpoint as dcp

    saved = _full([row["shards"]["gradsync"] for row in _load_ranks(fsdp_run, "fsdp", 2)])
    _launch(_torchrun(3, "clients_fsdp.py", "load"), fsdp_run)
    loaded = _load_ranks(fsdp_run, "load", 3)
    assert [tuple(row["shards"]["0.weight"].shape) for row in loaded] == [(5, 7), (5, 7), (3, 7)]
    on_three = _full([row["shards"] for row in loaded])
    assert saved.keys() == on_three.keys()
    for name, tensor in saved.items():
        assert torch.equal(on_three[name], tensor), name

    # the 3-rank model's forward pass (its all-gathers) against the same model in one process
    plain = _fsdp_model()
    plain.load_state_dict(saved)
    with torch.no_grad():
        expected = plain(torch.linspace(-1, 1, 4 * 7, dtype=torch.float64).reshape(4, 7))
    for rank, row in enumerate(loaded):
        assert _relative_error(row["output"], expected) <= TOLERANCE, rank

    state = {"model": {name: torch.zeros_like(tensor) for name, tensor in saved.items()}}
    dcp.load(state, checkpoint_id=fsdp_run / "checkpoint", no_dist=True)
    for name, tensor in saved.items():
        assert torch.equal(state["model"][name], tensor), name


# -- PyTorch Lightning ---------------------------------------------------------------------------
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_lightning_ddp_strategy_matches_gloo(tmp_path):
    pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is not installed (pip install -e '.[clients]')")
    _launch([sys.executable, str(HERE / "clients_lightning.py")], tmp_path)
    for rank, runs in enumerate(_load_ranks(tmp_path, "lightning", 2)):
        assert runs["gradsync"]["backend"] == "gradsync" and runs["gloo"]["backend"] == "gloo"
        assert runs["gradsync"]["world_size"] == 2
        assert len(runs["gradsync"]["losses"]) == 6  # 2 epochs of 3 batches on each rank
        _assert_same_run(runs["gradsync"], runs["gloo"], f"lightning rank {rank}")


# -- Hugging Face Accelerate ---------------------------------------------------------------------
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_accelerate_matches_gloo(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[clients]')")
    _launch(_torchrun(2, "clients_accelerate.py"), tmp_path)
    for rank, runs in enumerate(_load_ranks(tmp_path, "accelerate", 2)):
        ours, theirs = runs["gradsync"], runs["gloo"]
        print(f"rank {rank}: gradsync reached Accelerate through {ours['route']}")
        assert ours["route"] in ("init_kwargs", "own_init_process_group") and theirs["route"] == "init_kwargs"
        assert ours["backend"] == "gradsync" and theirs["backend"] == "gloo" and ours["world_size"] == 2
        assert len(ours["losses"]) == 4  # 4 batches per rank, 2 optimizer steps
        _assert_same_run(ours, theirs, f"accelerate rank {rank}")
        assert _relative_error(ours["gathered"], theirs["gathered"]) <= TOLERANCE, (ours["gathered"], theirs["gathered"])
        assert [losses[rank] for losses in theirs["gathered"]] == theirs["losses"]
