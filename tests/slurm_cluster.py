"""A Slurm cluster of two nodes on this machine, for the tests marked ``slurm``: Debian's slurm-wlm
(slurmctld, slurmd) and munge, started here and stopped when done.

    node     a network namespace (gsslurm<pid>n<i>) holding one end of a veth pair, address
             10.231.0.<i+1>/24 and its own slurmd (-N <node name>); node 0 also runs slurmctld.
             What runs on a node enters its network namespace (nsenter) and a mount namespace of its
             own in which /etc/hosts is the node's (a bind mount): both nodes' names and, as on a
             real cluster, this machine's host name as the node's own address, so gloo and the
             rendezvous find the node's address from its host name. (Not `ip netns exec`: it mounts
             a fresh /sys without the cgroup file systems, and slurmd refuses to start without them.)
    munge    one munged for both nodes, on a socket of its own (AuthInfo=socket=...): its socket is a
             file, so every namespace reaches it.
    clients  sbatch, srun, scontrol, scancel and sacct run inside node 0's namespace (the login node),
             with SLURM_CONF pointing at this cluster's slurm.conf.
    sacct    without slurmdbd: the job completion plugin (JobCompType=jobcomp/filetxt) logs every job's
             end with its state and exit code, and `sacct --completion` reads that log.

Every process is started here with its pid kept (stop() ends them by pid, then whatever is left in
the namespaces, which only this cluster's jobs can be in), and every namespace, veth pair and file is
removed by stop(), also when a test fails (the fixture's finally, and atexit). The names carry the
test process's pid (gsslurm<pid>n<i>, /tmp/gs-slurm-<pid>-*): what a process killed outright left
behind is removed by the next cluster's start (sweep_stale).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

NODE_NAMES = ("node09", "node10")
"""Zero-padded names whose numbers change width, so SLURM_NODELIST reads node[09-10]."""
ADDRESSES = ("10.231.0.1", "10.231.0.2")
CPUS_PER_NODE = 4
"""Declared, not real (SlurmdParameters=config_overrides): two tasks per node fit with room to spare."""
DAEMONS = ("munged", "slurmctld", "slurmd")


def unavailable() -> str | None:
    """Why a cluster cannot be started here (None when it can)."""
    missing = [tool for tool in (*DAEMONS, "sbatch", "srun", "scontrol", "sacct", "ip", "nsenter", "unshare")
               if shutil.which(tool) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found; `apt-get install slurm-wlm munge` "
                f"installs it: .ci/run does)")
    if os.geteuid() != 0:
        return f"the Slurm tests need root to run slurmd and make network namespaces (running as uid {os.geteuid()})"
    return None


def _run(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"'{' '.join(args)}' failed: {result.stderr.strip() or result.stdout.strip()}")
    return result


SLURM_CONF = """\
ClusterName=gradsync
SlurmctldHost={host}({addr0})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket,cred_expire=10
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.log
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MessageTimeout=20
SlurmdTimeout=60
KillWait=10
MinJobAge=600
InactiveLimit=0
JobRequeue=0
NodeName={node0} NodeAddr={addr0} CPUs={cpus} State=UNKNOWN
NodeName={node1} NodeAddr={addr1} CPUs={cpus} State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def sweep_stale() -> None:
    """Remove the namespaces, daemons and directories of clusters whose test process is gone."""
    listed = _run("ip", "netns", "list", check=False).stdout.split("\n")
    for name in (line.split()[0] for line in listed if line.strip()):
        match = re.fullmatch(r"gsslurm(\d+)n\d", name)
        if match and not _alive(int(match[1])):
            for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
                _kill(int(pid))
            _run("ip", "netns", "del", name, check=False)
    for directory in Path(tempfile.gettempdir()).glob("gs-slurm-*-*"):
        match = re.fullmatch(r"gs-slurm-(\d+)-.*", directory.name)
        if not match or _alive(int(match[1])):
            continue
        for pid_file in directory.glob("*.pid"):   # munged runs outside the namespaces
            try:
                pid = int(pid_file.read_text().split()[0])
                owned = str(directory) in Path(f"/proc/{pid}/cmdline").read_text()
            except (OSError, ValueError, IndexError):
                continue
            if owned:
                _kill(pid)
        shutil.rmtree(directory, ignore_errors=True)


