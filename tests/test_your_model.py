"""A user's own model and data through gradsync train's whole runtime.

The tasks are tests/own_task.py's, defined there as a user defines them and nowhere in gradsync. Oracles:
one process training the same model with torch alone on the sample ids the run logged (own_task.reference:
the mean loss over exactly the step's samples, torch's optimizer, torch's clip_grad_norm_), float64 so that
the equivalence is tight; for the strategies that are not synchronous (compressed wire, DiLoCo, async
parameter servers), the loss the model reaches and the samples each step trained; an uninterrupted run for a
preempted one (torch.equal on the weights).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import own_task
from gradsync import checkpoint
from gradsync.cli import main

COMMON = dict(steps=6, batch_size=8, lr_scaling="none", warmup_steps=2, quiet=True, seed=0)
MSE = lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1])   # noqa: E731
EXACT = 1e-9
"""float64: the ranks' averaged gradient is one process's up to reassociation, ~1e-15 of the update a step."""


def _run_logged(world_of, world_size: int, config: dict, tmp_path: Path) -> tuple[list[dict], Path, Path]:
    out, logs = tmp_path / "out", tmp_path / "ids"
    logs.mkdir()
    results = world_of(world_size).run(own_task.train_logged, {**config, "out": str(out)}, str(logs))
    return results, out, logs


def _against_one_process(results, out, logs, trainers: int, build, loss_of, optimizer, data, clip=None):
    steps = own_task.logged_steps(logs, trainers)
    lrs = own_task.learning_rates(out)
    assert len(steps) == len(lrs) > 0
    initial, oracle = own_task.reference(build, data()[0], steps, lrs, optimizer, loss_of, clip=clip)
    trained = [r for r in results if (r.get("ps") or {}).get("role") != "server"]
    for rank, result in enumerate(trained):
        error = own_task.update_error(result["params"], initial, oracle)
        assert error <= EXACT, f"trainer {rank}: update {error:.2e} from one process's"


SYNCHRONOUS = {
    "ddp-ring-cosine": (2, dict(strategy="ddp", algorithm="ring", optimizer="sgd", momentum=0.9, lr=0.1,
                                lr_schedule="cosine", min_lr=0.01),
                        lambda p: torch.optim.SGD(p, lr=0.0, momentum=0.9), None),
    "ddp-naive-accum-clip": (3, dict(strategy="ddp", algorithm="naive", grad_accum=2, clip_grad=0.05, optimizer="adam",
                                     lr=0.01), lambda p: torch.optim.Adam(p), 0.05),
    "zero1-own-optimizer": (2, dict(strategy="zero1", optimizer="own_task:rmsprop"), own_task.rmsprop, None),
    "local-adamw": (1, dict(strategy="local", optimizer="adamw", lr=0.01, weight_decay=0.1),
                    lambda p: torch.optim.AdamW(p, weight_decay=0.1), None),
    "ps-sync": (3, dict(strategy="ps-sync", servers=1, optimizer="sgd", momentum=0.9, lr=0.1),
                lambda p: torch.optim.SGD(p, lr=0.0, momentum=0.9), None),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(SYNCHRONOUS))
def test_a_users_model_trains_under_each_synchronous_strategy_as_one_process_would(case, world_of, tmp_path):
    """own_task's regression MLP and data (--loss mse) under ddp (ring with a cosine schedule; naive with
    accumulation and clipping), zero1 with the user's own optimizer function, local, and a parameter server:
    the final weights are one process's with the global batch of the steps' logged samples."""
    world_size, flags, optimizer, clip = SYNCHRONOUS[case]
    config = {**COMMON, "model": "own_task:regressor", "dataset": "own_task:regression", "loss": "mse", **flags}
    results, out, logs = _run_logged(world_of, world_size, config, tmp_path)
    trainers = world_size - flags.get("servers", 0) if flags["strategy"] == "ps-sync" else world_size
    _against_one_process(results, out, logs, trainers, own_task.regressor, MSE, optimizer, own_task.regression, clip)
    summary = next(r["summary"] for r in results if r["summary"] is not None)
    assert summary["accuracy"] is None and summary["test_loss"] > 0   # regression: no accuracy to read


CONVENTIONS = {
    "nanogpt-returns-the-loss": ("own_task:tiny_gpt", "own_task:counting", "model", own_task.tiny_gpt,
                                 own_task.counting, lambda m, b: m(*b)[1]),
    "dict-batch-with-dot-loss": ("own_task:dict_model", "own_task:dict_data", None, own_task.dict_model,
                                 lambda: (own_task.dict_data()["train"],), lambda m, b: m(**b).loss),
    "a-loss-function": ("own_task:regressor", "own_task:regression", "own_task:huber", own_task.regressor,
                        own_task.regression, lambda m, b: nn.functional.smooth_l1_loss(m(b[0]), b[1])),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CONVENTIONS))
def test_each_loss_convention_equals_one_process(case, world_of, tmp_path):
    """A model that returns (logits, loss) (--loss model), a dict batch whose output has .loss (the default
    for dict batches), and a loss named module:function: 2 ddp ranks give one process's weights."""
    model, data, loss, build, data_fn, loss_of = CONVENTIONS[case]
    config = {**COMMON, "model": model, "dataset": data, "optimizer": "sgd", "lr": 0.2,
              **({"loss": loss} if loss else {})}
    results, out, logs = _run_logged(world_of, 2, config, tmp_path)
    _against_one_process(results, out, logs, 2, build, loss_of, lambda p: torch.optim.SGD(p, lr=0.0), data_fn)


