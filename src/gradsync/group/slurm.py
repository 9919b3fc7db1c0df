"""What Slurm's environment says about the world of a job step: who this task is, how many tasks there
are, where they meet.

Vocabulary
    job       what sbatch or salloc allocated (SLURM_JOB_ID, its nodes SLURM_JOB_NODELIST and its task count
              SLURM_NTASKS); the batch script runs on the job's first node, outside any step
    step      one srun inside the job: its own tasks (SLURM_STEP_NUM_TASKS), nodes (SLURM_STEP_NODELIST) and
              tasks per node (SLURM_STEP_TASKS_PER_NODE, e.g. "2(x3),1"); srun also overwrites SLURM_NTASKS
              with the step's count in each task. Its id is SLURM_STEP_ID.
    task      one process of a step: SLURM_PROCID (0..tasks-1, over the whole step), SLURM_LOCALID (0.. on
              its node), SLURM_NODEID (its node's index in the step's node list)
    host list Slurm's compressed list of node names, node[01-04,07],gpu-a[1-2] (expand_hostlist)

The world of a step of several tasks, one rank per task (world_from_env):
    rank = SLURM_PROCID                    world_size = SLURM_STEP_NUM_TASKS (else SLURM_NTASKS)
    local_rank = SLURM_LOCALID             local_world_size = this node's entry of SLURM_STEP_TASKS_PER_NODE
    master_addr = the first node of SLURM_STEP_NODELIST (else SLURM_NODELIST): where task 0 runs under
                  srun's block and cyclic distributions
    master_port = port_for(SLURM_JOB_ID, SLURM_STEP_ID)

A step of one task, a job without srun's variables, or no Slurm at all: None (a world of one or
gradsync's own launcher decides). A world Slurm describes partly is a ValueError saying what was found:
    SLURM_NTASKS > 1 without SLURM_PROCID      an salloc shell: the job's tasks are not started
    SLURM_PROCID but no SLURM_STEP_ID           the batch script: one process of a job of SLURM_NTASKS > 1
    a step's variable missing or out of range  SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE, ... inconsistent

torchrun's variables win (runtime.py consults this module only where RANK and WORLD_SIZE are unset):
under `srun torchrun ...` torchrun's agent sets them for its workers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

PORT_BASE = 15000
"""Lowest port port_for() gives. Its 16,384 ports (15000-31383) lie below Linux's ephemeral range
(32768-60999), so no outgoing connection holds one by chance."""
SPECIAL_STEPS = 0xFFFFFFF0
"""Step ids from here up are Slurm's own steps, not an srun's (slurm.h: the batch script 0xFFFFFFFB, the
extern step 0xFFFFFFFC, salloc's interactive step 0xFFFFFFFA): their one process is no rank of a world."""
MAX_HOSTS_IN_RANGE = 65536
"""The most hosts one bracket range may name; Slurm's hostlist.c refuses more (MAX_RANGE)."""


@dataclass(frozen=True)
class SlurmWorld:
    """One task's place in its step, as Slurm describes it."""

    rank: int
    """SLURM_PROCID."""
    world_size: int
    """Tasks in the step."""
    local_rank: int
    """SLURM_LOCALID."""
    local_world_size: int
    """Tasks of the step on this task's node."""
    master_addr: str
    """The step's first node: rendezvous host."""
    master_port: int
    """port_for(job id, step id)."""
    job_id: int
    """SLURM_JOB_ID."""
    step_id: int
    """SLURM_STEP_ID."""

    def torchrun_env(self) -> dict[str, str]:
        """This world as torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
        MASTER_PORT)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


# -- host lists ---------------------------------------------------------------------------------------

_RANGE = re.compile(r"(\d+)(?:-(\d*))?")


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list expanded, in Slurm's order, duplicates kept: what
    `scontrol show hostnames` prints.

    Grammar (Slurm's hostlist.c): hosts separated by commas or whitespace outside brackets; a host is a
    name, or a prefix and one bracket group at its end, "node[01-04,07]"; a bracket group holds ranges
    "lo" or "lo-hi" separated by commas, each zero-padded to the width of its own "lo" ("[08-11]" gives
    08 09 10 11, "[8-11]" gives 8 9 10 11, "[1-010]" gives 1..10). The prefix may hold bracket groups
    of its own, "rack[1-2]-n[1-2]"; Slurm expands the prefix's last group outermost and then the groups
    before it, the last group of the whole host innermost (rack[1-2]-n[1-2] gives rack1-n1 rack1-n2
    rack2-n1 rack2-n2). Text after the last group, an empty group, a range whose lo exceeds its hi, one
    of more than MAX_HOSTS_IN_RANGE hosts or an unmatched bracket: ValueError."""
    hosts: list[str] = []
    for token in _tokens(hostlist):
        if "[" not in token and "]" not in token:
            hosts.append(token)
            continue
        opening = token.rfind("[")
        if opening < 0 or not token.endswith("]") or token.find("]", opening) != len(token) - 1:
            raise ValueError(f"host list {hostlist!r}: {token!r} is not name[ranges] (a bracket group ends a "
                             f"host: text after it, or an unmatched bracket, is not a Slurm host list)")
        hosts.extend(_expand_prefix(token[:opening], _numbers(token[opening + 1:-1], hostlist), hostlist))
    return hosts


def _tokens(hostlist: str) -> list[str]:
    """The hosts of ``hostlist``: split at commas and whitespace outside brackets."""
    tokens, current, depth = [], [], 0
    for char in hostlist:
        if char in ", \t\n" and depth == 0:
            if current:
                tokens.append("".join(current))
            current = []
            continue
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {hostlist!r}: brackets inside brackets")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {hostlist!r}: ']' without its '['")
        elif char.isspace():
            raise ValueError(f"host list {hostlist!r}: whitespace inside brackets")
        current.append(char)
    if depth:
        raise ValueError(f"host list {hostlist!r}: '[' without its ']'")
    if current:
        tokens.append("".join(current))
    return tokens


