"""The torch.distributed backend "gradsync" under torch's own API (c10d/).

backend_script.py runs under torchrun with 4 ranks and compares everything with a gloo group over
the same ranks in the same run (see its docstring); its collectives run on cases hypothesis draws
here, served one at a time to the one running world through a TCPStore (a failing case is shrunk
there too); backend_kill_script.py SIGKILLs a rank of a torch DDP job. At the odd world sizes 3 and
5, backend_fns.py compares the collectives that take lists of tensors or a root with gloo, in worlds
of world_of's. The registration tests run fresh interpreters, as a user's script would.
"""

import json
import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import backend_fns
from gradsync.group.runtime import free_port

HERE = Path(__file__).parent
DOUBLE = 1e-12
FP16_ON_THE_WIRE = 5e-3  # a few fp16 epsilons (9.8e-4), normwise, after 4 steps with momentum


def _results(stdout: str) -> list[dict]:
    decoder = json.JSONDecoder()
    return sorted((decoder.raw_decode(part)[0] for part in stdout.split("RESULT ")[1:]), key=lambda row: row["rank"])


FLOATING = ["float32", "float64", "float16", "bfloat16"]
COMPLEX = ["complex64", "complex128"]
INTEGRAL = ["int32", "int64", "uint8", "int8", "bool"]
CASE_COUNT = 40
SMALL_SHAPES = st.lists(st.integers(0, 5), min_size=1, max_size=3)
LARGE_SIZES = [70_000, 300_000, 1_100_000]
"""Elements of a large case's 1-D tensor. With 4 ranks on one host gradsync's all-reduce takes the
direct path below 256 KiB and the split one above; reduce-scatter and all-gather read each other's
tensors in one kernel copy from 256 KiB; the 2 MiB rings carry bigger messages in segments. 1.1M
float32 elements are 4.4 MB, past all of them (and the all-gathers' outputs are 4x that)."""


def _ops(dtype: str) -> list[str]:
    """Every op torch's gloo accepts for the dtype (complex: torch itself refuses the rest)."""
    if dtype in FLOATING:
        return ["sum", "avg", "max", "min", "product"]
    if dtype in COMPLEX:
        return ["sum", "avg"]
    return ["sum", "product", "max", "min", "band", "bor", "bxor"]


@st.composite
def collective_cases(draw) -> dict:
    """One case for backend_script.py's collectives: a dtype, a shape (empty dimensions included,
    or one large dimension), an op the dtype admits on both backends, a root rank, how many inputs
    the coalesced calls take (1-3) and a salt for the values (backend_script.values says which)."""
    dtype = draw(st.sampled_from(FLOATING + COMPLEX + INTEGRAL))
    large = draw(st.integers(0, 9)) == 0  # one case in ten
    shape = [draw(st.sampled_from(LARGE_SIZES))] if large else draw(SMALL_SHAPES)
    return {"dtype": dtype, "shape": shape, "op": draw(st.sampled_from(_ops(dtype))),
            "root": draw(st.integers(0, 3)), "several": draw(st.integers(1, 3)), "salt": draw(st.integers(0, 10_000))}


LARGE_CASES = [  # run in every session, whatever hypothesis draws: each path with a few dtypes and ops
    {"dtype": "float32", "shape": [1_100_000], "op": "sum", "root": 1, "several": 2, "salt": 1},
    {"dtype": "int64", "shape": [600_000], "op": "bxor", "root": 3, "several": 1, "salt": 2},
    {"dtype": "bfloat16", "shape": [2_200_000], "op": "max", "root": 0, "several": 3, "salt": 3},
    {"dtype": "complex64", "shape": [300_000], "op": "avg", "root": 2, "several": 2, "salt": 4},
    {"dtype": "float16", "shape": [70_000], "op": "product", "root": 1, "several": 1, "salt": 5},
]


def with_examples(cases: list[dict]):
    """hypothesis's @example for each of ``cases``."""
    def decorate(test):
        for case in cases:
            test = example(case=case)(test)
        return test
    return decorate


def _answer(store: dist.TCPStore, world: subprocess.Popen, key: str, limit: float = 90.0) -> list[str]:
    """The world's answer under ``key``; an error at once if the world has exited, or after ``limit``."""
    deadline = time.monotonic() + limit
    while True:
        try:
            store.wait([key], timedelta(seconds=1))
            return json.loads(store.get(key))
        except RuntimeError:  # torch's store timeout (DistStoreError)
            if world.poll() is not None:
                raise RuntimeError(f"the torchrun world exited ({world.returncode}) without answering {key}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer under {key} after {limit:.0f} s")


