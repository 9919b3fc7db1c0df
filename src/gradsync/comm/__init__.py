"""Collectives over a Transport, one algorithm per file (as gloo keeps them), and the transports below them.

The algorithms, over any Transport:
    allreduce_ring.py, allreduce_halving_doubling.py, allreduce_tree.py, allreduce_naive.py,
    allreduce_hierarchical.py, broadcast.py, rooted.py
    reduce_ops.py       what "reduce" means (sum, avg, max, ...); scratch.py: reused receive buffers
    agree.py            the fingerprint every rank compares before a collective
    select.py           algorithm="auto": the cost model's pick
    collectives.py      the public collectives: checks, agreement, then one algorithm file

The transports (transport/, as gloo's transport/):
    transport/__init__.py   the Transport interface (isend / irecv / wait); imports no implementation
    transport/torch_distributed.py        TorchTransport: torch.distributed point-to-point (between hosts, or everywhere)
    transport/shm/          the shared-memory transport between ranks of one host, the intra-host
                            algorithms that only make sense on it, and their native core
                            (transport/shm/__init__.py lists them)

Above both:
    world_transport.py  which transport a world gets (GRADSYNC_TRANSPORT), made at init(), and the
                        few facts about it that code outside comm/ may ask (the public surface)
"""
