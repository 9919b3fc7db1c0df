"""Run by tests/test_partition.py on an emulated host: a client of the job's store whose link is cut.

    python tests/store_cut_script.py serve ADDRESS PORT           hosts a TCPStore; prints "ready"
    python tests/store_cut_script.py ask ADDRESS PORT TIMEOUT      connects, prints "connected", then waits
                                                                   for a line on stdin (the cut is made)

``ask`` then makes each call of a torch store through group/bounded_store.py's BoundedStore with the
given timeout, the raw TCPStore's own timeout set to the same, and prints one JSON line per call:
{"call", "seconds", "error"} (error: the exception's type, or null). Then it waits for a second line on
stdin (the link is back) and makes one more get of a fresh client's, printing it the same way.
"""

import json
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from gradsync.group.bounded_store import BoundedStore, Contact


def serve(address: str, port: int) -> None:
    store = dist.TCPStore(address, port, 1, is_master=True, wait_for_workers=False)
    store.set("key", "value")
    print("ready", flush=True)
    time.sleep(600)


def ask(address: str, port: int, timeout: float) -> None:
    raw = dist.TCPStore(address, port, 1, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    store = BoundedStore(raw, Contact(f"{address}:{port}", timeout))
    assert store.get("key") == b"value"
    print("connected", flush=True)
    sys.stdin.readline()
    calls = [("set", lambda: store.set("a", "1")), ("get", lambda: store.get("key")),
             ("check", lambda: store.check(["key"])), ("add", lambda: store.add("n", 1)),
             ("compare_set", lambda: store.compare_set("c", "", "x")), ("multi_get", lambda: store.multi_get(["key"])),
             ("wait", lambda: store.wait(["missing"], timedelta(seconds=timeout)))]
    for name, call in calls:
        started = time.monotonic()
        error = None
        try:
            call()
        except Exception as exc:   # noqa: BLE001 - reported to the test
            error = type(exc).__name__
        print(json.dumps({"call": name, "seconds": time.monotonic() - started, "error": error}), flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    fresh = BoundedStore(dist.TCPStore(address, port, 1, is_master=False, wait_for_workers=False,
                                       timeout=timedelta(seconds=timeout)), Contact(f"{address}:{port}", timeout))
    print(json.dumps({"call": "get after the heal", "seconds": time.monotonic() - started,
                      "value": fresh.get("key").decode()}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        ask(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
