"""One-shot all-reduce over shared memory, for small messages: one barrier, every rank folds every
input itself (the "direct" all-reduce; its C variant beside it: allreduce_one_shot.c; the bands in
which it runs: docs/studies/direct-or-split.md).

For ranks of one host only, and for messages that fit one staging half (allreduce_two_shot.py picks
it below direct_below, a bound per world size). The split all-reduce there needs two barriers per
piece (staged, reduced) so that each slice is reduced once, by its owner; for a small message the
barriers are the whole cost. Here there is one:

    stage     rank r copies its tensor into its staging half, and its fingerprint into its slot
    barrier   every rank has staged (and published what it is doing)
    check     every rank compares every rank's fingerprint (agree.py, staged): a mismatch raises
              the same error on every rank before any staged byte is read
    fold      rank r computes  x_0 (+) x_1 (+) ... (+) x_{N-1}  in rank order, reading each x_j out of
              rank j's staging half, straight into its own tensor; avg then divides by N. Ranks 0
              and 1 take their own x_r from their tensor instead, where it is still unchanged (it
              is an operand of the first fold, which overwrites it): the same values as the
              staged copy, in the same operand position, so every rank still ends bit-identical

Every rank performs the same operations in the same order on the same values, so every rank ends
bit-identical without a second exchange. No closing barrier: the next collective stages into the
other half, and the one after that into this half again only after its own barrier, which no rank
passes before every rank has finished this fold.

Traffic (what the meter records, as for the split all-reduce: bytes read out of another rank's
memory): rank r reads all M bytes from each of the N-1 others, and by symmetry each reads M from r,

    bytes_received = bytes_sent = (N-1) * M          (the split all-reduce: 2(N-1)/N * M)

Work per rank: N-1 reductions of M bytes against the split all-reduce's (N-1)/N; below
direct_below the barrier saved is worth more (docs/studies/direct-or-split.md). The first two inputs are
folded out of place (reduce_ops.fold), one pass instead of a copy and a reduction. Taking the own
input from the tensor, not the staging half, made the call 5-22% shorter at 64 and 256 KiB at N=2
(docs/studies/direct-or-split.md).
"""

from __future__ import annotations

import torch

from gradsync.observe import stall
from gradsync.comm.agree import FINGERPRINT_BYTES, Fingerprint, compare_published, next_sequence_of
from gradsync.comm.reduce_ops import SUM, Reduction
from gradsync.comm.transport.shm import native

OP = "all_reduce/shared_memory"
AGREE = "all_reduce/agree"


class KeptPlan:
    """What a kept all-reduce plan (OneShotAllReduce, allreduce_two_shot.TwoShotAllReduce) does the same way
    whatever its algorithm: a call through the native core, and a call counted for the meter. Needs
    ``native``, ``fingerprint``, ``nbytes``, ``exchanges``, ``_agreements`` and ``_calls``."""

    def _native_call(self, flat: torch.Tensor, transport, fingerprint: Fingerprint | None) -> None:
        """The whole call as one C call (native/): ``fingerprint`` (None: the plan's, with the next
        sequence number, the stall inspector told) published and compared, the mismatch the core
        finds raised by name, a failed wait breaking the transport."""
        if fingerprint is None:
            fingerprint = self.fingerprint._replace(sequence=next_sequence_of(transport))
            stall.entered(self.fingerprint, fingerprint.sequence)
        if transport.native(self.native.run, flat.data_ptr(), fingerprint.sequence) >= 0:
            compare_published(transport, fingerprint)   # raises the mismatch the core found

    def _count(self, transport) -> None:
        """One call for the meter: its payload and fingerprint bytes (TrafficMeter.tally)."""
        if self._calls is not None:
            self._calls[0] += 1
        else:   # the meter keeps no more counters
            if self.nbytes:
                transport.meter.record_exchanges(self.exchanges, op=OP)
            transport.meter.record_exchanges(self._agreements, op=AGREE, control=True)


