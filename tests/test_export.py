"""`gradsync export RUN_DIR`: the trained weights as a plain state dict, for every strategy family.

Oracle: the run's own final test accuracy and loss (metrics.jsonl's summary), against the exported file
loaded by its own library (safetensors.torch.load_file, torch.load(weights_only=True)) into the model
the task's factory builds and scored here with plain torch over the whole test set: the accuracy is
the same count of correct answers, so equal exactly; the loss within float32's summation order.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from gradsync import checkpoint
from gradsync.cli import main
from gradsync.train.config import TrainConfig
from gradsync.train.datasets import digits
from gradsync.train.launcher import run
from gradsync.train.task import Task

safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[1]
SECTION = "### `gradsync export`: bad input, one line"


def _summary(out: Path) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["event"] == "summary"][-1]


@torch.no_grad()
def _score(model: torch.nn.Module, seed: int) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on digits' test split, the whole split at once."""
    x, y = digits(seed)[1].tensors
    model.eval()
    outputs = model(x)
    return int((outputs.argmax(dim=1) == y).sum()) / len(y), float(torch.nn.functional.cross_entropy(outputs, y))


def _load(path: Path, fmt: str) -> dict:
    return safetensors_torch.load_file(str(path)) if fmt == "safetensors" else torch.load(path, weights_only=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags", [
    dict(strategy="zero1", workers=2, steps=20, warmup_steps=0),          # ddp, zero1, local: one family
    dict(strategy="ps-sync", workers=3, servers=2, steps=20, warmup_steps=0),   # two servers' shards in one model
    dict(strategy="diloco", workers=2, epochs=1, batch_size=64, sync_every=4),   # ends on an outer step
], ids=["zero1", "ps-sync", "diloco"])
def test_the_exported_weights_score_the_runs_final_accuracy(flags, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = TrainConfig(out=str(out), quiet=True, **flags)
    run(cfg)
    summary = _summary(out)
    assert summary["accuracy"] is not None
    for fmt in ("safetensors", "pt"):
        path = tmp_path / f"weights.{fmt}"
        assert main(["export", str(out), "--format", fmt, "--out", str(path)]) == 0
        assert not path.read_bytes().startswith(checkpoint.MAGIC)
        weights = _load(path, fmt)
        model = Task.of(cfg).build_model()
        model.load_state_dict(weights, strict=True)
        accuracy, loss = _score(model, cfg.seed)
        assert accuracy == summary["accuracy"], (fmt, accuracy, summary["accuracy"])
        assert loss == pytest.approx(summary["test_loss"], rel=1e-5), (fmt, loss, summary["test_loss"])
    said = capsys.readouterr().out
    assert f"gradsync export: wrote {tmp_path / 'weights.pt'} (pt, {len(weights)} tensors" in said, said
    if cfg.strategy == "diloco":   # the same checkpoint as if cut mid-round: said, and rank 0's replica exported
        state = checkpoint.load(out / "checkpoint.pt")
        state["diloco"]["inner_steps"] += 1
        checkpoint.save(out / "checkpoint.pt", state)
        assert main(["export", str(out)]) == 0
        assert "the DiLoCo checkpoint is mid-round (1 of 4 inner steps since the last outer step)" in \
            capsys.readouterr().out
        assert all(torch.equal(v, state["model"][k]) for k, v in _load(out / "model.safetensors", "safetensors").items())


def _bad_rows() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "reliability.md").read_text().split(SECTION, 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([^`]*)`[^|]* \| `([^`]*)` \|$", text, flags=re.MULTILINE)
    assert len(rows) >= 5, rows
    return rows


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, says", _bad_rows(), ids=[args for args, _ in _bad_rows()])
def test_bad_input_is_one_line(args, says, tmp_path, capsys):
    """docs/reliability.md's table: EMPTY an empty directory, MISSING none at all, TORN a run whose
    checkpoint was cut short, FOREIGN one whose checkpoint.pt is a plain torch.save file, RUN a run's."""
    paths = {name: tmp_path / name.lower() for name in ("EMPTY", "MISSING", "TORN", "FOREIGN", "RUN")}
    for name in ("EMPTY", "TORN", "FOREIGN", "RUN"):
        paths[name].mkdir()
    whole = {"model": {"w": torch.ones(3)}, "step": 1, "identity": {"model": "cnn", "strategy": "ddp"}}
    checkpoint.save(paths["RUN"] / "checkpoint.pt", whole)
    checkpoint.save(paths["TORN"] / "checkpoint.pt", whole)
    data = (paths["TORN"] / "checkpoint.pt").read_bytes()
    (paths["TORN"] / "checkpoint.pt").write_bytes(data[:len(data) - 100])
    torch.save({"model": {"w": torch.ones(3)}}, paths["FOREIGN"] / "checkpoint.pt")
    swap = lambda text: re.sub(r"\b(EMPTY|MISSING|TORN|FOREIGN|RUN)\b", lambda m: str(paths[m.group(1)]), text)  # noqa: E731
    try:
        code = main(["export", *shlex.split(swap(args))])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert len(err.strip().splitlines()) == 1 and swap(says) in err and "Traceback" not in err, err
