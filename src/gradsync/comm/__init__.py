"""Collectives over a Transport, one algorithm per file (as gloo keeps them), and the transports.

    transport.py        the Transport interface (isend / irecv / wait); imports no implementation
    tcp.py              TorchTransport: torch.distributed point-to-point (between hosts, or everywhere)
    shm/                the shared-memory transport between ranks of one host, and the intra-host
                        algorithms that only make sense on it (shm/__init__.py lists them)
    world_transport.py  which transport a world gets (GRADSYNC_TRANSPORT), made at init()

    allreduce_ring.py, allreduce_halving_doubling.py, allreduce_tree.py, allreduce_naive.py,
    allreduce_hierarchical.py, broadcast.py, rooted.py
                        the algorithms over any Transport
    reduce_ops.py       what "reduce" means (sum, avg, max, ...); scratch.py: reused receive buffers
    agree.py            the fingerprint every rank compares before a collective
    select.py           algorithm="auto": the cost model's pick
    collectives.py      the public collectives: checks, agreement, then one algorithm file
"""
