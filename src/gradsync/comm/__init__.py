"""Collectives over a Transport, one algorithm per file (as gloo keeps them), and the transports below them.

The algorithms, over any Transport:
    allreduce_ring.py, allreduce_halving_doubling.py, allreduce_tree.py, allreduce_naive.py,
    allreduce_hierarchical.py, reduce_scatter_direct.py, broadcast.py, rooted.py
The algorithms that read the other ranks' memory (every rank on one host, Transport.shares_memory),
each with its C variant beside it under the same name (built into the native core, setup.py):
    allreduce_one_shot.py (.c)      one barrier, every rank folds every input (small messages)
    allreduce_two_shot.py (.c)      reduce-scatter then all-gather through the staging halves
    allreduce_in_place.py (.c)      the same two phases on tensors in a shared region
    reduce_scatter_staged.py (.c), reduce_scatter_in_place.py (.c), reduce_scatter_single_copy.py
    all_gather_staged.py, all_gather_in_place.py (.c), all_gather_single_copy.py
What they share:
    reduce_ops.py       what "reduce" means (sum, avg, max, ...); scratch.py: reused receive buffers
    agree.py            the fingerprint every rank compares before a collective
    context.py          CommContext: a communicator's own state (sequence numbers, kept plans, host staging)
    select.py           algorithm="auto": the cost model's pick; place.py: holding and polling
    host_staging.py     CUDA tensors through host memory; cuda_runtime.py: the CUDA calls it makes
    collectives.py      the public collectives: checks, agreement, then one algorithm file

The transports (transport/, as gloo's transport/), which import nothing from here:
    transport/__init__.py           the Transport interface: point-to-point, and everything else a
                                    transport may offer, declared with defaults; imports no implementation
    transport/torch_distributed.py  TorchTransport: torch.distributed point-to-point (gloo on CPU, NCCL on GPU)
    transport/shm/                  ShmTransport: shared memory between ranks of one host (segments,
                                    staging halves, progress, waits, doorbells, regions, the native core's
                                    signalling; transport/shm/__init__.py lists them)

Above both:
    world_transport.py  which transport a world gets (GRADSYNC_TRANSPORT), made at init() with its
                        context, and the few facts about it that code outside comm/ may ask (the public surface)
"""
