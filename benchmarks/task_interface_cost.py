"""What gradsync train's task interface and strategy object cost a step, beside the same step written inline.

One rank (a world of one: --strategy local, so no communication blurs it), the digits CNN at batch 32 (the
main job's model and batch): a step through the loop's own path -- the strategy object's run_step, which
sets the lr, zeroes the gradients, has StepWork choose the step's samples (EpochCursor's share, the
micro-batch weights), fetch them through the task (Task.batch) and run forward and backward through the loss
rule (LossRule), then steps and commits -- against the same step inline: the samples sliced from the
TensorDataset's tensors, torch's cross_entropy, backward, the optimizer. The two alternate step by step on
the same model and optimizer (one intra-op thread); the table gives the medians and their difference as a
share of the inline step.

    python benchmarks/task_interface_cost.py [--steps 400] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import gradsync as gs


def _rank(steps: int, out: str) -> tuple[list[float], list[float]]:
    from gradsync.train.config import TrainConfig
    from gradsync.train.loop import Run
    from gradsync.train.preempt import PreemptWatch
    from gradsync.train.step import StepWork, share_scale

    torch.set_num_threads(1)
    cfg = TrainConfig(strategy="local", workers=1, steps=10 * steps, out=out, quiet=True, preempt_signal="none")
    with PreemptWatch("none") as watch:
        run = Run(cfg, watch)
    strategy, work = run.strategy, StepWork(run)
    x_all, y_all = run.data.train.tensors
    model, optimizer = run.model, strategy.optimizer

    def inline(step: int) -> None:
        position = step % run.steps_per_epoch * run.plan.global_batch
        order = run.cursor.order(0)
        ids = order[position:position + run.cursor.step_size(position)]
        for group in optimizer.param_groups:
            group["lr"] = run.plan.peak_lr
        optimizer.zero_grad(set_to_none=False)
        index = torch.tensor(ids)
        weight = len(ids) * share_scale("step", 1, 1, len(ids), len(ids))
        (torch.nn.functional.cross_entropy(model(x_all[index]), y_all[index]) * weight).backward()
        optimizer.step()

    interface, plain = [], []
    for step in range(steps):
        started = time.perf_counter()
        strategy.run_step(work, stop=False)
        interface.append(time.perf_counter() - started)
        started = time.perf_counter()
        inline(step)
        plain.append(time.perf_counter() - started)
    work.close()
    return interface[10:], plain[10:]   # the first steps warm the allocator and autograd up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as out:
            interface, plain = gs.spawn(_rank, nprocs=1, args=(args.steps, out))[0]
        rows.append((statistics.median(interface), statistics.median(plain)))
    print(f"digits CNN, batch 32, one rank, {args.steps} steps a round, medians:")
    print(f"{'round':>5} {'through the interface (ms)':>27} {'inline (ms)':>12} {'cost':>8}")
    for index, (through, inline) in enumerate(rows):
        print(f"{index:>5} {through * 1e3:>27.3f} {inline * 1e3:>12.3f} {(through - inline) / inline:>8.2%}")
    costs = [(through - inline) / inline for through, inline in rows]
    print(f"median cost over {args.rounds} rounds: {statistics.median(costs):.2%} of the inline step")


if __name__ == "__main__":
    main()
