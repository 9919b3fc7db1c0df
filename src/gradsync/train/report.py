"""What rank 0 shows and records: batch math, a progress bar, metrics.jsonl, the final summary.

The summary's per-rank columns come from every rank (all-gathered): compute seconds (step time
minus time spent waiting for buckets), communication seconds (time the communication thread spent
reducing, overlapped or not), exposed wait (time from backward's end until its reductions were done:
queued buckets and the slowest rank included, so it may exceed the communication seconds), bytes sent.
A rank whose compute time is more than 20% above the median is named as a straggler.

Every --log-every steps (a logged step) a "ranks" record holds each rank's step, exposed wait and
communication seconds (means over the steps since the record before) and bytes sent so far, which
`gradsync doctor` reads to find a rank that became slow partway through; with --log the same figures,
the loss, the lr, the throughput and, at each evaluation, the test figures go to the experiment
trackers (train/tracking.py), named:

    loss, lr, samples_per_s                      the logged step's loss and lr; samples/s over the window
    test/loss, test/accuracy                     at each evaluation's step
    rank{r}/step_s, rank{r}/compute_s,           rank r's mean step time over the window, its compute
    rank{r}/wait_s, rank{r}/comm_s,              (step - exposed wait), exposed wait and communication
    rank{r}/bytes_sent                           seconds; the payload bytes it sent since training started
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gradsync.group import runtime
from gradsync.observe import display
from gradsync.comm.world_transport import carrier
from gradsync.train.config import TrainConfig
from gradsync.train.strategies import strategy
from gradsync.train.tracking import Tracking

STRAGGLER_FACTOR = 1.2


def _human(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _placement() -> str:
    """", on H host(s), shared memory inside each" -- how this job's bytes travel (comm/world_transport.py)."""
    if not runtime.is_initialized() or runtime.world().world_size == 1:
        return ""
    hosts = len(runtime.world().hosts)
    inside = "shared memory inside each" if hosts > 1 else "shared memory"
    how = inside if carrier() == "shm" else "TCP (torch.distributed)"
    return f", {hosts} host(s), {how}"


