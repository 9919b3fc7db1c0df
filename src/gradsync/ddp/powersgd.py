"""PowerSGD: each bucket's gradient matrices sent as rank-r factors, with error feedback.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019: one step of subspace (power) iteration per training step, warm-started
from the last step's Q, so a rank-r approximation of the averaged gradient costs two all-reduces of
thin matrices instead of one of the whole gradient.

    model = gs.DistributedDataParallel(module, comm_hook="powersgd")           # rank 2
    model.register_comm_hook(PowerSGDState(rank=4, start_iter=10), powersgd_hook)

Vocabulary
    N          replicas;  r  the approximation rank (``rank``)
    M          one gradient viewed as a matrix: n = its first dimension, m = the product of the rest
    compressed M is compressed when (n + m) r * min_compression_rate < n m (a matrix whose factors
               would not be smaller is sent whole: biases, norms, small layers)
    P, Q       n x r and m x r factors; every bucket keeps its Ps and Qs back to back in one buffer
               each, so each phase is one all-reduce per bucket
    error      e_i, what rank i's last compressed gradient left out; it is added back first

One step, per bucket (once ``start_iter`` steps have been averaged plainly, as torch's
start_powerSGD_iter: the first steps' gradients change fastest, and error feedback needs a start):
    1. M_i += e_i (error feedback); keep a copy of the bucket (in e_i's own buffer: no new memory)
    2. P = M_i Q for each compressed M (Q: the last step's, orthonormalized; the first time random,
       seeded alike on every rank)
    3. one all-reduce (sum) of P and the uncompressed tensors, back to back in one buffer; the
       uncompressed part divided by N; orthonormalize P's columns
    4. Q = M_i^T P; all-reduce Q (sum), divide by N
    5. M <- P Q^T: the rank-r approximation of the average, written into the gradients
    6. e_i = (the copy of step 1) - (the bucket now)
Orthonormalization: Gram-Schmidt for r <= 2 (and half precision), QR above: torch's powerSGD_hook
makes the same choices, and every step above is its arithmetic, so the two agree (tested, float64).
torch's hook all-reduces the uncompressed tensors and P separately; here they share one all-reduce
(each element is still the sum of the same N values, though from N = 3 the ring may add them in
another order: equal within rounding), so a compressed step is two all-reduces per bucket, not
three. On a slow CPU or link each all-reduce costs 2(N-1) message latencies whatever its size, and
P's and the uncompressed tensors' are both small: see docs/studies/slow-links.md for the
measurement behind this.

Traffic per bucket and step, with the all-reduce's own factor (ring: 2(N-1)/N bytes sent per byte):
    (sum over compressed M of (n + m) r  +  uncompressed elements) x element size
against the whole bucket's n m elements uncompressed (``PowerSGDState.elements``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gradsync.ddp.replica_group import ReplicaGroup


@dataclass
class PowerSGDState:
    """The hook's settings and what it keeps between steps (per bucket index)."""

    rank: int = 2
    """r, the approximation rank: each compressed matrix travels as n x r and m x r factors."""
    start_iter: int = 10
    """Steps averaged plainly before compression starts (>= 2 with error feedback or warm start)."""
    min_compression_rate: float = 2.0
    """A matrix is compressed only if its factors are this many times smaller than it."""
    error_feedback: bool = True
    """Add what the last compression left out back into the next gradient."""
    warm_start: bool = True
    """Start each step's power iteration from the last step's Q (else a fresh random Q)."""
    epsilon: float = 0.0
    """Added to each column's norm in Gram-Schmidt (0: exact; a small value guards zero columns)."""
    seed: int = 0
    """Seed of the generator that seeds the random Qs, the same on every rank."""
    group: ReplicaGroup | None = None
    """Where the all-reduces run (None: gradsync's world; the wrapper sets its own)."""
    algorithm: str = "auto"
    """gradsync's all-reduce algorithm."""
    iteration: int = 0
    """Backward passes reduced so far (counted at each backward's last bucket)."""
    elements: list[int] = field(default_factory=lambda: [0, 0])
    """[elements before compression, elements sent] over every compressed step, for the ratio."""
    errors: dict[int, torch.Tensor] = field(default_factory=dict)
    ps: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per bucket: the uncompressed tensors' elements, then every P (n x r), in one buffer."""
    qs: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"PowerSGD rank must be an integer >= 1, got {self.rank!r}")
        if not isinstance(self.start_iter, int) or self.start_iter < 0:
            raise ValueError(f"PowerSGD start_iter must be an integer >= 0, got {self.start_iter!r}")
        if (self.error_feedback or self.warm_start) and self.start_iter < 2:
            raise ValueError(f"PowerSGD start_iter={self.start_iter}: with error feedback or warm start it must be "
                             f">= 2 (the first backward's buckets are rebuilt, so buckets settle only after it)")
        if not self.min_compression_rate > 0:
            raise ValueError(f"PowerSGD min_compression_rate must be > 0, got {self.min_compression_rate!r}")
        self._seeds = np.random.RandomState(self.seed)

    def check_rank_fits(self, params: list[torch.Tensor]) -> None:
        """ValueError when r exceeds the smallest side of every matrix it could compress: nothing would
        ever be compressed, which is never what a program asking for rank r meant."""
        sides = [min(p.shape[0], p[0].numel()) for p in params if p.dim() > 1]
        if sides and self.rank > max(sides):
            raise ValueError(f"PowerSGD rank {self.rank} exceeds every gradient matrix's smaller side "
                             f"(the largest is {max(sides)}): choose a rank between 1 and {max(sides)}")


