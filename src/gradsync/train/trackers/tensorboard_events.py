"""--log tensorboard: event files in RUN_DIR/tensorboard/, written with torch's SummaryWriter; one
directory is one TensorBoard run, so a resume writes its events beside the first attempt's and
TensorBoard shows one curve (`tensorboard --logdir RUN_DIR/tensorboard`).

A resume opens the writer with purge_step = the checkpoint's step + 1: TensorBoard's own readers drop
whatever an earlier attempt recorded after the checkpoint (a crash between a checkpoint and the next),
so no step is shown twice. Each record is flushed at once: a reporting rank that dies (live mode)
leaves on disk every step it recorded.
"""

from __future__ import annotations

from gradsync.train.trackers.base import Tracker

LOG_DIR = "tensorboard"


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, run_dir, run_key, purge_after) -> None:
        super().__init__(run_dir, run_key, purge_after)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.run_dir / LOG_DIR),
                                    purge_step=None if purge_after is None else purge_after + 1)

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def finish(self, done: bool) -> None:
        self.writer.close()
