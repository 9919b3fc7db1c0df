"""Two-shot all-reduce over shared memory: each rank stages only what the others need, and keeps its own slice home.

A reduce-scatter then an all-gather through every rank's staging halves, piece by piece; the C
variant beside it (allreduce_two_shot.c) runs the same phases on the same memory. The choice of
band against the one-shot all-reduce, and the region size, are measured in
docs/studies/direct-or-split.md and docs/studies/split-regions.md.

For ranks of one host only (ShmTransport, GRADSYNC_TRANSPORT auto or shm). Point-to-point
algorithms make each byte travel: copied into a ring, copied or added out of it, once per step.
Here each rank copies into its staging area only the slices the others reduce, folds its own slice
where it lies (in its tensor), posts the result beside them, and copies the others' results out of
their areas; no byte is forwarded.

Vocabulary
    N        ranks, all on this host; rank r
    S        bytes in one staging half (GRADSYNC_SHM_STAGE_MB); each rank has two
    region   region j of a half: R bytes from j x R, R = S/N or PIECE_BYTES if less (the in-place
             all-reduce's cache-sized piece; allreduce_in_place.py), rounded down to 64:
             whatever is staged for rank j, or on rank j itself its result, lies at the same place in
             every piece
    piece    a run of at most N x R bytes of the tensor, processed start to end
    slice    slice j of a piece is ring_chunks(piece, N) chunk j; rank j reduces it

Messages below direct_below(transport) take the direct all-reduce instead (allreduce_one_shot.py:
one barrier, every rank folds every input itself): a bound per world size (DIRECT_BELOW_BYTES,
DIRECT_BELOW_BYTES_BY_RANKS), within one staging half. The rest go piece by piece:

Phases, per piece
    stage     rank r copies slice j of its piece into region j of its half, for every j != r (the first
              piece also its fingerprint: the agreement travels with the data, agree.py's staged check)
    barrier   every piece is staged (first piece: every rank compares every rank's fingerprint
              before reading anything)
    reduce    rank r combines region r of every other rank's half into slice r of its own tensor (adds,
              for op sum; float16 and bfloat16 in float32, rounded once: reduce_ops.reduce), own first,
              then the others in rank order: the result is computed once, by its owner, so every rank
              ends bit-identical; avg divides it by N;
              then it posts the result in region r of its own half
    barrier   every slice is reduced and posted
    gather    rank r copies region j of rank j's half into slice j of its tensor, for every j != r

Why two barriers per piece are enough: region j (j != r) of rank r's half is read by rank j alone,
in its reduce, before the piece's second barrier; rank r writes it again only in the next piece's
stage, after that barrier. Region r is read by every other rank in its gather, before it enters
the next piece's first barrier; rank r writes it again only in the next piece's reduce, after that
barrier. Every slice of every piece lies at its region's start (R is a multiple of 64 bytes, so of
every dtype's size), so a short last piece, or a piece of another call, size or dtype, touches no
other region. So the next split all-reduce may use the same half with no barrier in between, and
does (ShmTransport.split_half): one half stays warm in cache. Any other collective that stages
takes the other half (next_half), as a split does after one: their staging lies elsewhere.

Traffic (bytes read out of another rank's memory, which is what the meter records; a divisible
tensor of M bytes): rank r reads slice r from N-1 ranks and slice j from rank j, so
    bytes_received = bytes_sent = 2(N-1)/N * M      (the ring's figure, with no forwarding)
Memory traffic per rank: read + write (N-1)/N * M (stage), read M + write M/N (reduce), read + write
M/N (post), read + write (N-1)/N * M (gather): one copy of the tensor in and out, against two for a
split that stages and gathers whole pieces. Reading the others' tensors where they lie instead,
through the kernel (single_copy.py, as the reduce-scatter does), saves the stage but each kernel copy
costs 2.7x a copy here; that all-reduce (two kernel copies per byte) was slower at every size
measured, 2-64 MiB with 2 ranks and 1-64 MiB with 3 and 4 (docs/studies/staging-or-single-copy.md).
Time: T = ceil(M/(N R)) * (2 barriers + copies of about 2M/ceil(M/(N R)) bytes).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from gradsync.observe import stall
from gradsync.comm.agree import FINGERPRINT_BYTES, Fingerprint, compare_published, next_sequence_of
from gradsync.comm.allreduce_ring import ring_chunks
from gradsync.comm.allreduce_one_shot import KeptPlan, allreduce_one_shot
from gradsync.comm.allreduce_in_place import PIECE_BYTES
from gradsync.comm.reduce_ops import SUM, Reduction
from gradsync.comm.transport import Transport
from gradsync.comm.transport.shm import native

OP = "all_reduce/shared_memory"
AGREE = "all_reduce/agree"

DIRECT_BELOW_BYTES = 256 << 10
"""With four ranks or more, messages smaller than this (and fitting one staging half) take the direct
all-reduce: one barrier against two per piece, worth more than the (N-1) x M it reads up to about
here (the timings: docs/studies/direct-or-split.md)."""

DIRECT_BELOW_BYTES_BY_RANKS = {2: 1 << 20, 3: 512 << 10}
"""With two or three ranks the direct all-reduce takes messages below these: it folds all M bytes on
each rank where the split folds M/N, and it saves a barrier. Both paths take the same bands (so that
they give the same bits), calibrated on the native core, which runs by default (the timings:
docs/studies/direct-or-split.md)."""


def direct_below(transport) -> int:
    """Messages of fewer bytes than this take the direct all-reduce: DIRECT_BELOW_BYTES_BY_RANKS for
    two or three ranks, else DIRECT_BELOW_BYTES, and at most one staging half."""
    below = DIRECT_BELOW_BYTES_BY_RANKS.get(transport.world_size, DIRECT_BELOW_BYTES)
    return min(below, transport.stage_bytes + 1)


def layout_error(transport: Transport) -> str | None:
    """None when the shared-memory all-reduce can run on ``transport``, else why not."""
    if not transport.shares_memory:
        return ("the shared-memory all-reduce needs every rank on this host and the shared-memory transport "
                "(GRADSYNC_TRANSPORT=auto or shm)")
    return None


def _region_elems(transport, dtype: torch.dtype) -> int:
    """Elements in one region of a staging half: S/N bytes or PIECE_BYTES if less, rounded down to 64
    (a multiple of every dtype's size, so regions lie at the same bytes whatever the dtype). Capped so
    each piece's phases find what the phase before wrote still in cache (the in-place all-reduce's
    pieces, allreduce_in_place.py, have the same size): 10-20% faster than S/N from 4 MiB up at
    N=2..4 (the table: docs/studies/split-regions.md)."""
    region_bytes = min(transport.stage_bytes // transport.world_size, PIECE_BYTES) // 64 * 64
    if region_bytes == 0:
        raise RuntimeError(f"all_reduce: staging halves of {transport.stage_bytes} bytes are too small for "
                           f"{transport.world_size} ranks (at least 64 bytes each); set GRADSYNC_SHM_STAGE_MB "
                           f"to at least {64 * transport.world_size / (1 << 20):.6f}")
    return region_bytes // dtype.itemsize


class _Piece(NamedTuple):
    """The staging views one piece length uses on one half, this rank's side."""
    stage: list[torch.Tensor]     # region j of this rank's half, for each other rank j in rank order
    theirs: list[torch.Tensor]    # region r (this rank's) of each other rank's half, in rank order
    post: torch.Tensor            # region r of this rank's half: its reduced slice, for the others
    results: list[torch.Tensor]   # region j of each other rank j's half: j's reduced slice


