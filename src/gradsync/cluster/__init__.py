"""An emulated cluster on one machine: hosts as network namespaces on a bridge, links shaped to a rate.

    netns.py     EmulatedCluster: build the hosts and links, read their kernel counters, delete it all
    jobs.py      Job + run_job: one torchrun per host running worker.py, results back
    worker.py    one rank: train, time, count bytes (meter and kernel counters)
    results.py   ranks' results -> one row per job: step time, per-link bytes beside the formulas
    sweep.py     `gradsync cluster`: jobs over strategies x W x link rates, the cost model beside them
    figure.py    measured and predicted step time vs W, per link rate
    loss_worker.py, time_to_loss.py   --time-to-loss: charlm to ring DDP's loss, rows, figure

The command's flags and tables live in cli/cluster.py and cli/cluster_tables.py; this package measures
and returns rows (and draws the figures of them).
"""