class Reporter:
    """Rank 0's console output and metrics file; every method is a no-op on other ranks."""

    def __init__(self, cfg: TrainConfig, total_steps: int, enabled: bool, accuracy_name: str = "test accuracy") -> None:
        self.cfg = cfg
        self.accuracy_name = accuracy_name
        self.total_steps = total_steps
        self.enabled = enabled
        self.console = display.console(minimum_width=0)   # a terminal's own width; unwrapped in logs (display.py)
        self.metrics_path = Path(cfg.out) / "metrics.jsonl"
        self.progress = None
        self.task = None
        self.started = time.perf_counter()
        self.tracking = Tracking(cfg)

    def _record(self, record: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def start(self, global_batch: int, base_lr: float, peak_lr: float, steps_per_epoch: int, resumed_at,
              train_samples: int | None = None) -> None:
        """The batch math line (train/batch_math.py) and the start record, which `gradsync doctor` reads."""
        self.started = time.perf_counter()
        if not self.enabled:
            return
        c, workers = self.cfg, global_batch // (self.cfg.batch_size * self.cfg.grad_accum)
        self.console.print(f"[bold]gradsync train[/]: {c.model} on {c.dataset}, strategy {c.strategy}, "
                           f"algorithm {c.algorithm}, {workers} worker(s){_placement()}")
        length = f"{c.epochs} epochs x {steps_per_epoch} steps" if c.steps is None else f"{steps_per_epoch} steps/epoch"
        self.console.print(f"batch: {c.batch_size} per worker x {workers} workers x {c.grad_accum} accumulation "
                           f"= {global_batch} global; lr {base_lr:g} x {peak_lr / base_lr:.3g} ({c.lr_scaling} scaling"
                           f"{', unscaled: each worker steps alone' if not strategy(c.strategy).lr_scaled else ''}) = "
                           f"{peak_lr:g}, warm-up {c.warmup_steps} steps"
                           f"{f', then {c.lr_schedule} to {c.min_lr:g}' if c.lr_schedule not in (None, 'constant') else ''}"
                           f"; {length}, {self.total_steps} steps in all"
                           + (f"; clip grad 2-norm to {c.clip_grad:g} ({c.clip_site()})" if c.clip_grad else ""))
        if resumed_at is not None:
            self.console.print(f"resumed from {self.metrics_path.parent / 'checkpoint.pt'} at step {resumed_at}")
        self.tracking.open(purge_after=resumed_at)
        self._record({"event": "start", "config": c.to_dict(), "global_batch": global_batch, "peak_lr": peak_lr,
                      "base_lr": base_lr, "steps_per_epoch": steps_per_epoch, "total_steps": self.total_steps,
                      "train_samples": train_samples})
        if not c.quiet:
            self.progress = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(), console=self.console, transient=False)
            self.progress.start()
            self.task = self.progress.add_task("training", total=self.total_steps, completed=resumed_at or 0)

    def note(self, line: str) -> None:
        """A line said before training starts (what resuming on another world size changed)."""
        if self.enabled:
            print(f"gradsync train: {line}", flush=True)   # plain: a log keeps the line whole
            self._record({"event": "note", "text": line})

    def preempted(self, step: int, command: str, signal_at: float | None) -> None:
        """The job stopped on its preemption signal after ``step``, with a checkpoint."""
        if self.progress:
            self.progress.stop()
        if self.enabled:
            self._record({"event": "preempted", "step": step, "signal_at": signal_at, "checkpoint_at": time.time(),
                          "command": command})
            self.tracking.finish(done=False)   # the resume goes on with the same tracker run
            print(f"preempted at step {step}; resume with: {command}", flush=True)

    def live(self, record: dict) -> None:
        """A recovery of a live world (train/loop.py on_world_change): recorded, and said in one line."""
        if self.enabled:
            self._record(record)
            print(f"gradsync train: members {list(record['lost'])} lost; generation {record['generation']} of "
                  f"{record['world_size']} rank(s) trains on from step {record['step']} (the step in flight is "
                  f"redone), rebuilt in {record['seconds']:.3f} s; global batch {record['global_batch']}, "
                  f"lr {record['peak_lr']:g}", flush=True)

    def setup(self, **fields) -> None:
        """Record how the job is laid out (model size, buckets, placement) for `gradsync doctor`."""
        if self.enabled:
            self._record({"event": "setup", **fields})

    def step(self, step: int, epoch: int, loss: float, samples_per_s: float, overlap,
             grad_norm: float | None = None, bytes_sent: int | None = None, lr: float | None = None) -> None:
        """``grad_norm``: with --clip-grad, the averaged gradient's 2-norm before clipping (ddp, zero1, local).
        ``bytes_sent``: rank 0's payload bytes sent since training started (the traffic meter), so a
        loss curve can be drawn against bytes (gradsync bench slowlinks). ``lr``: the step's learning rate
        (a parameter server's: the workers' view of the schedule at their clock)."""
        if not self.enabled:
            return
        self._record({"event": "step", "step": step, "epoch": epoch, "loss": loss, "lr": lr,
                      "samples_per_s": samples_per_s, "overlap": overlap,
                      **({"grad_norm": grad_norm} if grad_norm is not None else {}),
                      **({"bytes_sent": bytes_sent} if bytes_sent is not None else {})})
        if step % self.cfg.log_every == 0:
            self.tracking.log(step, {"loss": loss, **({"lr": lr} if lr is not None else {}),
                                     **({"grad_norm": grad_norm} if grad_norm is not None else {})})
        if self.progress:
            self.progress.update(self.task, completed=step,
                                 description=f"epoch {epoch} loss {loss:.4f} {samples_per_s:,.0f} samples/s")

    def ranks(self, step: int, steps: int, ranks: list[int], per_rank: torch.Tensor, samples_per_s: float) -> None:
        """A logged step's record of every rank (module docstring): ``per_rank`` rows, in ``ranks``' order:
        mean step s, mean exposed wait s, mean communication s over the last ``steps`` steps, bytes sent so
        far; ``samples_per_s``: the window's throughput (samples trained / its seconds)."""
        if not self.enabled:
            return
        step_s, wait_s, comm_s, sent = (per_rank[:, i].tolist() for i in range(4))
        self._record({"event": "ranks", "step": step, "steps": steps, "ranks": list(ranks), "step_s": step_s,
                      "wait_s": wait_s, "comm_s": comm_s, "bytes_sent": sent})
        values = {"samples_per_s": samples_per_s}
        for r, rank in enumerate(ranks):
            values.update({f"rank{rank}/step_s": step_s[r], f"rank{rank}/compute_s": step_s[r] - wait_s[r],
                           f"rank{rank}/wait_s": wait_s[r], f"rank{rank}/comm_s": comm_s[r],
                           f"rank{rank}/bytes_sent": sent[r]})
        self.tracking.log(step, values)

    def epoch(self, epoch: int, step: int, evaluation: dict) -> None:
        if not self.enabled:
            return
        self._record({"event": "epoch", "epoch": epoch, "step": step, **evaluation,
                      "wall_s": time.perf_counter() - self.started})   # since training started, evaluations included
        self.tracking.log(step, {f"test/{k.removeprefix('test_')}": v for k, v in evaluation.items()
                                 if k in ("test_loss", "accuracy") and v is not None})
        if not evaluation:
            return
        line = f"epoch {epoch}: test loss {evaluation['test_loss']:.4f}" + (
            f", accuracy {evaluation['accuracy']:.2%}" if evaluation.get("accuracy") is not None else "")
        (self.progress.console if self.progress else self.console).print(line)

    def finish(self, wall: float, steps: int, evaluation: dict, per_rank: torch.Tensor,
               workers: int | None = None, staleness: dict | None = None,
               checkpoints: tuple[int, float, float] | None = None, trained: int | None = None) -> dict | None:
        """``steps``: the step the run has reached; ``trained``: how many of them this command trained
        (default all; fewer after --resume), which ``wall``, the throughput and the per-rank figures
        are of. ``per_rank`` rows: compute s, comm s, exposed wait s, bytes sent, overlap (-1: none).
        ``workers``: ranks that train (default: all; parameter servers do not). ``staleness``: for
        parameter-server runs, {"mean": versions, "max": versions, "updates": count}, shown instead of overlap.
        ``checkpoints``: (how many, seconds on the training thread, seconds writing in the background)."""
        if self.progress:
            self.progress.stop()
        if not self.enabled:
            return None
        c = self.cfg
        trained = steps if trained is None else trained
        samples = trained * c.batch_size * c.grad_accum * (workers or per_rank.shape[0])
        compute = per_rank[:, 0].tolist()
        median_compute = statistics.median([t for t in compute if t > 0] or [0.0])
        stragglers = [r for r, t in enumerate(compute) if median_compute > 0 and t > STRAGGLER_FACTOR * median_compute]
        # overlap: each rank's share weighed by its communication time (doctor.py computes the same from a trace)
        weighed = [(o * c, c) for o, c in zip(per_rank[:, 4].tolist(), per_rank[:, 1].tolist()) if o >= 0]
        overlap = (sum(h for h, _ in weighed) / sum(c for _, c in weighed)
                   if weighed and sum(c for _, c in weighed) > 0 else None)
        summary = {"wall_s": wall, "steps": steps, "steps_trained": trained,
                   "samples_per_s": samples / wall if wall > 0 else 0.0,
                   "accuracy": evaluation.get("accuracy"), "test_loss": evaluation.get("test_loss"),
                   "bytes_sent_per_rank": per_rank[:, 3].tolist(), "compute_s": compute,
                   "comm_s": per_rank[:, 1].tolist(), "wait_s": per_rank[:, 2].tolist(),
                   "overlap": overlap, "stragglers": stragglers,
                   "staleness": staleness, "checkpoints": checkpoints[0] if checkpoints else None,
                   "checkpoint_s": checkpoints[1] if checkpoints else None,
                   "checkpoint_write_s": checkpoints[2] if checkpoints else None}
        self._record({"event": "summary", **summary})
        self.tracking.finish(done=True)
        table = Table(title="gradsync train: summary")
        table.add_column("")
        table.add_column("value", justify="right")
        table.add_row("time", f"{wall:.1f} s for {trained} steps" + (
            f" (steps {steps - trained + 1}-{steps}, resumed at step {steps - trained})" if trained < steps else ""))
        table.add_row("throughput", f"{summary['samples_per_s']:,.0f} samples/s")
        table.add_row(self.accuracy_name, "-" if summary["accuracy"] is None else f"{summary['accuracy']:.2%}")
        table.add_row("test loss", "- (no test set)" if summary["test_loss"] is None else f"{summary['test_loss']:.4f}")
        table.add_row("bytes sent per rank", ", ".join(_human(b) for b in summary["bytes_sent_per_rank"]))
        if staleness is not None:
            table.add_row("staleness", f"mean {staleness['mean']:.2f}, max {staleness['max']:.0f} versions over "
                                       f"{staleness['updates']:.0f} shard updates (server version - version pushed on; "
                                       f"a version is one update the server applied)"
                          + (f"; --staleness {c.staleness} bounds steps, each worker's clock, not versions"
                             if c.strategy == "ssp" else ""))
        else:
            table.add_row("overlap share", "-" if summary["overlap"] is None else
                          f"{summary['overlap']:.0%} of bucket all-reduce time ran before backward ended (all ranks)")
        table.add_row("compute / comm / exposed wait",
                      f"{sum(compute):.1f} s / {sum(summary['comm_s']):.1f} s / {sum(summary['wait_s']):.1f} s (all ranks; "
                      f"the wait, from backward's end until its reductions were done, includes waiting for the "
                      f"slowest rank and may exceed comm)")
        if checkpoints is not None:
            table.add_row("checkpoints", f"{checkpoints[0]} written: {checkpoints[1]:.2f} s on the training thread "
                                         f"(snapshots, waits), {checkpoints[2]:.2f} s writing in the background (rank 0)")
        table.add_row("stragglers", ", ".join(f"rank {r} ({compute[r] / median_compute:.2f}x median compute)"
                                              for r in stragglers) or "none")
        self.console.print(table)
        return summary

    def close(self) -> None:
        """After an error: the tracker runs still open are closed, marked as not finished."""
        self.tracking.finish(done=False)