def _numbers(ranges: str, hostlist: str) -> list[str]:
    """The zero-padded numbers a bracket group's ranges name, in order ("01-03,7" -> 01 02 03 7)."""
    numbers = []
    for part in ranges.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise ValueError(f"host list {hostlist!r}: range {part!r} is not N or N-M (decimal digits)")
        lo, hi = int(match[1]), int(match[2]) if match[2] else int(match[1])
        if lo > hi:
            raise ValueError(f"host list {hostlist!r}: range {part!r} runs backwards")
        if hi - lo + 1 > MAX_HOSTS_IN_RANGE:
            raise ValueError(f"host list {hostlist!r}: range {part!r} names more than {MAX_HOSTS_IN_RANGE} hosts")
        width = len(match[1])
        numbers.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return numbers


def _expand_prefix(prefix: str, numbers: list[str], hostlist: str) -> list[str]:
    """prefix + each of ``numbers``, the prefix's own bracket groups expanded in Slurm's order (the
    prefix's last group outermost, then recursively the groups before it)."""
    opening = prefix.rfind("[")
    if opening < 0:
        return [prefix + n for n in numbers]
    closing = prefix.index("]", opening)   # _tokens checked that every '[' is closed
    hosts = []
    for value in _numbers(prefix[opening + 1:closing], hostlist):
        hosts.extend(_expand_prefix(prefix[:opening] + value + prefix[closing + 1:], numbers, hostlist))
    return hosts