@pytest.mark.timeout(240)
def test_a_sparse_embedding_moves_only_its_rows_under_a_parameter_server_and_trains_dense_elsewhere(world_of,
                                                                                                     tmp_path):
    """own_task's bag of words (an nn.EmbeddingBag with sparse=True, 500 x 8 float64): under ps-sync a worker
    pushes the rows its steps touched, far fewer bytes than the table, and the weights are one process's
    (plain SGD); under ddp the table trains dense, said in a note, to the same weights."""
    config = {**COMMON, "model": "own_task:bag_of_words", "dataset": "own_task:documents", "optimizer": "sgd",
              "momentum": 0.0, "lr": 0.5}
    sgd = lambda p: torch.optim.SGD(p, lr=0.0)   # noqa: E731
    loss_of = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])   # noqa: E731
    table_bytes = 500 * 8 * 8
    for strategy, world_size in (("ps-sync", 3), ("ddp", 2)):
        where = tmp_path / strategy
        where.mkdir()
        results, out, logs = _run_logged(world_of, world_size, {**config, "strategy": strategy, "servers": 1}, where)
        _against_one_process(results, out, logs, 2, own_task.bag_of_words, loss_of, sgd, own_task.documents)
        summary = next(r["summary"] for r in results if r["summary"] is not None)
        notes = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        dense_note = [r for r in notes if r["event"] == "note" and "train dense" in r["text"]]
        if strategy == "ps-sync":
            worker_bytes = summary["bytes_sent_per_rank"][1]
            assert worker_bytes < COMMON["steps"] * table_bytes / 4, worker_bytes   # rows, not the whole table
            assert not dense_note
        else:
            assert dense_note and "bag.weight" in dense_note[0]["text"]


def _initial_test_loss() -> float:
    torch.manual_seed(0)
    model = own_task.regressor()
    x, y = own_task.regression()[1].tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size, flags", [
    (2, dict(strategy="ddp", compress="fp16")),
    (2, dict(strategy="ddp", compress="bf16")),
    (2, dict(strategy="ddp", compress="powersgd", powersgd_rank=1)),
    (2, dict(strategy="diloco", sync_every=4)),
    (3, dict(strategy="ps-async", servers=1)),
    (3, dict(strategy="ssp", servers=1, staleness=1)),
], ids=["fp16", "bf16", "powersgd", "diloco", "ps-async", "ssp"])
def test_the_other_strategies_train_a_users_model(world_size, flags, world_of, tmp_path):
    """Compressed wires, DiLoCo and the asynchronous parameter servers are not one process's arithmetic: the
    regression's test loss falls under a fifth of the untrained model's (plain ddp:
    0.028 from 0.649 in these 40 steps), the replicas end equal (the synchronous ones), and over the
    run every sample of each epoch's order was trained once per global step (the async workers' logs)."""
    config = {**COMMON, "model": "own_task:regressor", "dataset": "own_task:regression", "loss": "mse",
              "optimizer": "adam", "lr": 0.02, "steps": 40, **flags}
    results, out, logs = _run_logged(world_of, world_size, config, tmp_path)
    summary = next(r["summary"] for r in results if r["summary"] is not None)
    assert summary["test_loss"] < 0.2 * _initial_test_loss(), (summary["test_loss"], _initial_test_loss())
    if "servers" not in flags:   # an async worker's last pull is the servers' state when it closed, not at the end
        assert len({r["digest"] for r in results}) == 1, "the replicas differ at the end"
    from gradsync.data import EpochCursor

    servers = flags.get("servers", 0)
    cursor = EpochCursor(192, 8 * (world_size - servers), seed=0)
    logged = sorted(i for path in logs.glob("samples.*") for line in path.read_text().splitlines()
                    for i in map(int, line.split()[1:]))
    expected = sorted(i for step in range(40) for i in cursor.order(step // cursor.steps_from(0))[
        step % cursor.steps_from(0) * cursor.global_batch:][:cursor.step_size(step % cursor.steps_from(0)
                                                                              * cursor.global_batch)])
    assert logged == expected


