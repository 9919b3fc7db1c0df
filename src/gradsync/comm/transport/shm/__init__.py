"""The shared-memory transport between ranks of one host, and its intra-host algorithms.

The transport (ShmTransport), assembled from its parts:
    transport.py        posting sends and receives; the state the parts share
    segment.py          each rank's shared segment: layout, set-up, clean-up
    staging.py          fingerprint slots and staging halves (what the algorithms below read)
    progress.py         moving sends and receives through the rings
    waiting.py          sleeping on the doorbell, barriers, liveness and timeouts
and its machinery: ring.py (one ordered pair's byte ring), doorbell.py (futex sleep and wake),
hold.py (a collective's thread on its rank's core), regions.py (tensors every local rank can
read), single_copy.py (reads out of another process's memory).

The algorithms that only make sense on it, each reading the other ranks' memory directly:
    allreduce_two_shot.py, allreduce_one_shot.py, allreduce_in_place.py
    reduce_scatter_staged.py, reduce_scatter_single_copy.py, reduce_scatter_in_place.py
    all_gather_staged.py, all_gather_single_copy.py, all_gather_in_place.py
"""
