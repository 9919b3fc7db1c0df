"""GradientWatch: which gradients the program changed in place after autograd last wrote them.

ShardedOptimizer averages gradients across ranks inside step() (or clip_grad_norm_), so until then
each .grad holds this rank's local gradient. A program written for torch DDP, where .grad is already
the average after backward, may change it there: torch.nn.utils.clip_grad_norm_ then clips each
rank's own gradient by its own norm, a different update from one process or torch DDP, silently.
This watch makes that visible.

How: a post-accumulate-grad hook on every parameter records (the gradient's data pointer, its
version counter) right after autograd accumulated into it. Every in-place operation bumps a
tensor's version counter (torch's clip_grad_norm_ multiplies every gradient in place, even by 1.0;
clip_grad_value_ clamps; p.grad.div_(k) scales), and views of one storage share one counter, so the
gradients are grouped by storage and the newest record of a group is compared with the counter now.
A counter that moved past it means a change after the last backward.

Not seen: a change through ``.data`` (it bumps no counter), a change between two backward passes of
one step (the later record covers it), a .grad replaced by another tensor or set by hand (nothing
recorded to compare with).
"""

from __future__ import annotations

import weakref

import torch


class GradientWatch:
    """Records what backward left in each ``params[i].grad``; ``changed()`` names those changed since."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.records: dict[int, tuple[int, int]] = {}   # param index -> (grad data_ptr, grad._version)
        me = weakref.ref(self)   # the parameters outlive an optimizer; their hooks must not keep it alive

        def record(index: int, param: torch.Tensor) -> None:
            watch = me()
            if watch is not None and param.grad is not None:
                watch.records[index] = (param.grad.data_ptr(), param.grad._version)

        handles = [p.register_post_accumulate_grad_hook(lambda param, index=i: record(index, param))
                   for i, p in enumerate(params)]
        weakref.finalize(self, lambda: [handle.remove() for handle in handles])

    def forget(self) -> None:
        """Start over (the gradients were consumed; the next backward records afresh)."""
        self.records.clear()

    def changed(self) -> list[int]:
        """Indices of parameters whose gradient changed in place after backward last wrote it."""
        newest: dict[int, int] = {}   # storage pointer -> newest version recorded in it
        watched: list[tuple[int, int]] = []
        for index, param in enumerate(self.params):
            grad, record = param.grad, self.records.get(index)
            if grad is None or record is None or record[0] != grad.data_ptr():
                continue   # no backward since the last forget(), or .grad was replaced: nothing to compare
            storage = grad.untyped_storage().data_ptr()
            newest[storage] = max(newest.get(storage, -1), record[1])
            watched.append((index, storage))
        return [index for index, storage in watched if self.params[index].grad._version > newest[storage]]
