"""The interface every experiment tracker implements (train/trackers/: one module per tracker).

A tracker is made by the reporting rank for one tracker run, named by the run key every rank agreed on
(train/tracking.py), and then only written to:

    Tracker(run_dir, run_key, purge_after)
        run_dir      the training run's --out: where a tracker keeps its files, unless told otherwise
        run_key      the tracker run's name: the same from the run's start through every resume
        purge_after  a resume from a checkpoint of this step: steps after it that an earlier attempt
                     recorded (a crash after the checkpoint) are not recorded twice; None: a new run, or
                     a reporting rank taking over a live run (what the one before it recorded stays)
    log(step, values)   record ``values`` ({name: number}) at ``step``; steps never go back
    finish(done)        close the tracker run; done: the training run finished (else it was stopped and
                        a resume goes on with it)
"""

from __future__ import annotations

from pathlib import Path


class Tracker:
    name = "?"

    def __init__(self, run_dir: Path, run_key: str, purge_after: int | None) -> None:
        self.run_dir, self.run_key, self.purge_after = Path(run_dir), run_key, purge_after

    def log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def finish(self, done: bool) -> None:
        raise NotImplementedError
