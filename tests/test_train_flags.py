"""`gradsync train`'s bad flags and --out cases, decided in the launcher before any rank starts.

The oracle is the table in docs/reliability.md ("bad flags, refused before any rank starts"): each
row's flags, run through gradsync's main in this process with gs.spawn and gs.init replaced by a
failure (a rank would have been started), must exit 2 within a second with one line on stderr that
says what the row says. RUN stands for a directory holding a 3-step ddp run's checkpoint, EMPTY for
an empty directory.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import time
from pathlib import Path

import pytest

import gradsync as gs
from gradsync import checkpoint
from gradsync.cli import main
from gradsync.train import requeue, resume
from gradsync.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SECTION = "### `gradsync train`: bad flags, refused before any rank starts"


def _rows() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "reliability.md").read_text().split(SECTION, 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([^`]*)`[^|]* \| `([^`]*)` \|$", text, flags=re.MULTILINE)
    assert len(rows) >= 25, f"the table has {len(rows)} rows"
    return rows


def _hidden(flags: str) -> list[str]:
    """The packages a row runs without: its "(X not installed)" (docs/reliability.md, under the table)."""
    text = (ROOT / "docs" / "reliability.md").read_text().split(SECTION, 1)[1]
    row = next(line for line in text.splitlines() if line.startswith(f"| `{flags}`"))
    return re.findall(r"\((\S+) not installed\)", row.split("|")[1])


def _a_run(out: Path, steps: int = 3) -> Path:
    """A checkpoint as a 2-worker ddp run of ``steps`` steps on digits leaves it (its record, no weights)."""
    out.mkdir(parents=True, exist_ok=True)
    written = TrainConfig(out=str(out))
    checkpoint.save(out / resume.CHECKPOINT_NAME, {**resume.run_record(written, resume.BatchPlan.fresh(written, 2)),
                                                   "step": steps, "epoch": 0, "position": 64 * steps})
    (out / "metrics.jsonl").write_text('{"event": "start"}\n')
    return out


@pytest.fixture
def no_ranks(monkeypatch, tmp_path):
    """Runs in tmp_path (the default --out, runs/latest, lands there); starting a rank fails the test."""
    def started(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.chdir(tmp_path)
    gs.spawn   # load the public names, then replace the two ways a rank starts
    monkeypatch.setattr(gs, "spawn", started)
    monkeypatch.setattr(gs, "init", started)


def _train(argv: list[str]) -> tuple[int, float]:
    started = time.perf_counter()
    try:
        code = main(["train", *argv])
    except SystemExit as exit_:
        code = exit_.code
    return code, time.perf_counter() - started


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, says", _rows(), ids=[flags for flags, _ in _rows()])
def test_a_bad_flag_fails_in_one_line_before_any_rank_starts(flags, says, no_ranks, tmp_path, capsys, monkeypatch):
    from gradsync.train import trackers

    hidden, found = _hidden(flags), trackers.installed
    monkeypatch.setattr(trackers, "installed", lambda module: module not in hidden and found(module))
    paths = {"RUN": str(_a_run(tmp_path / "run")), "EMPTY": str(tmp_path / "empty")}
    (tmp_path / "empty").mkdir()
    swap = lambda text: re.sub(r"\b(RUN|EMPTY)\b", lambda m: paths[m.group(1)], text)   # noqa: E731
    code, seconds = _train(shlex.split(swap(flags)))
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert len(err.strip().splitlines()) == 1, err
    assert swap(says) in err, err
    assert seconds < 1.0, f"{seconds:.2f} s to refuse {flags}"
    assert "Traceback" not in err


@pytest.mark.timeout(60)
def test_out_the_finished_run_and_the_default_directory(no_ranks, tmp_path, capsys):
    """--resume of a finished run: one line, exit 0, no rank; a run in the default --out is replaced
    (its files removed, said in one line) where a run in a named one is refused (the table above)."""
    run = _a_run(tmp_path / "run")
    assert _train(["--resume", "--steps", "3", "--out", str(run)])[0] == 0
    out = capsys.readouterr().out
    assert out.strip() == (f"gradsync train: the run in {run} is finished (step 3, --steps 3): nothing left to train; "
                           "give a larger --epochs or --steps with --resume to train on"), out
    with pytest.raises(AssertionError, match="a rank was started"):   # in epoch 0 of --epochs 1: steps left
        _train(["--resume", "--epochs", "1", "--out", str(run)])
    default = _a_run(tmp_path / "runs" / "latest")
    with pytest.raises(AssertionError, match="a rank was started"):
        _train(["--steps", "3"])
    assert capsys.readouterr().out.startswith("gradsync train: replaced the run in runs/latest (cnn on digits, "
                                              "--strategy ddp, checkpoint at step 3); name --out DIR to keep a run")
    assert not (default / "checkpoint.pt").exists() and not (default / "metrics.jsonl").exists()


@pytest.mark.timeout(60)
def test_resume_auto_continues_a_checkpoint_or_starts_a_run(no_ranks, monkeypatch, tmp_path, capsys):
    """--resume auto (one sbatch script for a job and its requeues: docs/slurm.md): a checkpoint in --out is
    continued as --resume continues it (here a finished run: one line, exit 0, no rank), a checkpoint of
    another run is refused as --resume refuses it, and an --out without one starts a new run."""
    run = _a_run(tmp_path / "run")
    assert _train(["--resume", "auto", "--steps", "3", "--out", str(run)])[0] == 0
    out = capsys.readouterr().out
    assert f"--resume auto: continuing the run in {run} from step 3" in out and f"the run in {run} is finished" in out
    code, _ = _train(["--resume", "auto", "--strategy", "ps-sync", "--workers", "3", "--out", str(run)])
    assert code == 2 and "the checkpoint in" in capsys.readouterr().err
    reached: list = []
    monkeypatch.setattr(gs, "spawn", lambda fn, nprocs=None, args=(), **kwargs: reached.append(args[0]) or [])
    assert _train(["--resume", "auto", "--steps", "3", "--out", str(tmp_path / "new")])[0] == 0
    assert [cfg.resume for cfg in reached] == [False], reached
    assert f"--resume auto: {tmp_path / 'new'} holds no checkpoint; starting a new run" in capsys.readouterr().out
    # the ranks' own decision (a TrainConfig made without the command line)
    assert resume.wanted(TrainConfig(resume="auto", out=str(run)))
    assert not resume.wanted(TrainConfig(resume="auto", out=str(tmp_path / "new")))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exit_status", [0, 1])
def test_requeue_says_so_before_asking_and_a_refusal_is_one_line(monkeypatch, tmp_path, capsys, exit_status):
    """--requeue on rank 0 after a preemption's checkpoint: the line naming the requeue comes before
    `scontrol requeue` runs (Slurm ends the job's tasks as it accepts); a refusal adds one line naming the
    command and Slurm's words, and after_checkpoint says whether Slurm accepted. A stand-in scontrol on PATH
    records its arguments."""
    called = tmp_path / "called"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" > {called}\n"
                        + ("echo 'Requested operation is presently disabled' >&2\n" if exit_status else "")
                        + f"exit {exit_status}\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    cfg = TrainConfig(requeue=True)
    assert not requeue.after_checkpoint(cfg, 1, "preempted") and not requeue.after_checkpoint(cfg, 0, "interrupted")
    assert not called.exists(), "only rank 0 requeues, and only a preemption"
    assert requeue.after_checkpoint(cfg, 0, "preempted") == (exit_status == 0)
    assert called.read_text().split() == ["requeue", "4242"]
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("gradsync train: requeueing Slurm job 4242 (scontrol requeue 4242)")
    assert lines[1:] == ([] if exit_status == 0 else [
        "gradsync train: --requeue: 'scontrol requeue 4242' failed: Requested operation is presently disabled "
        "(submit with sbatch --requeue); the checkpoint is written: resubmit the job to continue"])


def _tour_train_commands() -> list[tuple[str | None, list[str]]]:
    """The README tour's `gradsync train` commands in order (after `timeout N`, between && and ;), each with
    the folder a `cd DIR` before it on its line moved to (None: where the tour starts)."""
    text = (ROOT / "README.md").read_text().split("## A tour", 1)[1].split("```", 2)[1]
    commands = []
    for line in text.splitlines():
        folder = None
        for part in re.split(r"&&|;", line.split("#", 1)[0]):
            if part.strip().startswith("cd "):
                folder = part.split()[1]
            if "gradsync train" not in part:
                continue
            argv = shlex.split(part)
            if argv[:2] == ["timeout", argv[1] if len(argv) > 1 else ""]:
                argv = argv[2:]
            if argv[:2] == ["gradsync", "train"]:
                commands.append((folder, argv[2:]))
    assert len(commands) >= 20, commands
    return commands


@pytest.mark.timeout(180)   # each line's task is built and probed: word2vec's samples take seconds
def test_the_readme_tour_train_commands_pass_every_check_in_order(no_ranks, monkeypatch, tmp_path, capsys):
    """Each `gradsync train` line of the tour, run in order in one directory, passes every check made
    before the ranks start and reaches them; each run leaves its metrics.jsonl where it trained, so a
    later line that trains into a directory an earlier one named, without --resume, is refused as
    a user's would be. The naive line runs on N >= 3 workers, where the gather-to-one pattern's
    rank 0 sends (N-1) x M, not ring's 2(N-1)/N x M (equal at N = 2); word2vec's line trains a
    minute's 3,000 steps."""
    reached: list = []

    def start(fn, nprocs=None, args=(), **kwargs):
        cfg = args[0]
        reached.append(cfg)
        (Path(cfg.out) / "metrics.jsonl").write_text('{"event": "start"}\n')   # what a run leaves
        if cfg.resume or Path(cfg.out, resume.CHECKPOINT_NAME).exists():
            return []
        checkpoint.save(Path(cfg.out) / resume.CHECKPOINT_NAME, {**resume.run_record(cfg, resume.BatchPlan.fresh(
            cfg, cfg.workers - (cfg.servers if cfg.strategy.startswith(("ps", "ssp")) else 0))), "step": 1,
            "epoch": 0, "position": 1, "ps": {"clocks": [1]}} if cfg.strategy.startswith(("ps", "ssp")) else
            {**resume.run_record(cfg, resume.BatchPlan.fresh(cfg, cfg.workers)), "step": 1, "epoch": 0, "position": 1})
        return []

    monkeypatch.setattr(gs, "spawn", start)
    monkeypatch.setattr(gs, "init", lambda *a, **k: (_ for _ in ()).throw(AssertionError("local start")))
    for folder, argv in _tour_train_commands():
        before = len(reached)
        if folder is not None:   # a copy of the repository's folder, so that the runs land in tmp_path
            copy = tmp_path / "tour" / folder
            if not copy.exists():
                shutil.copytree(ROOT / folder, copy, ignore=shutil.ignore_patterns("runs", "__pycache__"))
            monkeypatch.chdir(copy)
        try:
            code = main(["train", *argv])
        except AssertionError as error:   # --strategy local starts in this process
            code = 0 if str(error) == "local start" else error
        finally:
            monkeypatch.chdir(tmp_path)
        err = capsys.readouterr().err
        assert code == 0 and (len(reached) == before + 1 or "--strategy local" in " ".join(argv)), (argv, code, err)
    naive = [cfg for cfg in reached if cfg.algorithm == "naive"]
    assert naive and all(cfg.workers >= 3 for cfg in naive), [cfg.workers for cfg in naive]
    word2vec = [cfg for cfg in reached if cfg.model == "word2vec"]
    assert [cfg.steps for cfg in word2vec] == [3000, None] and word2vec[1].epochs == 1


def test_train_help_gives_every_flag_a_meaning_and_its_default(capsys, monkeypatch):
    """`gradsync train --help`: every flag has words of its own, and every flag with a value by default
    shows it as `(default: X)` in its help, --out's runs/latest among them."""
    from gradsync.cli import build_parser

    monkeypatch.setenv("COLUMNS", "1000")   # no line breaks inside a value (argparse wraps at hyphens)

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    options = capsys.readouterr().out.split("options:", 1)[1]
    blocks = {block.split()[0]: " ".join(block.split()[1:]) for block in re.split(r"\n  (?=-)", options)
              if block.strip()}
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    flags = [a for a in train._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 30
    for action in flags:
        flag = action.option_strings[0]
        block = blocks.get(flag, "")
        words = block.removeprefix(action.metavar or action.dest.upper()).split() if action.nargs != 0 else block.split()
        assert len(words) >= 3, f"{flag} has no meaning in --help: {block!r}"
        if action.default not in (None, False, ""):
            assert f"(default: {action.default})" in block, f"{flag}: no default shown: {block!r}"
    assert "(default: runs/latest)" in blocks["--out"]


def test_the_staleness_unit_is_steps_in_the_help_the_readme_and_the_summary(tmp_path, capsys):
    """--staleness bounds worker clocks (steps), while the summary's staleness counts versions: the help,
    the README's ssp line and the summary all say steps for the bound."""
    import torch

    from gradsync.train.report import Reporter

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "how many steps (worker clocks) the fastest worker may run ahead of the slowest" in text
    tour = (ROOT / "README.md").read_text().split("## A tour", 1)[1]
    (ssp,) = [line for line in tour.splitlines() if "--strategy ssp" in line and "--staleness 2" in line]
    assert "2+ steps ahead" in ssp, ssp
    report = Reporter(TrainConfig(workers=3, strategy="ssp", out=str(tmp_path)), 10, enabled=True)
    report.finish(1.0, 10, {"accuracy": 0.5, "test_loss": 1.0}, torch.ones(3, 5), workers=2,
                  staleness={"mean": 1.5, "max": 5.0, "updates": 40.0})
    shown = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "max 5 versions" in shown and "--staleness 2 bounds steps, each worker's clock, not versions" in shown, shown


def test_diloco_and_powersgd_settings_have_one_declaration_that_every_command_defaults_to():
    # TrainConfig holds H, r and DiLoCo's outer step; bench slowlinks, cluster --time-to-loss,
    # simulate and their plans (slowlinks.Plan, cluster.jobs.Job) start from its values
    from gradsync.bench.slowlinks import Plan
    from gradsync.cli import build_parser
    from gradsync.cluster.jobs import Job
    from gradsync.train.config import TrainConfig

    names = ("sync_every", "powersgd_rank", "outer_lr", "outer_momentum")
    declared = {name: getattr(TrainConfig(), name) for name in names}
    commands = {"train": ["train"], "bench slowlinks": ["bench", "slowlinks"], "cluster": ["cluster"],
                "simulate": ["simulate", "--workers", "2"]}
    parser = build_parser()
    for label, argv in commands.items():
        args = vars(parser.parse_args(argv))
        for name in names:
            if name in args and args[name] is not None:
                assert args[name] == declared[name], (label, name, args[name], declared[name])
    assert "outer_lr" in vars(parser.parse_args(["cluster"])) and "sync_every" in vars(parser.parse_args(commands["simulate"]))
    for plan in (Plan(), Job("diloco", 2, 0.0)):
        assert {name: getattr(plan, name) for name in names} == declared, type(plan).__name__
