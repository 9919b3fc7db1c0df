"""--log wandb: a W&B run in offline mode (WANDB_MODE=online sends it instead), its files in
RUN_DIR/wandb/offline-run-DATE-ID/ (`wandb sync RUN_DIR/wandb` uploads them; `wandb leet inspect
--json` prints them), project "gradsync" (WANDB_PROJECT another).

The run's id is the run key, opened with resume="allow": each resume, and a reporting rank taking
over a live run, writes a new offline directory of the same id, which `wandb sync` joins into one
run. W&B commits a step once, when the next one begins: the values of a step are held until then,
or until finish. W&B's service (wandb-core, a process of its own) writes the run file as it goes
and at finish; a reporting rank killed outright (SIGKILL) takes with it what the service had not
written yet (TensorBoard's and MLflow's records are on disk as each step is recorded).
"""

from __future__ import annotations

import os

from gradsync.train.trackers.base import Tracker

PROJECT = "gradsync"


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, run_dir, run_key, purge_after) -> None:
        super().__init__(run_dir, run_key, purge_after)
        import wandb

        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_meta=True)
        self.run = wandb.init(dir=str(self.run_dir), project=os.environ.get("WANDB_PROJECT") or PROJECT,
                              id=run_key, resume="allow", name=f"{self.run_dir.name}-{run_key}",
                              mode=os.environ.get("WANDB_MODE") or "offline", settings=settings)
        self.pending_step: int | None = None
        self.pending: dict[str, float] = {}

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.pending_step is not None and step != self.pending_step:
            self._commit()
        self.pending_step = step
        self.pending.update(values)

    def _commit(self) -> None:
        if self.pending_step is not None:
            self.run.log(self.pending, step=self.pending_step)
        self.pending_step, self.pending = None, {}

    def finish(self, done: bool) -> None:
        self._commit()
        self.run.finish(exit_code=0 if done else 1)
