"""Network partitions in live mode, timed: the numbers of docs/reliability.md's partition table.

    sudo PYTHONPATH=src python benchmarks/partitions.py [trials] [scenario ...]

Three emulated hosts (tests/test_partition.py's Job: one `torchrun --nnodes 3 --nproc-per-node 1 -m
gradsync.train --fault-tolerance live` per network namespace, the store in host 0's agent, the digits
CNN), and per trial one scenario, once 5 steps were trained:

    cut10    host 2's switch port down for good, --timeout 10
    cut60    the same with the default --timeout (60 s)
    heal     host 2 cut for 5 s, then its port up again, --timeout 12
    store    host 0 (the store's) cut for good, --timeout 10
    links    host 2's link through a delay line: 200 ms each way for 20 s, then 10% of frames lost each
             way for 20 s (tests/delay_line.py), the default timeout

Each trial prints one JSON line; then the medians per scenario. Times are from the cut (the port set
down, time.time()): caught_s, when the survivors caught the failure (the live event's time less its
recovery), rebuilt_s, when their new world was made; cut_worker_exit_s and worker<h>_exit_s, when a
cut-off worker exited (its agent's log); back_after_heal_s, from the heal to the world of 3 again;
barrier_s, how long each surviving agent waited in torchrun's exit barrier.
"""

from __future__ import annotations

import datetime
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tests import delay_line, live_fns  # noqa: E402
from tests import test_partition as partition  # noqa: E402

SCENARIOS = ("cut10", "cut60", "heal", "store", "links")
TIMEOUTS = {"cut10": 10, "cut60": 60, "heal": 12, "store": 10, "links": 60}
EPOCHS = 8


def _worker_exit(job, host: int) -> float | None:
    """When host's worker exited, from its agent's log ("E1206 04:04:28.716000 ... failed (exitcode: 69)")."""
    found = re.search(r"E(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*failed \(exitcode: -?\d+\)", job.agent_log(host))
    if found is None:
        return None
    year = datetime.datetime.now().year
    return datetime.datetime.strptime(f"{year}{found.group(1)} {found.group(2)}", "%Y%m%d %H:%M:%S.%f").timestamp()


def trial(scenario: str) -> dict:
    from gradsync.train.datasets import digits

    samples = list(range(len(digits(0)[0])))
    out = Path(tempfile.mkdtemp(prefix=f"gradsync-partitions-{scenario}-"))
    epochs = 20 if scenario == "store" else EPOCHS
    with partition._cluster(3) as cluster:
        line = delay_line.start(cluster, 2) if scenario == "links" else None
        job = partition.Job(cluster, out, ["--timeout", str(TIMEOUTS[scenario]), "--epochs", str(epochs)])
        try:
            job.wait_for_steps(5)
            if scenario == "links":
                for delay_ms, loss in ((200, 0.0), (0, 0.1)):
                    delay_line.set_line(line, delay_ms, loss)
                    time.sleep(20)
                delay_line.set_line(line, 0, 0.0)
                cut = time.time()
            else:
                cut = job.port(0 if scenario == "store" else 2, "down")
                if scenario == "heal":
                    time.sleep(5)
                    healed = job.port(2, "up")
            ended = job.wait_all(300)
        finally:
            job.stop()
            if line is not None:
                delay_line.stop(line)
    events = [r for r in job.records() if r["event"] == "live"]
    result = {"scenario": scenario, "exit_status": [job.exit_status(h) for h in range(3)],
              "agents_s": [round(ended[h] - cut, 1) for h in range(3)]}
    waited = [re.search(r"(?:Done waiting for other agents|Error waiting on exit barrier)\. Elapsed: ([0-9.]+)",
                         job.agent_log(h)) for h in range(3)]
    result["barrier_s"] = [round(float(w.group(1)), 2) for w in waited if w]
    left = [e for e in events if e["lost"]]
    if scenario in ("cut10", "cut60", "heal") and left:
        result["caught_s"] = round(left[0]["at"] - left[0]["seconds"] - cut, 2)
        result["rebuilt_s"] = round(left[0]["at"] - cut, 2)
    if scenario in ("cut10", "cut60"):
        exited = _worker_exit(job, 2)
        result["cut_worker_exit_s"] = None if exited is None else round(exited - cut, 1)
    if scenario == "store":
        for host in range(3):
            exited = _worker_exit(job, host)
            result[f"worker{host}_exit_s"] = None if exited is None else round(exited - cut, 1)
    if scenario == "heal":
        back = [e for e in events if e["joined"]]
        result["back_after_heal_s"] = round(back[0]["at"] - healed, 2) if back else None
        result["world_back"] = back[0]["world_size"] if back else None
    if scenario == "links":
        result["evictions"] = len(events)
    if scenario in ("heal", "links", "cut10", "cut60"):
        void = live_fns.void_steps(events)
        lost = [m for e in events for m in e["lost"] if m not in void]
        resumed = min([e["step"] for e in left] or [0])
        trained = live_fns.trained_ids(out / "ids", lost, resumed, void)
        result["samples_exact"] = trained == {epoch: samples for epoch in range(epochs)}
    return result


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    chosen = sys.argv[2:] or list(SCENARIOS)
    by_scenario: dict[str, list[dict]] = {}
    for scenario in chosen:
        for _ in range(trials):
            result = trial(scenario)
            print(json.dumps(result), flush=True)
            by_scenario.setdefault(scenario, []).append(result)
    for scenario, results in by_scenario.items():
        numbers = {key for r in results for key, value in r.items() if isinstance(value, (int, float))
                   and not isinstance(value, bool)}
        medians = {key: statistics.median(r[key] for r in results if r.get(key) is not None) for key in sorted(numbers)}
        print(json.dumps({"scenario": scenario, "trials": len(results), "medians": medians}))


if __name__ == "__main__":
    main()
