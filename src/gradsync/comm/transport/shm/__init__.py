"""The shared-memory transport between ranks of one host: ShmTransport and its machinery.

The transport (ShmTransport, transport.py) owns its parts as objects:
    segment.py          Segments: each rank's shared segment (layout, set-up, clean-up)
    staging.py          Staging: fingerprint slots and staging halves (what the intra-host algorithms read)
    progress.py         Progress: the sends and receives in flight, moved through the rings
    waiting.py          Waits: sleeping on the doorbell, barriers, liveness and timeouts
and its machinery: ring.py (one ordered pair's byte ring), doorbell.py (futex sleep and wake),
hold.py (a collective's thread on its rank's core), regions.py (tensors every local rank can
read), single_copy.py (reads out of another process's memory), native/ (the native core: its
doorbells, barriers, fingerprint slots, hold and reductions in C, and the extension module).

The algorithms that run on it (comm/allreduce_one_shot.py and its kin) live above, with the others.
"""