def orthonormalize(matrix: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of ``matrix`` (n x r) orthonormal, in place: Gram-Schmidt for r <= 2 or half
    precision, QR otherwise (the choice torch's PowerSGD makes)."""
    rank = matrix.shape[1]
    if rank <= 2 or matrix.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            column = matrix[:, i:i + 1]
            column /= torch.norm(column, dim=0, keepdim=True) + epsilon
            if i + 1 < rank:
                rest = matrix[:, i + 1:]
                rest -= torch.sum(column * rest, dim=0, keepdim=True) * column
    else:
        matrix.copy_(torch.linalg.qr(matrix).Q)


@dataclass
class _Plan:
    """One bucket's split into compressed matrices and uncompressed tensors, with factor views."""

    matrices: list[torch.Tensor]
    uncompressed: list[torch.Tensor]
    flat_uncompressed: torch.Tensor
    """The head of the P buffer: where the uncompressed tensors travel."""
    ps: list[torch.Tensor]
    qs: list[torch.Tensor]
    fresh: bool


def _plan(state: PowerSGDState, bucket) -> _Plan:
    index = bucket.index()
    buffer = bucket.buffer()
    matrices, uncompressed, shapes = [], [], []
    for gradient in bucket.gradients():
        matrix = gradient.view(gradient.shape[0], -1) if gradient.dim() > 0 else gradient.view(1, 1)
        n, m = matrix.shape
        rank = min(n, m, state.rank)
        if gradient.dim() > 1 and (n + m) * rank * state.min_compression_rate < n * m:
            matrices.append(matrix)
            shapes.append((n, m, rank))
            state.elements[1] += (n + m) * rank
        else:
            uncompressed.append(gradient)
            state.elements[1] += n * m
        state.elements[0] += n * m
    fresh = not state.warm_start or index not in state.ps
    uncompressed_elements = sum(t.numel() for t in uncompressed)
    if fresh:
        state.ps[index] = buffer.new_empty(uncompressed_elements + sum(n * r for n, _, r in shapes))
        state.qs[index] = buffer.new_empty(sum(m * r for _, m, r in shapes))
    ps, qs, p_at, q_at = [], [], uncompressed_elements, 0
    for n, m, rank in shapes:
        ps.append(state.ps[index][p_at:p_at + n * rank].view(n, rank))
        qs.append(state.qs[index][q_at:q_at + m * rank].view(m, rank))
        p_at, q_at = p_at + n * rank, q_at + m * rank
    return _Plan(matrices, uncompressed, state.ps[index][:uncompressed_elements], ps, qs, fresh)


def _done(value: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


def powersgd_hook(state: PowerSGDState, bucket) -> torch.futures.Future:
    """The hook (torch's contract, ddp/hooks.py): the bucket's averaged gradient, compressed once
    ``state.start_iter`` backward passes are done; see the module docstring."""
    group = state.group if state.group is not None else ReplicaGroup.of(None)
    buffer = bucket.buffer()
    if state.iteration < state.start_iter:
        buffer.div_(group.size)   # then the sum: torch's allreduce_hook, which PowerSGD runs first
        group.all_reduce(buffer, op="sum", algorithm=state.algorithm)
        state.iteration += bucket.is_last()
        return _done(buffer)
    index = bucket.index()
    if state.error_feedback:
        error = state.errors.get(index)
        if error is None:
            error = state.errors[index] = torch.empty_like(buffer)
        else:
            buffer.add_(error)
        error.copy_(buffer)   # the copy of step 1, in the error's buffer (step 6 subtracts in place)
    plan = _plan(state, bucket)
    if plan.fresh:   # seeded alike on every rank: every rank starts from the same Q
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state._seeds.randint(1_000_000_000))
            for q in plan.qs:
                q.copy_(torch.randn(*q.shape, dtype=q.dtype))
                orthonormalize(q, state.epsilon)
    else:
        for q in plan.qs:
            orthonormalize(q, state.epsilon)
    # 2. P = M Q
    for matrix, q, p in zip(plan.matrices, plan.qs, plan.ps):
        torch.matmul(matrix, q, out=p)
    # 3. the uncompressed tensors and P: one all-reduce (sum); the tensors averaged, P orthonormalized
    offset = 0
    for tensor in plan.uncompressed:
        plan.flat_uncompressed[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
        offset += tensor.numel()
    group.all_reduce(state.ps[index], op="sum", algorithm=state.algorithm)
    plan.flat_uncompressed.div_(group.size)
    offset = 0
    for tensor in plan.uncompressed:
        tensor.copy_(plan.flat_uncompressed[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    for p in plan.ps:
        orthonormalize(p, state.epsilon)
    # 4. Q = M^T P, averaged
    for matrix, p, q in zip(plan.matrices, plan.ps, plan.qs):
        torch.matmul(matrix.t(), p, out=q)
    group.all_reduce(state.qs[index], op="sum", algorithm=state.algorithm).div_(group.size)
    # 5. the approximation, into the gradients
    for p, q, matrix in zip(plan.ps, plan.qs, plan.matrices):
        torch.matmul(p, q.t(), out=matrix)
    # 6. what it left out
    if state.error_feedback:
        error.sub_(buffer)
    if not state.warm_start:
        state.ps.clear()
        state.qs.clear()
    state.iteration += bucket.is_last()
    return _done(buffer)


def bytes_per_step(params: list[torch.Tensor], rank: int, min_compression_rate: float = 2.0) -> tuple[int, int]:
    """(elements a compressed step all-reduces, elements of the whole gradient) for these
    parameters, however they are bucketed: the sum of (n + m) min(n, m, r) over the compressed
    matrices plus the other elements, against the sum of every n m."""
    sent = whole = 0
    for p in params:
        n = p.shape[0] if p.dim() > 0 else 1
        m = p.numel() // n if n else 0
        r = min(n, m, rank)
        whole += n * m
        sent += (n + m) * r if p.dim() > 1 and (n + m) * r * min_compression_rate < n * m else n * m
    return sent, whole
