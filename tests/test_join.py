"""A script that set up torch.distributed itself uses gradsync by changing one import (join.py).

join_script.py runs under torchrun with 2 and 3 ranks; it calls init_process_group("gloo") and
destroy_process_group() itself and never gradsync.init(). Oracles, computed in the same run:
torch's DDP on the same data (losses and parameters, float64, 1e-12 relative), torch DDP + torch's
Adam for ShardedOptimizer, the script's own dist.all_reduce for gs.all_reduce, a single-process
SGD step for the parameter server.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("join_script.py")
TOLERANCE = 1e-12


def _run_script(nproc: int) -> list[dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(nproc), str(SCRIPT)], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, f"torchrun failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(part)[0] for part in out.stdout.split("RESULT ")[1:]]
    return sorted(rows, key=lambda row: row["rank"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [2, pytest.param(3, marks=pytest.mark.slow)])   # 3: a larger world
def test_script_with_its_own_process_group(nproc):
    rows = _run_script(nproc)
    assert [row["rank"] for row in rows] == list(range(nproc))
    for row in rows:
        assert row["joined"] and row["world_size"] == nproc
        assert row["transport"] == "ShmTransport"  # one host: shared memory, as in a world of our own
        for name in ("ddp_no_sync", "ddp_flag", "zero1"):
            assert row[name]["losses"] <= TOLERANCE, (name, row[name])
            assert row[name]["params"] <= TOLERANCE, (name, row[name])
        collectives = row["collectives"]
        assert max(collectives["sum"], collectives["max"], collectives["product"]) <= TOLERANCE, collectives
        assert collectives["bxor_exact"] and collectives["broadcast_exact"], collectives
        assert row["ps"]["role"] == ("server" if row["rank"] == 0 else "worker")
        if row["rank"] > 0:
            assert row["ps"]["params"] <= TOLERANCE, row["ps"]
        errors = row["errors"]
        assert "contradicts" in errors["init_other_world_size"] and f"world_size={nproc}" in errors["init_other_world_size"]
        if row["rank"] == 0:   # the group's one member: a single replica, accepted
            assert errors["subgroup"] is None, errors["subgroup"]
        else:
            assert errors["subgroup"].startswith("ValueError") and "not a member of process_group" in errors["subgroup"]
        assert errors["bxor_on_float"].startswith("TypeError") and "bxor" in errors["bxor_on_float"]
        # gradsync.shutdown() left the script's group working, and the script tore it down itself
        assert row["script_group_after_shutdown"] == [float(nproc)] * 2
        assert row["destroyed"]