class TwoShotAllReduce(KeptPlan):
    """The split all-reduce of one shape (element count, dtype, reduction), made ready once: every
    piece's chunk sizes (one ``flat.split`` per call cuts every slice of every piece) and, for each
    staging half, the region views of a whole piece and of a short last one, the meter's exchanges
    and the fingerprint's fixed values. allreduce_two_shot() makes one for a call; collectives.py keeps
    one per large all-reduce a program repeats (``transport.plans``) and runs a repeated call with
    ``run``, as allreduce_one_shot.OneShotAllReduce does: a 4 MiB call at N=2 spent 60-80 of its
    600 us making views and choosing (docs/studies/staging-or-single-copy.md)."""

    def __init__(self, transport, numel: int, dtype: torch.dtype, reduction: Reduction = SUM,
                 spin: bool = False, hold=None) -> None:
        n_ranks, rank = transport.world_size, transport.rank
        region = _region_elems(transport, dtype)
        self.nbytes = numel * dtype.itemsize
        self.reduction, self.spin, self._hold = reduction, spin, hold
        self.n_ranks, self.rank = n_ranks, rank
        self.others = [other for other in range(n_ranks) if other != rank]
        pieces = [ring_chunks(min(n_ranks * region, numel - start), n_ranks).sizes
                  for start in range(0, numel, n_ranks * region)]
        self.split_sizes = [size for sizes in pieces for size in sizes]
        halves = [transport.staged_views(half, n_ranks * region * dtype.itemsize, dtype) for half in (0, 1)]
        self.layouts = [[self._views(staged, sizes, region) for sizes in pieces[-2:]] for staged in halves]
        self.last = len(pieces) - 1   # the piece that takes layouts[half][-1]; every other takes [0]
        # bytes this rank reads out of each other rank's staging; by symmetry, also what that rank reads out
        # of ours (region r of theirs and region j of ours, against region j of ours and region r of theirs)
        self.exchanges = [(other, sum(sizes[rank] + sizes[other] for sizes in pieces) * dtype.itemsize)
                          for other in self.others]
        self.fingerprint = Fingerprint("all_reduce", 0, numel, dtype, reduction.name, "shared_memory")
        kind, _, *rest = self.fingerprint.values()
        self._kind, self._rest = kind, tuple(rest)
        self._calls = transport.meter.tally(self.exchanges, op=OP, control_each=FINGERPRINT_BYTES, control_op=AGREE)
        self._agreements = [(other, FINGERPRINT_BYTES) for other in self.others]
        self.native = native.plan(transport, native.TWO_SHOT, numel, dtype, reduction.name, self.fingerprint, OP, spin,
                                  hold is not None, region * dtype.itemsize)   # allreduce_two_shot.c, beside this file

    def _views(self, staged: list[torch.Tensor], sizes: list[int], region: int) -> _Piece:
        rank = self.rank
        return _Piece(stage=[staged[rank].narrow(0, j * region, sizes[j]) for j in self.others],
                      theirs=[staged[j].narrow(0, rank * region, sizes[rank]) for j in self.others],
                      post=staged[rank].narrow(0, rank * region, sizes[rank]),
                      results=[staged[j].narrow(0, j * region, sizes[j]) for j in self.others])

    def __call__(self, flat: torch.Tensor, transport, fingerprint: Fingerprint | None = None) -> None:
        """All-reduce ``flat`` (this plan's shape, 1-D, contiguous, on the CPU) in place; ``fingerprint``:
        agree on it with the first piece, every difference metered and raised (agree.compare_published)."""
        if self.native is not None and fingerprint is not None:
            self._native_call(flat, transport, fingerprint)
            self._count(transport)
            return
        self._pieces(flat, transport, None if fingerprint is None else fingerprint.values(), fingerprint)
        transport.meter.record_exchanges(self.exchanges, op=OP)

    def run(self, flat: torch.Tensor, transport) -> None:
        """A repeated call, whole, as OneShotAllReduce.run: held where the plan was given a hold, the next
        sequence number, the stall inspector told, the fingerprint published with the first piece and
        compared after its first barrier, the call counted for the meter (with the native core, the
        pieces are one C call, which holds the thread itself)."""
        if self.native is not None:
            self._native_call(flat, transport, None)
            self._count(transport)
            return
        holding = self._hold is not None and self._hold.enter()
        try:
            sequence = next_sequence_of(transport)
            stall.entered(self.fingerprint, sequence)
            self._pieces(flat, transport, (self._kind, sequence) + self._rest, None)
            self._count(transport)
        finally:
            if holding:
                self._hold.leave()

    def _pieces(self, flat: torch.Tensor, transport, published, fingerprint) -> None:
        """The pieces, the first with ``published`` (a fingerprint's values, or None: no agreement);
        ``fingerprint``: compare it, metered, or with None look at the published bytes first and
        compare (rebuilt from ``published``) only where they differ."""
        n_ranks, rank, reduction = self.n_ranks, self.rank, self.reduction
        # every rank polls on the main thread; elsewhere as the plan was told (place.spins)
        spin = self.spin or threading.current_thread() is threading.main_thread()
        layouts, last = self.layouts[transport.split_half()], self.last
        slices = flat.split(self.split_sizes)
        for index in range(last + 1):
            views = layouts[-1] if index == last else layouts[0]
            chunks = slices[index * n_ranks:(index + 1) * n_ranks]
            mine = [chunks[other] for other in self.others]
            # stage
            for region, chunk in zip(views.stage, mine):
                region.copy_(chunk)
            if index == 0 and published is not None:
                transport.publish(published)
            transport.barrier(OP, spin)
            if index == 0 and published is not None:
                if fingerprint is not None:
                    compare_published(transport, fingerprint)
                elif transport.first_differing(AGREE, metered=False) is not None:
                    compare_published(transport, self.fingerprint._replace(sequence=published[1]))
            # reduce, then post
            own = chunks[rank]
            reduction.reduce(own, [own, *views.theirs], n_ranks)
            views.post.copy_(own)
            transport.barrier(OP, spin)
            # gather
            for chunk, region in zip(mine, views.results):
                chunk.copy_(region)


def allreduce_two_shot(flat: torch.Tensor, transport, *, reduction: Reduction = SUM,
                     fingerprint: Fingerprint | None = None, spin: bool = False) -> None:
    """In-place all-reduce of a 1-D contiguous CPU tensor through the ranks' staging halves (direct
    below direct_below, else split); ``fingerprint``: agree on it with the first piece; ``spin``:
    barriers may spin (waiting.py)."""
    if transport.world_size == 1:
        return
    if flat.numel() * flat.element_size() < direct_below(transport):
        allreduce_one_shot(flat, transport, reduction=reduction, fingerprint=fingerprint, spin=spin)
        return
    TwoShotAllReduce(transport, flat.numel(), flat.dtype, reduction, spin)(flat, transport, fingerprint)