class OneShotAllReduce(KeptPlan):
    """The direct all-reduce of one shape (element count, dtype, reduction), made ready once: both
    staging halves' views, the meter's exchanges and the fingerprint's fixed values. collectives.py
    keeps one per small all-reduce a program repeats (``transport.plans``) and runs a repeated call
    with ``run``, which skips the checks, the algorithm choice and the views that its first call
    made; the fingerprint, with the call's own sequence number, is still published and compared on
    every call."""

    def __init__(self, transport, numel: int, dtype: torch.dtype, reduction: Reduction = SUM,
                 spin: bool = False) -> None:
        self.nbytes = numel * dtype.itemsize
        if self.nbytes > transport.stage_bytes:
            raise ValueError(f"{OP}: {self.nbytes} bytes do not fit a {transport.stage_bytes}-byte staging half")
        self.reduction, self.spin = reduction, spin
        self.stages = [transport.staged_views(half, self.nbytes, dtype) for half in (0, 1)]
        self.exchanges = [(other, self.nbytes) for other in range(transport.world_size) if other != transport.rank]
        self.fingerprint = Fingerprint("all_reduce", 0, numel, dtype, reduction.name, "shared_memory")
        kind, _, *rest = self.fingerprint.values()
        self._kind, self._rest = kind, tuple(rest)
        self._hold = transport.hold
        self._calls = transport.meter.tally(self.exchanges, op=OP, control_each=FINGERPRINT_BYTES, control_op=AGREE)
        self._agreements = [(other, FINGERPRINT_BYTES) for other, _ in self.exchanges]
        # the same phases in C (allreduce_one_shot.c, beside this file)
        self.native = native.plan(transport, native.ONE_SHOT, numel, dtype, reduction.name, self.fingerprint, OP, spin,
                                  self._hold is not None)

    def __call__(self, flat: torch.Tensor, transport, fingerprint: Fingerprint | None = None) -> None:
        """All-reduce ``flat`` (this plan's shape, 1-D, contiguous, on the CPU) in place."""
        if self.native is not None and fingerprint is not None:
            self._native_call(flat, transport, fingerprint)
            self._count(transport)
            return
        stages = self.stages[transport.next_half()]
        stages[transport.rank].copy_(flat)
        if fingerprint is not None:
            transport.publish(fingerprint.values())
        transport.barrier(OP, self.spin)
        if fingerprint is not None:
            compare_published(transport, fingerprint)
        if self.nbytes:
            self._fold(flat, stages, transport.rank)
            transport.meter.record_exchanges(self.exchanges, op=OP)

    def run(self, flat: torch.Tensor, transport) -> None:
        """A repeated call, whole: held on the rank's core (as place.py's ``on_own_core`` holds
        a call below HOLD_BELOW_BYTES, which every plan is), the next sequence number, the stall
        inspector told, the fingerprint published with the staged input and compared after the one
        barrier (compare_published raises on a difference), the call counted for the meter (its
        payload and fingerprint bytes: TrafficMeter.tally). The same steps as the first call's, in
        fewer Python operations: between two waits each costs about twice what it costs in a loop
        that repeats it (docs/studies/small-call-cost.md). With the native core, all of that but the
        sequence number, the stall inspector and the meter is one C call."""
        if self.native is not None:
            self._native_call(flat, transport, None)
            self._count(transport)
            return
        holding = self._hold is not None and self._hold.enter()
        try:
            sequence = next_sequence_of(transport)
            stall.entered(self.fingerprint, sequence)
            stages = self.stages[transport.next_half()]
            rank = transport.rank
            stages[rank].copy_(flat)
            transport.publish((self._kind, sequence) + self._rest)
            transport.barrier(OP, self.spin)
            if transport.first_differing(AGREE, metered=False) is not None:
                compare_published(transport, self.fingerprint._replace(sequence=sequence))
            if self.nbytes:
                self._fold(flat, stages, rank)
            self._count(transport)
        finally:
            if holding:
                self._hold.leave()

    def _fold(self, flat: torch.Tensor, stages: list[torch.Tensor], rank: int) -> None:
        # its own input from its tensor where the fold has not yet overwritten it (ranks 0 and 1)
        inputs = [flat if other == rank and rank < 2 else stage for other, stage in enumerate(stages)]
        self.reduction.reduce(flat, inputs, len(stages))


def allreduce_one_shot(flat: torch.Tensor, transport, *, reduction: Reduction = SUM,
                            fingerprint: Fingerprint | None = None, spin: bool = False) -> None:
    """In-place all-reduce of a 1-D contiguous CPU tensor of at most one staging half."""
    OneShotAllReduce(transport, flat.numel(), flat.dtype, reduction, spin)(flat, transport, fingerprint)
