"""What the loop asks of a strategy's object: the interface every strategy implements, with the
answers most of them share.

One object a rank, made by the loop once the model, the optimizer's spec and the batch plan exist
(``Strategy(run)``, run: train/loop.py's Run, which holds them), and called as:

    trainers()            (this rank's index among the ranks that train, how many train now)
    where(cursor)         (epoch, position, slot, slots): the samples of the next step are share
                          ``slot`` of ``slots`` of the step at that position
    run_step(work, stop)  zero the gradients, work.choose() and work.compute(forward, no_sync, chosen)
                          -- the forward and backward of this rank's share -- then reduce and step
                          (through --precision's scaler: _finish_step, agree_found_inf);
                          True once the step is committed, False when it is to be tried again (the
                          world changed) or the job stops here (``stopping``)
    collective(fn)        fn(), a collective outside a step (run again in a new world by live mode)
    serve(stop), finish() a parameter server's side, and a worker's last pull
    state(...), close()   what a checkpoint holds of it; its end
with ``step`` (committed steps) and ``progress`` ({"epoch", "position"} after them) its counters.
"""

from __future__ import annotations

import contextlib

import torch

import gradsync as gs
from gradsync.observe import trace
from gradsync.replicas import first_mismatch


class StrategyObject:
    """The interface (module docstring) and its common answers: every rank trains, in a world that does
    not change, stepping with a local optimizer."""

    serves = False
    """This rank holds parameters for others (a parameter server) instead of training."""
    evaluates_each_epoch = True
    """Every rank can take part in an evaluation at an epoch's end (a server is busy serving)."""
    checkpoints_each_epoch = True
    """A checkpoint is written at every epoch's end and on --checkpoint-every."""

    def __init__(self, run) -> None:
        self.run = run
        self._step, self._progress = 0, {"epoch": 0, "position": 0}
        self.comm_seconds = self.wait_seconds = 0.0
        self.last_overlap: float | None = None
        self.grad_norm: float | None = None

    @property
    def step(self) -> int:
        """Optimizer steps committed (a parameter-server worker: its clock)."""
        return self._step

    @property
    def progress(self) -> dict:
        """{"epoch", "position"} after the committed steps (data.EpochCursor's position)."""
        return self._progress

    @property
    def recoveries(self) -> list:
        """Every change of the world so far (live mode's records; empty in a world that does not change)."""
        return []

    # -- the world ---------------------------------------------------------------------------------
    def trainers(self) -> tuple[int, int]:
        w = gs.world()
        return w.rank, w.world_size

    def reporting(self) -> bool:
        """This rank reports (the first that trains)."""
        return self.trainers()[0] == 0

    def where(self, cursor) -> tuple[int, int, int, int]:
        index, count = self.trainers()
        return self.progress["epoch"], self.progress["position"], index, count

    def more(self, total_steps: int) -> bool:
        """Whether a step is left: --steps, else the epochs."""
        cfg = self.run.cfg
        return self.step < cfg.steps if cfg.steps is not None else self.progress["epoch"] < cfg.epochs

    @property
    def global_batch(self) -> int:
        return self.run.plan.global_batch

    @property
    def peak_lr(self) -> float:
        return self.run.plan.peak_lr

    # -- a step ------------------------------------------------------------------------------------
    def run_step(self, work, stop: bool) -> bool:
        raise NotImplementedError

    def no_sync(self, last: bool):
        return contextlib.nullcontext()

    def commit(self, progress: dict) -> None:
        self._step += 1
        self._progress = dict(progress)

    @property
    def stopping(self) -> bool:
        return False

    def collective(self, fn):
        return fn()

    def serve(self, stop) -> None:
        raise AssertionError("only a parameter server serves")

    def finish(self) -> bool:
        return True

    def end_epoch(self) -> None:
        """At an epoch's end, before its evaluation and checkpoint."""

    # -- checkpoints and the end -------------------------------------------------------------------
    def resume(self, saved: dict) -> None:
        """Load a checkpoint's weights, optimizer state, RNG, counters (train/resume.py apply) and
        fp16-mixed's scaler; each strategy calls it where its construction allows."""
        from gradsync.train import resume

        self._step, epoch, position = resume.apply(saved, self.run.model, self.optimizer)
        self._progress = {"epoch": epoch, "position": position}
        self.run.precision.load_state_dict(saved.get("precision"))

    def plan_now(self):
        """The batch the run trains with now (live mode's changes when the world changes size)."""
        return self.run.plan

    def state(self) -> dict:
        """What the checkpoint holds now (every rank calls it: collective for ZeRO-1)."""
        from gradsync.train import resume

        return {**resume.state_of(self.run.cfg, self.plan_now(), self.run.model, self.optimizer, self.step,
                                  self.progress["epoch"], self.progress["position"], gs.world().world_size),
                "precision": self.run.precision.state_dict()}

    def after_checkpoint(self, state: dict) -> None:
        """Every rank, after the checkpoint's state was taken (DiLoCo writes each replica)."""

    def check_replicas(self) -> None:
        mismatch = first_mismatch(list(self.run.model.parameters()))
        if mismatch is not None:
            raise gs.ReplicaMismatchError(f"replicas diverged at parameter #{mismatch[1]} (rank {mismatch[0]})")

    def evaluation_ranks(self) -> list[int] | None:
        """The ranks that score the test set (None: every rank)."""
        return None

    def partial_writes(self, lost: list[int]) -> list[int]:
        """Process ids, on this host, of the ``lost`` members whose half-written checkpoint may lie in --out."""
        return []

    def stats(self) -> dict:
        """What the strategy's machinery counted (a parameter server's bytes, waits, staleness)."""
        return {}

    def extra_stats(self) -> list[float]:
        """Numbers every rank adds to the summary's gather (a parameter server's staleness)."""
        return []

    def close(self) -> None:
        pass

    # -- shared by the strategies that step a local optimizer ---------------------------------------
    def agree_found_inf(self, found: bool) -> bool:
        """fp16-mixed: the verdict every rank takes on this step's inf/NaN, from this rank's ``found``.
        Here its own: the gradients it checked are the same on every rank (the reduced ones, or one
        process's). A strategy whose ranks check gradients that differ agrees (train/precision.py)."""
        return found

    def _agree_by_max(self, found: bool) -> bool:
        """Any rank's inf or NaN skips the step on every rank: one 1-element all-reduce (max)."""
        flag = torch.tensor([float(found)])
        gs.all_reduce(flag, op="max")
        return bool(flag[0] > 0)

    def _finish_step(self, clip) -> bool:
        """Unscale (fp16-mixed), agree, ``clip()`` and the optimizer's step, or skip both on every rank;
        True when the step was applied (train/precision.py)."""
        def apply() -> None:
            with trace.span("optimizer step", "compute"):
                self.optimizer.step()

        applied = self.run.precision.step(self.run.model.parameters(), apply, clip, agree=self.agree_found_inf,
                                          step_number=self.step + 1)
        if not applied:
            self.grad_norm = None
        return applied

    def _set_lr(self) -> None:
        lr = self.run.lr_at(self.step, self.peak_lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _clip(self) -> None:
        """--clip-grad with torch's clip_grad_norm_ (its .grad is what one process would hold)."""
        clip = self.run.cfg.clip_grad
        self.grad_norm = None if clip is None else float(torch.nn.utils.clip_grad_norm_(
            self.run.model.parameters(), clip))