class SlurmCluster:
    """Two Slurm nodes in network namespaces; start() brings them up, stop() removes every trace."""

    def __init__(self) -> None:
        sweep_stale()
        tag = os.getpid()
        self.namespaces = [f"gsslurm{tag}n{i}" for i in range(2)]
        self.links = [f"gssl{tag}{side}" for side in "ab"]
        self.dir = Path(tempfile.mkdtemp(prefix=f"gs-slurm-{tag}-"))
        self.conf = self.dir / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self._stopped = False
        atexit.register(self.stop)

    # -- start --------------------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> "SlurmCluster":
        try:
            self._make_nodes()
            self._write_config()
            self._start_daemons()
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _make_nodes(self) -> None:
        for i, namespace in enumerate(self.namespaces):
            _run("ip", "netns", "add", namespace)
            (self.dir / f"hosts.{i}").write_text(
                "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(ADDRESSES, NODE_NAMES))
                + f"{ADDRESSES[i]} {socket.gethostname()}\n")
        _run("ip", "link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for i, namespace in enumerate(self.namespaces):
            _run("ip", "link", "set", self.links[i], "netns", namespace)
            _run("ip", "-n", namespace, "addr", "add", f"{ADDRESSES[i]}/24", "dev", self.links[i])
            _run("ip", "-n", namespace, "link", "set", self.links[i], "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")

    def _write_config(self) -> None:
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir()
        self.conf.write_text(SLURM_CONF.format(host=socket.gethostname().split(".")[0], dir=self.dir,
                                               addr0=ADDRESSES[0], addr1=ADDRESSES[1], node0=NODE_NAMES[0],
                                               node1=NODE_NAMES[1], cpus=CPUS_PER_NODE))
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)

    def on_node(self, node: int, *args: str) -> list[str]:
        """The command line that runs ``args`` on ``node`` (its network namespace and /etc/hosts)."""
        return ["nsenter", f"--net=/run/netns/{self.namespaces[node]}", "unshare", "--mount", "sh", "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"', str(self.dir / f"hosts.{node}"), *args]

    def _spawn(self, name: str, node: int | None, *args: str) -> None:
        log = open(self.dir / f"{name}.out", "w")  # noqa: SIM115 - the daemon's for its life
        argv = list(args) if node is None else self.on_node(node, *args)
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _start_daemons(self) -> None:
        d = self.dir
        self._spawn("munged", None, "munged", "--foreground", "--force", f"--socket={d}/munge.socket",
                    f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                    f"--seed-file={d}/munged.seed")
        deadline = time.monotonic() + 10
        while not (d / "munge.socket").exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not make its socket within 10 s:\n{self._logs()}")
            time.sleep(0.05)
        self._spawn("slurmctld", 0, "slurmctld", "-D", "-i", "-f", str(self.conf))
        for i, name in enumerate(NODE_NAMES):
            (d / "spool" / name).mkdir()
            self._spawn(f"slurmd.{name}", i, "slurmd", "-D", "-N", NODE_NAMES[i], "-f", str(self.conf))

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with status {proc.returncode}:\n{self._logs()}")

    def _logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.dir.glob("*.out"))
                         + sorted(self.dir.glob("*.log")) if p.is_file())

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            out = self.client("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in NODE_NAMES):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the nodes are not idle after {timeout:.0f} s ({states}):\n{self._logs()}")
            time.sleep(0.2)

    # -- use ----------------------------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def client(self, *args: str, check: bool = True, timeout: float = 60, env: dict | None = None
               ) -> subprocess.CompletedProcess:
        """A Slurm command run on node 0 (the login node)."""
        result = subprocess.run(self.on_node(0, *args), capture_output=True, text=True,
                                timeout=timeout, env=env or self.env())
        if check and result.returncode != 0:
            raise RuntimeError(f"'{' '.join(args)}' failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def sbatch(self, script: str, *options: str, cwd: str | Path | None = None, env: dict | None = None) -> int:
        """Submit ``script`` (its text); returns the job id."""
        path = Path(cwd or self.dir) / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        result = subprocess.run(self.on_node(0, "sbatch", "--parsable", *options, str(path)),
                                capture_output=True, text=True, timeout=60, env=env or self.env(), cwd=cwd)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job`'s fields of ``job_id`` ({} once Slurm has forgotten it)."""
        out = self.client("scontrol", "show", "job", "-o", str(job_id), check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, timeout: float, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                         "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY")) -> dict:
        """Wait until ``job_id`` is in one of ``states``; its fields, or an error naming where it stood."""
        deadline = time.monotonic() + timeout
        fields: dict = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            self._check_alive()
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} not in {states} after {timeout:.0f} s: {fields}\n{self._logs()}")

    def sacct(self, job_id: int) -> list[dict[str, str]]:
        """What `sacct --completion` says of ``job_id``: one row per end the job came to."""
        out = self.client("sacct", "--completion", "-n", "-P", "-j", str(job_id),
                          "--format=JobID,State,ExitCode").stdout
        return [dict(zip(("JobID", "State", "ExitCode"), line.split("|"))) for line in out.splitlines() if line]

    def namespace_pids(self, node: int) -> list[int]:
        return [int(p) for p in _run("ip", "netns", "pids", self.namespaces[node], check=False).stdout.split()]

    # -- stop ---------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job, stop every daemon, kill what is left in the namespaces, delete them."""
        if self._stopped:
            return
        self._stopped = True
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.client("scancel", "--user=root", check=False, timeout=20)
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for namespace in self.namespaces:   # slurmstepd and job tasks: only this cluster's run in them
            for pid in _run("ip", "netns", "pids", namespace, check=False).stdout.split():
                _kill(int(pid))
            _run("ip", "netns", "del", namespace, check=False)
        if not os.environ.get("GRADSYNC_KEEP_SLURM_DIR"):
            shutil.rmtree(self.dir, ignore_errors=True)
