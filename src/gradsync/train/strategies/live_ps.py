"""--strategy ps-sync|ps-async|ssp --fault-tolerance live: a parameter-server job whose surviving
workers go on when a worker dies (LivePS, live/ps.py). A dead server ends the job on every rank with
live/ps.py's ServerLostError, naming it.

ps-sync: each step's global batch G split over the workers of the world as it is now. When a worker
dies, the servers roll back to the version every one of them holds, and the step in flight is trained
again by the W - 1 survivors over all its samples (its share read from live.progress and live.world
each time it is tried), so no sample is lost or trained twice.

ps-async, ssp: worker slot i trains slot i's share of every global step (tasks_of, ps.py). When a
worker dies, its steps from its clock on (the pushes some server applied from it count as done) are
dealt in turn to the survivors that have not closed, after their own; each push's loss is scaled by
W' / W, so that the servers' gradient / W' weighs it 1 / W as before the death.

The global batch and the learning rate stay (keep-global, live/policy.py). Checkpoints and preemption
as the default mode's parameter-server jobs (ps.py); --resume continues one with the same number of
workers. Fewer open workers than --min-workers stops the job as a preemption does (LivePS.below_floor). Left out: --live-batch keep-per-rank, sparse tables, --clip-grad, tracing, torchrun.
"""

from __future__ import annotations

from gradsync.live.ps import LivePS
from gradsync.train.strategies.ps import ParameterServerStrategy, optimizer_fn


class LiveParameterServer(ParameterServerStrategy):
    def _make(self, run):
        self.live = LivePS(run.model, optimizer_fn(run, 1 if self.mode == "sync" else run.plan.workers),
                           num_servers=self.servers, mode=self.mode, staleness=run.cfg.staleness,
                           min_workers=run.cfg.min_workers)
        return self.live.ps

    @property
    def step(self) -> int:
        return self.live.step

    @property
    def progress(self) -> dict:
        return self.live.progress

    def start_at(self, step: int, progress: dict) -> None:
        self.live.step, self.live.progress = step, dict(progress)

    @property
    def recoveries(self) -> list:
        return self.live.recoveries

    def serve(self, stop) -> None:
        self.live.serve(stop=stop)

    def run_step(self, work, stop: bool) -> bool:
        def train_step(model) -> dict:
            self._after_pull()   # fp16-mixed: the verdict on the version pushed last (ps.py)
            return work.compute(model, self.no_sync, work.choose())

        return self.live.run_step(train_step, stop=stop, nonfinite=self._before_push)

    @property
    def stopping(self) -> bool:
        return self.live.stopping

    def finish(self) -> bool:
        done = self.live.finish()
        if done:
            self._after_pull()
        return done

    def collective(self, fn):
        return self.live.collective(fn)

    def state_at_end(self) -> dict:
        return self.live.collective(self.live.ps.state_dict)

    def save_at_end(self, state: dict) -> None:
        self.live.collective(lambda: super(LiveParameterServer, self).save_at_end(state))

    def stats(self) -> dict:
        return self.live.stats()

    def close(self) -> None:
        self.live.close()
