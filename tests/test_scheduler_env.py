"""What schedulers set, read without a scheduler: Slurm's host lists and task variables
(group/slurm.py), the world gs.init() makes of them, and Kubernetes' PyTorchJob environment.

Oracles: `scontrol show hostnames` (Slurm's own expansion; the tests that run it are marked ``slurm``
and need only the scontrol binary), Slurm's own compression (`scontrol show hostlist`) for the forms it
produces, environments copied from tasks of a real srun (tests/test_slurm.py runs them for real), and
closed forms (ranks 1..N sum to N(N+1)/2)."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradsync as gs
from gradsync.group import runtime, slurm
from gradsync.group.slurm import expand_hostlist, port_for, step_torchrun_env, tasks_per_node, world_from_env

SCRIPT = str(Path(__file__).with_name("env_world_script.py"))
SRC = str(Path(__file__).resolve().parents[1] / "src")

# host list -> what `scontrol show hostnames` prints (test_the_table_is_what_scontrol_prints checks each)
EXPANSIONS = [
    ("node[01-04,07],gpu-a[1-2]", "node01 node02 node03 node04 node07 gpu-a1 gpu-a2"),
    ("node09", "node09"),
    ("n[8-11]", "n8 n9 n10 n11"),            # no padding: the width of "8"
    ("n[08-11]", "n08 n09 n10 n11"),         # padded to the width of "08"
    ("n[1-010]", "n1 n2 n3 n4 n5 n6 n7 n8 n9 n10"),   # the width is lo's, not hi's
    ("n[998-1001]", "n998 n999 n1000 n1001"),
    ("n[0998-1001]", "n0998 n0999 n1000 n1001"),
    ("n[001-003,10]", "n001 n002 n003 n10"),  # each range has its own width
    ("n[01,2-03]", "n01 n2 n3"),
    ("n[5]", "n5"),
    ("a-b[1-2]", "a-b1 a-b2"),
    ("[1-2]", "1 2"),
    ("x,y z", "x y z"),                       # commas and whitespace separate hosts
    (",a,,b,", "a b"),
    ("n[1-2],n[1-2]", "n1 n2 n1 n2"),         # duplicates kept
    ("a[1-2]b[3-4]", "a1b3 a1b4 a2b3 a2b4"),  # two bracket groups
    ("n[0-1]-[2-3]", "n0-2 n0-3 n1-2 n1-3"),
    ("n[0-1]x[2-3]y[4-5]", "n0x2y4 n0x2y5 n1x2y4 n1x2y5 n0x3y4 n0x3y5 n1x3y4 n1x3y5"),   # Slurm's own order
    ("rack[1-2]-gpu[01-02],login1", "rack1-gpu01 rack1-gpu02 rack2-gpu01 rack2-gpu02 login1"),
    ("n[1-]", "n1"),
]
REFUSED = ["n[1-3]x", "rack[1-2]-node[01-02]-ib", "n[]", "n[1-2,]", "n[1,,2]", "n[3-1]", "n[a-b]", "n[-1]",
           "n[1x]", "n[1-2]]", "n[1-65537]", "n[0-65536]"]


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory):
    """run(*args) -> `scontrol args` with a minimal slurm.conf (scontrol's host-list commands need one, no
    daemon); skips where Slurm is not installed."""
    if shutil.which("scontrol") is None:
        pytest.skip("Slurm is not installed (no scontrol: `apt-get install slurm-client`; .ci/run installs slurm-wlm)")
    conf = tmp_path_factory.mktemp("slurmconf") / "slurm.conf"
    conf.write_text("ClusterName=hostlists\nSlurmctldHost=localhost\n")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30,
                              env={**os.environ, "SLURM_CONF": str(conf)})
    return run


@pytest.mark.parametrize("hostlist, hosts", EXPANSIONS)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts.split()


@pytest.mark.parametrize("hostlist", REFUSED)
def test_expand_hostlist_refuses_what_slurm_refuses(hostlist):
    with pytest.raises(ValueError, match="host list") as error:
        expand_hostlist(hostlist)
    assert "\n" not in str(error.value) and repr(hostlist) in str(error.value)


@pytest.mark.slurm
def test_the_table_is_what_scontrol_prints(scontrol):
    for hostlist, hosts in EXPANSIONS:
        assert scontrol("show", "hostnames", hostlist).stdout.split() == hosts.split(), hostlist
    for hostlist in REFUSED:
        shown = scontrol("show", "hostnames", hostlist)
        assert "Invalid hostlist" in shown.stdout + shown.stderr, hostlist   # (its exit status is 0 all the same)


# Host names as clusters name them: a prefix (letters, '-') and a number zero-padded to 1..4 digits, or
# a bare name; the list is any order, repeats allowed.
_NAMES = st.one_of(
    st.builds(lambda prefix, number, width: f"{prefix}{number:0{width}d}",
              st.sampled_from(["node", "n", "gpu-a", "cpu-", "r1n"]), st.integers(0, 1200), st.integers(1, 4)),
    st.sampled_from(["login", "head-node", "x"]))


@pytest.mark.slurm
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_NAMES, min_size=1, max_size=24))
def test_expand_hostlist_on_what_slurm_compresses(scontrol, names):
    """Slurm compresses the names (`scontrol show hostlist`: the form SLURM_NODELIST has); ours expands
    them as `scontrol show hostnames` does."""
    compressed = scontrol("show", "hostlist", ",".join(names)).stdout.strip()
    assert expand_hostlist(compressed) == scontrol("show", "hostnames", compressed).stdout.split(), compressed
    assert sorted(expand_hostlist(compressed)) == sorted(names), compressed


def test_tasks_per_node():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("3,1") == [3, 1] and tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match=r"tasks per node '2\(3\)'"):
        tasks_per_node("2(3)")


# -- Slurm's variables, as a real srun sets them (copied from tasks of tests/test_slurm.py's cluster) --

def step_task(procid: int, localid: int, nodeid: int, layout: str = "2(x2)", tasks: int = 4, step: int = 1,
              nodes: str = "node[09-10]", job: int = 7) -> dict[str, str]:
    """A task of `srun` (step ``step``) in `sbatch -N2 --ntasks-per-node=2` (job ``job``)."""
    return {"SLURM_JOB_ID": str(job), "SLURM_JOBID": str(job), "SLURM_JOB_NODELIST": "node[09-10]",
            "SLURM_JOB_NUM_NODES": "2", "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
            "SLURM_NODELIST": nodes, "SLURM_NPROCS": str(tasks), "SLURM_NTASKS": str(tasks),
            "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": str(procid), "SLURM_STEPID": str(step),
            "SLURM_STEP_ID": str(step), "SLURM_STEP_LAUNCHER_PORT": "34195", "SLURM_STEP_NODELIST": nodes,
            "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_TASKS_PER_NODE": layout,
            "SLURM_TASKS_PER_NODE": layout}


BATCH_SCRIPT = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "node[09-10]", "SLURM_JOB_NUM_NODES": "2",
                "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "node[09-10]", "SLURM_NPROCS": "4",
                "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "0",
                "SLURM_TASKS_PER_NODE": "2(x2)"}
SALLOC_SHELL = {"SLURM_JOB_ID": "2", "SLURM_JOB_NODELIST": "node[09-10]", "SLURM_JOB_NUM_NODES": "2",
                "SLURM_NNODES": "2", "SLURM_NODELIST": "node[09-10]", "SLURM_NPROCS": "4", "SLURM_NTASKS": "4",
                "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x2)"}


def test_each_task_of_a_step_is_one_rank():
    # srun -N2 -n4 in a 2-node job: block distribution, tasks 0,1 on node09 and 2,3 on node10
    places = [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    worlds = [world_from_env(step_task(*place)) for place in places]
    assert [(w.rank, w.world_size, w.local_rank, w.local_world_size) for w in worlds] == [
        (0, 4, 0, 2), (1, 4, 1, 2), (2, 4, 0, 2), (3, 4, 1, 2)]
    assert {(w.master_addr, w.master_port) for w in worlds} == {("node09", port_for(7, 1))}


def test_uneven_tasks_per_node():
    # what srun -N2 -n4 gave in a job of 4 tasks: 3 on node09, 1 on node10
    layout = "3,1"
    places = [(0, 0, 0), (1, 1, 0), (2, 2, 0), (3, 0, 1)]
    assert [world_from_env(step_task(*p, layout=layout)).local_world_size for p in places] == [3, 3, 3, 1]


def test_a_step_of_one_task_and_no_slurm_are_no_world():
    one = {**step_task(0, 0, 0, layout="1", tasks=1, nodes="node09")}
    assert world_from_env(one) is None and world_from_env({}) is None
    assert world_from_env({**BATCH_SCRIPT, "SLURM_NTASKS": "1", "SLURM_NPROCS": "1"}) is None


@pytest.mark.parametrize("env, message", [
    (SALLOC_SHELL, r"Slurm job 2 has SLURM_NTASKS=4 but this process has no SLURM_PROCID"),
    (BATCH_SCRIPT, r"Slurm job 1's batch script or shell \(SLURM_PROCID=0, no SLURM_STEP_ID\).*SLURM_NTASKS=4 tasks"),
    ({**BATCH_SCRIPT, "SLURM_STEP_ID": "4294967290"},   # salloc's interactive step (LaunchParameters)
     r"SLURM_STEP_ID=4294967290, one of Slurm's own steps"),
    ({k: v for k, v in step_task(1, 1, 0).items() if k not in ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
                                                                "SLURM_NPROCS")},
     r"SLURM_PROCID=1 is set but not SLURM_NTASKS"),
    ({k: v for k, v in step_task(1, 1, 0).items() if k != "SLURM_LOCALID"}, r"but no SLURM_LOCALID"),
    (step_task(4, 0, 1), r"SLURM_PROCID=4 is not in 0..3"),
    (step_task(3, 1, 1, layout="2"), r"SLURM_STEP_TASKS_PER_NODE='2' \(2 tasks on 1 nodes\) does not fit"),
    (step_task(3, 1, 1, nodes="node09"), r"names 1 node\(s\) but SLURM_STEP_TASKS_PER_NODE='2\(x2\)'"),
    ({**step_task(3, 1, 1), "SLURM_LOCALID": "two"}, r"SLURM_LOCALID='two' is not an integer"),
])
def test_a_world_slurm_describes_partly_is_a_one_line_error(env, message):
    with pytest.raises(ValueError, match=message) as error:
        world_from_env(env)
    assert "\n" not in str(error.value)


def test_a_steps_port_comes_from_the_job_and_step():
    ports = {port_for(job, step) for job in range(1024) for step in range(16)}
    assert len(ports) == 1024 * 16 and min(ports) == slurm.PORT_BASE and max(ports) < 32768   # below ephemeral
    assert port_for(7, 0) != port_for(7, 1) and port_for(7, 0) != port_for(8, 0)


def test_step_torchrun_env_for_gradsync_train():
    """`srun gradsync train` takes torchrun's variables from the task; torchrun's own, where set, stay."""
    assert step_torchrun_env(step_task(3, 1, 1)) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node09",
        "MASTER_PORT": str(port_for(7, 1))}
    assert "MASTER_PORT" not in step_torchrun_env({**step_task(3, 1, 1), "MASTER_PORT": "29500"})
    assert step_torchrun_env({**step_task(3, 1, 1), "RANK": "0", "WORLD_SIZE": "2"}) == {}   # srun torchrun
    # the batch script and an salloc shell run gradsync's own launcher (--workers), as any machine does
    assert step_torchrun_env(BATCH_SCRIPT) == {} and step_torchrun_env(SALLOC_SHELL) == {}
    assert step_torchrun_env({**BATCH_SCRIPT, "SLURM_STEP_ID": "4294967290"}) == {}


# -- gs.init() on these environments ----------------------------------------------------------------

WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    for name in [*WORLD_VARIABLES, *[n for n in os.environ if n.startswith("SLURM_")]]:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    gs.shutdown()


def test_torchruns_variables_win_over_slurms(clean_env):
    for name, value in step_task(3, 1, 1).items():
        clean_env.setenv(name, value)
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    w = gs.init(timeout=5)
    assert (w.rank, w.world_size, w.master_addr) == (0, 1, "127.0.0.1")


@pytest.mark.parametrize("env, message", [(SALLOC_SHELL, "no SLURM_PROCID"), (BATCH_SCRIPT, "batch script")])
def test_init_where_slurm_describes_a_world_partly(clean_env, env, message):
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        gs.init(timeout=5)
    assert not runtime.is_initialized()


def _free_slurm_port() -> tuple[int, int]:
    """(job id, step id) whose port_for() is free on this machine now."""
    for job in range(1024):
        port = port_for(job, 0)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return job, 0
    raise AssertionError("no free port in Slurm's range")


def _run_ranks(envs: list[dict], timeout: float = 120) -> list[dict]:
    """env_world_script.py once per environment, at once; every one must exit 0; their RESULTs by rank."""
    base = {k: v for k, v in os.environ.items() if k not in WORLD_VARIABLES and not k.startswith("SLURM_")}
    procs = [subprocess.Popen([sys.executable, SCRIPT], env={**base, "PYTHONPATH": SRC, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for env in envs]
    outputs = []
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for i, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {i} (env {envs[i]}) failed:\n{out[-3000:]}"
    results = [json.loads(line.split("RESULT ", 1)[1]) for out in outputs for line in out.splitlines()
               if line.startswith("RESULT ")]
    return sorted(results, key=lambda r: r["rank"])


@pytest.mark.timeout(180)
def test_init_inside_an_srun_step_of_three_tasks_on_one_node():
    """Three processes with a task's variables each (SLURM_PROCID 2, 0, 1: started out of order): one world,
    ranks as Slurm numbered them, all on node localhost, rendezvous on the port of the job."""
    job, step = _free_slurm_port()
    envs = [step_task(procid, procid, 0, layout="3", tasks=3, step=step, nodes="localhost", job=job)
            for procid in (2, 0, 1)]
    results = _run_ranks(envs)
    assert [(r["rank"], r["world_size"], r["local_rank"], r["local_world_size"]) for r in results] == [
        (0, 3, 0, 3), (1, 3, 1, 3), (2, 3, 2, 3)]
    assert all(r["sum"] == 1 + 2 + 3 and r["master_port"] == port_for(job, step) for r in results)
    assert all(r["hosts"] == [[0, 1, 2]] for r in results)   # the host exchange agrees with SLURM_LOCALID


@pytest.mark.timeout(180)
def test_pytorchjob_environment_on_one_host():
    """Kubernetes' PyTorchJob sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and no LOCAL_RANK: the local
    rank is the place on the host the host exchange finds (here both ranks share it)."""
    from gradsync.group.runtime import free_port

    port = free_port()
    envs = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": "2"} for r in (1, 0)]
    results = _run_ranks(envs)
    assert [(r["rank"], r["world_size"], r["local_rank"], r["local_world_size"], r["sum"]) for r in results] == [
        (0, 2, 0, 2, 3.0), (1, 2, 1, 2, 3.0)]
