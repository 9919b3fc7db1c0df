"""Tables and report lines stay whole when stdout is a pipe (CI logs, `| tee`): rich would wrap them at 80
columns there and split cells over two lines. COLUMNS, when set, is the width."""

import os
import subprocess
import sys

import pytest

from gradsync.sim.cost import STRATEGIES


def _piped(args: list[str], columns: str | None = None, cwd=None) -> list[str]:
    """stdout lines of ``gradsync ARGS`` run with stdout a pipe (not a terminal)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = columns
    done = subprocess.run([sys.executable, "-m", "gradsync.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env, cwd=cwd, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.timeout(60)
def test_a_table_in_a_pipe_keeps_each_row_on_one_line():
    # one row per strategy of the cost model; the ps row's note ("1 server(s), each ... in and out; push-then-pull server: ...")
    # is longer than 80 columns leave it, so a wrapped table splits it over two lines
    lines = _piped(["simulate", "--params", "7B", "--workers", "64"])
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == len(STRATEGIES), "\n".join(lines)
    ps_row = next(row for row in rows if row.split("│")[1].strip() == "ps")
    assert "server(s)" in ps_row and "push-then-pull server" in ps_row, ps_row
    assert len({len(line) for line in lines[1:]}) == 1   # every line below the title is the table's width


@pytest.mark.timeout(60)
def test_columns_sets_the_width_in_a_pipe():
    lines = _piped(["simulate", "--params", "7B", "--workers", "64"], columns="100")
    assert max(len(line) for line in lines) <= 100, "\n".join(lines)


@pytest.mark.timeout(120)
def test_train_header_in_a_pipe_is_one_line_per_fact(tmp_path):
    lines = _piped(["train", "--workers", "1", "--steps", "1", "--quiet", "--out", str(tmp_path / "run")])
    batch = [line for line in lines if line.startswith("batch:")]
    assert len(batch) == 1 and batch[0].endswith("1 steps in all"), "\n".join(lines)