def _serve_cases(store: dist.TCPStore, world: subprocess.Popen, served: list[dict]) -> None:
    """Hypothesis draws the cases; each goes to the running world, which answers what differed."""
    @settings(max_examples=CASE_COUNT, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=collective_cases())
    @with_examples(LARGE_CASES)
    def every_collective_matches_gloo(case):
        index = len(served)
        store.set(f"case/{index}", json.dumps(case))
        served.append(case)
        assert _answer(store, world, f"result/{index}") == []

    every_collective_matches_gloo()


@pytest.mark.timeout(300)
def test_torch_programs_on_the_gradsync_backend_match_gloo(tmp_path):
    # waits: 90 s for any one answer from a live world (the first comes after the DDP part), then 180 s
    # for the world to end; together under the test's 300 s, so a stuck world is killed here
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=90))
    # PYTHONFAULTHANDLER: a rank that dies of a signal (an abort at exit, say) prints every thread's stack
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
           "GRADSYNC_TEST_CASES_PORT": str(store.port)}
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:  # files: a full pipe would stall the world
        world = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                  "4", str(HERE / "backend_script.py")], stdout=out, stderr=err, env=env)
    served: list[dict] = []
    failure = None
    try:
        _serve_cases(store, world, served)
    except BaseException as exc:  # raised below, after the world's own failure if it has one
        failure = exc
    finally:
        store.set(f"case/{len(served)}", json.dumps({"stop": True}))
        try:
            world.wait(timeout=180)
        except subprocess.TimeoutExpired:
            world.kill()
            world.wait()
    stdout, stderr = out_path.read_text(), err_path.read_text()
    assert world.returncode == 0, f"torchrun failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    if failure is not None:
        raise failure
    assert len(served) >= CASE_COUNT
    rows = _results(stdout)
    assert [row["rank"] for row in rows] == [0, 1, 2, 3]
    for row in rows:
        assert row["backend"] == "gradsync"
        assert row["problems"] == [], row["problems"]
        assert row["cases"] == len(served)
        ddp = row["ddp"]
        assert max(ddp["no_sync"], ddp["unused"], ddp["static"]) <= DOUBLE, ddp
        assert ddp["fp16_hook"] <= FP16_ON_THE_WIRE, ddp
        # torch DDP's buckets adopted into shared memory: gloo's parameters, and with
        # gradient_as_bucket_view the gradients (views of the buckets) lie in shared memory on this
        # backend only. A program's own all-reduce outside backward leaves its tensor where it was;
        # during backward a buffer reduced again and again moves, unless NumPy shares its memory
        wide = row["wide"]
        for view in ("view=False", "view=True"):
            assert wide[view]["worst"] <= DOUBLE, wide
        assert (wide["view=True"]["shared"], wide["view=True"]["shared_on_gloo"]) == (True, False), wide
        assert wide["outside_backward_kept"], wide
        assert wide["in_backward_moved"] == {"plain": True, "numpy": False} and wide["numpy_view_true"], wide
        assert row["zero"] <= DOUBLE
        assert row["cuda_to_nccl"] is False   # CUDA tensors are staged through the host, as gloo's
        assert "sparse collectives are not supported" in row["sparse_refusal"], row["sparse_refusal"]
        rank, mismatch = row["rank"], row["mismatch"]
        assert mismatch is not None and "collective mismatch between rank" in mismatch, mismatch
        assert f"rank {rank} called all_reduce" in mismatch and f"of {10 + rank} float32 elements" in mismatch
        # and the other rank it names, with that rank's own size (every rank passes 10 + its rank)
        named = re.search(rf"between rank {rank} and rank (\d+): .* rank \1 called all_reduce #\d+ of (\d+) float32",
                          mismatch)
        assert named and int(named[1]) != rank and int(named[2]) == 10 + int(named[1]), mismatch
        if rank != 3:  # rank 3 never called the all-reduce ranks 0-2 waited in, on a group of 3 s timeout
            never_called = row["never_called"]
            assert "all_reduce" in never_called["error"] and "not arrived: rank 3" in never_called["error"], never_called
            assert never_called["after"] < row["short_timeout"] + 2.0, never_called