# -- the command line, in a folder of the user's --------------------------------------------------------
MODELS_PY = '''
import torch
from torch import nn


def build(width=16):
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))
'''
DATA_PY = '''
import torch
from torch.utils.data import TensorDataset


def build(n=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    return TensorDataset(x[:3200], y[:3200]), TensorDataset(x[3200:], y[3200:])
'''


@pytest.fixture
def user_folder(tmp_path):
    """An empty folder holding only the user's package (my_pkg: models.py, data.py)."""
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(textwrap.dedent(MODELS_PY))
    (package / "data.py").write_text(textwrap.dedent(DATA_PY))
    return tmp_path


def _gradsync(folder: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradsync.cli", *args], cwd=folder, capture_output=True, text=True,
                          timeout=timeout)


USER_TASK = ["--model", "my_pkg.models:build", "--model-args", "width=12", "--data", "my_pkg.data:build",
             "--loss", "mse", "--batch-size", "16", "--quiet", "--timeout", "30"]


@pytest.mark.timeout(400)
def test_the_command_line_trains_a_users_package_reruns_its_config_and_resumes_a_preemption(user_folder):
    """In a folder holding only the user's package: a traced run with checkpoints, `gradsync doctor` on it,
    the run again from its own config.toml into another --out (bit-identical weights), and a SIGTERM to the
    whole job mid-run (exit 75, a checkpoint), resumed with --resume to the uninterrupted run's weights."""
    full = _gradsync(user_folder, "train", *USER_TASK, "--steps", "150", "--checkpoint-every", "40", "--trace",
                     "--out", "runs/full")
    assert full.returncode == 0, full.stderr[-3000:]
    config = (user_folder / "runs/full/config.toml").read_text()
    assert 'model = "my_pkg.models:build"' in config and "width = 12" in config
    doctor = _gradsync(user_folder, "doctor", "runs/full")
    report = " ".join(doctor.stdout.replace("│", " ").split())
    assert doctor.returncode == 0 and "batch math" in report and "trace.json" in report, doctor.stdout[-2000:]
    again = _gradsync(user_folder, "train", "--config", "runs/full/config.toml", "--out", "runs/again")
    assert again.returncode == 0, again.stderr[-3000:]
    weights = checkpoint.load(user_folder / "runs/full/checkpoint.pt")["model"]
    rerun = checkpoint.load(user_folder / "runs/again/checkpoint.pt")["model"]
    assert all(torch.equal(weights[k], rerun[k]) for k in weights)

    cut = subprocess.Popen([sys.executable, "-m", "gradsync.cli", "train", *USER_TASK, "--steps", "150",
                            "--checkpoint-every", "40", "--out", "runs/cut"], cwd=user_folder,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = user_folder / "runs/cut/metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and '"event": "step"' in metrics.read_text()):
        assert cut.poll() is None and time.monotonic() < deadline, cut.communicate()[1][-3000:]
        time.sleep(0.01)
    os.killpg(cut.pid, signal.SIGTERM)
    stdout, stderr = cut.communicate(timeout=120)
    assert cut.returncode == 75, (cut.returncode, stderr[-3000:])
    stopped = checkpoint.load(user_folder / "runs/cut/checkpoint.pt")["step"]
    assert 0 < stopped < 150 and f"preempted at step {stopped}" in stdout
    resumed = _gradsync(user_folder, "train", *USER_TASK, "--steps", "150", "--checkpoint-every", "40",
                        "--out", "runs/cut", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = checkpoint.load(user_folder / "runs/cut/checkpoint.pt")["model"]
    assert all(torch.equal(weights[k], final[k]) for k in weights), "the resumed run differs from the uninterrupted"


@pytest.mark.timeout(300)
def test_live_mode_trains_a_users_model_through_a_death_and_a_replacement(user_folder):
    """--fault-tolerance live with --max-restarts 1 on the user's package: member 1 dies in step 5 after its
    forward, the survivors train on, a replacement joins, and every sample of the first epoch was trained
    exactly once (the members' sample logs)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from live_fns import trained_ids

    logs = user_folder / "ids"
    logs.mkdir()
    env = {**os.environ, "GRADSYNC_SAMPLE_LOG": str(logs), "GRADSYNC_LIVE_KILL": "1:5:forward",
           "GRADSYNC_LIVE_AWAIT_JOINER": "1"}
    done = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", *USER_TASK, "--workers", "3",
                           "--fault-tolerance", "live", "--max-restarts", "1", "--epochs", "1", "--out", "runs/live"],
                          cwd=user_folder, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(x) for x in (user_folder / "runs/live/metrics.jsonl").read_text().splitlines()]
    changes = [r for r in records if r["event"] == "live"]
    assert [bool(c["joined"]) for c in changes] == [False, True] and changes[0]["lost"] == [1], changes
    ids = trained_ids(logs, lost=[1], resumed_from=changes[0]["step"])
    assert ids == {0: list(range(3200))}, {e: len(v) for e, v in ids.items()}


def test_the_config_file_sets_flags_by_name_the_command_line_wins_and_an_unknown_key_is_named(tmp_path, capsys):
    from gradsync.train.config_file import read
    from gradsync.train.config import TrainConfig
    from gradsync.cli.train import config_of
    from gradsync.cli import build_parser

    path = tmp_path / "run.toml"
    path.write_text('model = "own_task:regressor"\ndata = "own_task:regression"\nbatch-size = 12\nlr_schedule = "linear"\n'
                    f'out = "{tmp_path / "o"}"\n[model-args]\nwidth = 5\n')
    argv = ["train", "--config", str(path), "--batch-size", "20"]
    args = build_parser().parse_args(argv)
    args.argv = argv
    cfg = config_of(args)
    assert (cfg.model, cfg.dataset, cfg.batch_size, cfg.lr_schedule, cfg.model_args) == \
        ("own_task:regressor", "own_task:regression", 20, "linear", {"width": 5})
    path.write_text("batch-sise = 12\n")
    with pytest.raises(ValueError, match="unknown key 'batch-sise'; did you mean 'batch-size'"):
        read(path, TrainConfig.__dataclass_fields__)
    assert main(["train", "--config", str(path)]) == 2
    assert "did you mean 'batch-size'" in capsys.readouterr().err


def test_the_schedules_follow_torchs_own_schedulers():
    """Warm-up then cosine or linear to min_lr (train/optimizers.lr_at) against torch's LinearLR warm-up chained
    with CosineAnnealingLR / LinearLR (torch.optim.lr_scheduler.SequentialLR) over 50 steps."""
    from gradsync.train.optimizers import lr_at

    peak, warmup, total, low = 0.3, 5, 50, 0.01
    for schedule in ("cosine", "linear", "constant"):
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=peak)
        first = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
        after = {"cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup, eta_min=low),
                 "linear": lambda: torch.optim.lr_scheduler.LambdaLR(
                     opt, lambda s: (low + (peak - low) * (1 - min(1, s / (total - warmup)))) / peak),
                 "constant": lambda: torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0)}[schedule]()
        chained = torch.optim.lr_scheduler.SequentialLR(opt, [first, after], milestones=[warmup])
        for step in range(total):
            assert lr_at(step, peak, warmup, schedule, total, low) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9), \
                (schedule, step)
            opt.step()
            chained.step()