def tasks_per_node(text: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE expanded: "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"tasks per node {text!r}: {part!r} is not N or N(xK)")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts


def port_for(job_id: int, step_id: int) -> int:
    """The rendezvous port of a step: the job id picks one of 1,024 blocks of 16 ports from PORT_BASE, the
    step id a port in it. Every task of the step computes the same; two steps of one job running at once
    get different ports (up to 16 apart), and two jobs only meet on one if their ids are equal modulo
    1,024 and they share a first node. MASTER_PORT overrides it."""
    return PORT_BASE + (job_id % 1024) * 16 + step_id % 16


# -- the environment ----------------------------------------------------------------------------------


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Slurm's {name}={value!r} is not an integer") from None


def _first(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """(name, value) of the first of ``names`` that is set and not empty."""
    return next(((n, environ[n]) for n in names if environ.get(n, "").strip()), None)


def world_from_env(environ: Mapping[str, str] | None = None) -> SlurmWorld | None:
    """This task's world in its srun step, from Slurm's variables (see the module docstring); None where
    Slurm describes no world of several tasks; ValueError naming what was found where it describes one
    partly."""
    env = os.environ if environ is None else environ
    tasks = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    procid = _int(env, "SLURM_PROCID")
    job = job_id(env) or "?"
    if tasks is None:
        if procid is not None:
            raise ValueError(f"Slurm job {job}: SLURM_PROCID={procid} is set but not SLURM_NTASKS (nor "
                             f"SLURM_STEP_NUM_TASKS): cannot tell the world size; start one rank per task with srun")
        return None
    tasks_name, world_size = tasks[0], _int(env, tasks[0])
    if procid is None:
        if world_size > 1:
            raise ValueError(f"Slurm job {job} has {tasks_name}={world_size} but this process has no SLURM_PROCID: "
                             f"it is not one of the job's tasks (an salloc shell?); start one rank per task with srun")
        return None
    step_name = next((n for n in ("SLURM_STEP_ID", "SLURM_STEPID") if n in env), None)
    step_id = _int(env, step_name) if step_name else None
    if step_id is None or step_id >= SPECIAL_STEPS:
        if world_size > 1:
            where = "no SLURM_STEP_ID" if step_id is None else f"{step_name}={step_id}, one of Slurm's own steps"
            raise ValueError(f"this process is Slurm job {job}'s batch script or shell (SLURM_PROCID={procid}, "
                             f"{where}): one process of a job of {tasks_name}={world_size} tasks; start one rank per task with "
                             f"srun (srun python ... / srun gradsync train ...)")
        return None
    if world_size < 1 or not 0 <= procid < world_size:
        raise ValueError(f"Slurm step {job}.{step_id}: SLURM_PROCID={procid} is not in 0..{world_size - 1} "
                         f"({tasks_name}={world_size})")
    if world_size == 1:
        return None
    layout = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    nodes = _first(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    missing = [name for name in ("SLURM_LOCALID", "SLURM_NODEID") if _int(env, name) is None]
    missing += [] if layout else ["SLURM_STEP_TASKS_PER_NODE"]
    missing += [] if nodes else ["SLURM_STEP_NODELIST"]
    missing += [] if job != "?" else ["SLURM_JOB_ID"]
    if missing:
        raise ValueError(f"Slurm step {job}.{step_id} has {tasks_name}={world_size} tasks (this one SLURM_PROCID="
                         f"{procid}) but no {', '.join(missing)}: cannot place this rank")
    local_rank, node_id = _int(env, "SLURM_LOCALID"), _int(env, "SLURM_NODEID")
    counts = tasks_per_node(layout[1])
    if sum(counts) != world_size or not 0 <= node_id < len(counts) or not 0 <= local_rank < counts[node_id]:
        raise ValueError(f"Slurm step {job}.{step_id}: {layout[0]}={layout[1]!r} ({sum(counts)} tasks on "
                         f"{len(counts)} nodes) does not fit {tasks_name}={world_size}, SLURM_NODEID={node_id}, "
                         f"SLURM_LOCALID={local_rank}")
    hosts = expand_hostlist(nodes[1])
    if len(hosts) != len(counts):
        raise ValueError(f"Slurm step {job}.{step_id}: {nodes[0]}={nodes[1]!r} names {len(hosts)} node(s) but "
                         f"{layout[0]}={layout[1]!r} gives tasks for {len(counts)}")
    number = _int(env, "SLURM_JOB_ID" if env.get("SLURM_JOB_ID") else "SLURM_JOBID")
    return SlurmWorld(rank=procid, world_size=world_size, local_rank=local_rank, local_world_size=counts[node_id],
                      master_addr=hosts[0], master_port=port_for(number, step_id), job_id=number, step_id=step_id)


def step_torchrun_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """For a program that is one rank per task (`srun gradsync train`): torchrun's variables for this task's
    world, leaving any of them already set as they are ({} where torchrun's RANK or WORLD_SIZE is set, and
    outside an srun step of several tasks: the batch script and an salloc shell start gradsync's own
    launcher there, as on any machine)."""
    env = os.environ if environ is None else environ
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip()
    if "RANK" in env or "WORLD_SIZE" in env or not step.isdigit() or int(step) >= SPECIAL_STEPS:
        return {}
    world = world_from_env(env)
    if world is None:
        return {}
    return {name: value for name, value in world.torchrun_env().items() if not env.get(name)}


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """SLURM_JOB_ID (SLURM_JOBID on old releases), None outside a Slurm job."""
    env = os.environ if environ is None else environ
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None