@pytest.mark.timeout(120)
def test_a_killed_rank_of_a_torch_ddp_job_is_named_well_before_the_timeout(tmp_path):
    n, timeout = 3, 60.0
    port = free_port()
    stamp = tmp_path / "killed_at"
    procs = []
    for rank in range(n):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "KILL_TEST_TIMEOUT": str(timeout), "KILL_TEST_STAMP": str(stamp)}
        procs.append(subprocess.Popen([sys.executable, str(HERE / "backend_kill_script.py")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [proc.communicate(timeout=100) for proc in procs]
    assert procs[-1].returncode == -9  # the victim really died by SIGKILL
    killed_at = float(stamp.read_text())
    survivors = _results("".join(out for out, _ in outputs[:-1]))
    assert [row["rank"] for row in survivors] == list(range(n - 1)), [err[-2000:] for _, err in outputs]
    for row in survivors:
        assert row["error"] is not None and f"rank {n - 1}" in row["error"], row["error"]
        # docs/backend.md says about 0.2 s: a waiting rank checks /proc for its peers every 0.2 s (0.20-0.21 s
        # here, at load 4.6); gloo notices the reset connection too, but names only an address
        # (docs/reliability.md, catalogue #29). 2 s leaves a loaded machine 10x that
        assert row["raised_at"] - killed_at < 2.0, row


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_torch_finds_the_backend_by_itself_and_import_gradsync_registers_it():
    found = _python("import torch.distributed as d; print('gradsync' in d.Backend.backend_list)")
    assert found.stdout.strip() == "True", found.stderr
    off = _python("import torch.distributed as d; a = 'gradsync' in d.Backend.backend_list; import gradsync; "
                  "print(a, 'gradsync' in d.Backend.backend_list)", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert off.stdout.split() == ["False", "True"], off.stderr
    light = _python("import sys, torch; print(sorted(m for m in sys.modules if m.startswith('gradsync')))")
    assert light.stdout.strip() == "['gradsync', 'gradsync.c10d']", light.stdout  # registration only


def test_init_without_a_store_or_environment_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", "import torch.distributed as d; d.init_process_group('gradsync')"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode != 0 and time.monotonic() - started < 30
    assert "environment variable" in out.stderr and ("RANK" in out.stderr or "MASTER_ADDR" in out.stderr)


def test_unsupported_reduce_op_names_the_alternatives():
    from gradsync.c10d.arguments import op_name

    premul = dist._make_nccl_premul_sum(2.0)
    with pytest.raises(ValueError, match="not supported on CPU; choose one of SUM, AVG"):
        op_name(premul)
    assert op_name(dist.ReduceOp.BXOR) == "bxor" and op_name(dist.ReduceOp.AVG) == "avg"


ODD_WORLD_CASES = [(dtype, shape, op) for dtype, op in (("float32", "sum"), ("float64", "max"), ("float16", "product"),
                                                      ("bfloat16", "min"), ("int64", "sum"), ("int32", "product"),
                                                      ("uint8", "max"), ("int8", "sum"))
                   for shape in ((0,), (1,), (2,), (7,), (3, 5))]
ODD_WORLD_CASES += [("float32", (70_001,), "sum"), ("int64", (40_003,), "min")]
"""(dtype, shape, op) for backend_fns.rooted_and_list_collectives: each dtype of FLOATING and INTEGRAL
above (bool aside: gloo's reduce-scatter refuses it) with one reduction; shapes of 0 elements, 1,
fewer than N, not a multiple of N, two dimensions; two of over 256 KiB a piece, on the large paths
(LARGE_SIZES above)."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [3, pytest.param(5, marks=pytest.mark.slow)])   # 5: a larger world
def test_list_and_rooted_collectives_match_gloo_at_odd_world_sizes(world_of, world_size):
    """dist.reduce_scatter of a list, dist.all_gather into a list, dist.all_to_all, and dist.gather and
    dist.scatter from every root (0 and the non-zero ones) on the "gradsync" backend give gloo's outputs
    bit for bit on every rank, each call twice in a row, at world sizes 3 and 5."""
    compared = world_of(world_size).run(backend_fns.rooted_and_list_collectives, ODD_WORLD_CASES, case_timeout=120)
    calls = 2 * len(ODD_WORLD_CASES) * (3 + 2 * world_size)   # twice: 3 ops, then gather and scatter per root
    assert compared == [calls] * world_size, f"calls compared per rank {compared}, expected {calls} on each"
