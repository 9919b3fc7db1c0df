"""Rank functions for the live fault-tolerance tests (module level: child processes import them)."""

import os
import signal
from pathlib import Path

import torch

import gradsync as gs
from gradsync.data import EpochCursor
from gradsync.live import LiveDDP

N_SAMPLES, FEATURES, GLOBAL_BATCH, LR, MOMENTUM = 60, 5, 6, 0.05, 0.9


def dataset(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, FEATURES, generator=g, dtype=torch.float64)
    y = x @ torch.linspace(-1, 1, FEATURES, dtype=torch.float64) + 0.1 * torch.randn(N_SAMPLES, generator=g,
                                                                                      dtype=torch.float64)
    return x, y.unsqueeze(1)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


def keep_global_step(live, cursor, x, y, trained: dict):
    """The keep-global recipe's train_step for LiveDDP.run_step: this rank's share of the step at the live
    progress, its loss a sum of per-sample losses x W / G (the ranks' average is the step's mean loss);
    the ids it trained go to ``trained`` under the step they make."""
    def train_step(ddp):
        epoch, position = live.progress["epoch"], live.progress["position"]
        w = live.world
        share = cursor.share(cursor.order(epoch), position, w.world_size, w.rank)
        step_size = cursor.step_size(position)
        loss = ((ddp(x[share]) - y[share]) ** 2).sum() * (w.world_size / step_size)
        loss.backward()
        trained[live.step + 1] = share
        position += step_size
        return {"epoch": epoch + 1, "position": 0} if position >= cursor.n else {"epoch": epoch, "position": position}

    return train_step


def train_with_a_kill(victim: int, kill_step: int, epochs: int, log_dir: str, steps_before_growth: int | None = None
                      ) -> dict:
    """Train ``epochs`` epochs of the keep-global recipe with LiveDDP; member ``victim`` SIGKILLs itself
    in step ``kill_step`` (0-based, after its forward, before its backward). Every member appends the
    sample ids of each step it committed to log_dir/samples.<member> (and its pid to
    log_dir/pid.<member>), so a dead member's steps count too. ``steps_before_growth``: after that many
    steps in the shrunk world, the members wait (at most 60 s) for a replacement to ask to join, so it
    joins before the run ends (the replacement, member 3 under gs.spawn(replacements=1), runs this too)."""
    x, y = dataset()
    module = model()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    live = LiveDDP(module, optimizer, bucket_cap_mb=1, progress={"epoch": 0, "position": 0})
    cursor = EpochCursor(N_SAMPLES, GLOBAL_BATCH, seed=0)
    total = epochs * cursor.steps_from(0)
    trained: dict[int, list[int]] = {}
    world_sizes = []
    (Path(log_dir) / f"pid.{live.member}").write_text(str(os.getpid()))
    log = open(Path(log_dir) / f"samples.{live.member}", "a", buffering=1)  # noqa: SIM115 - the victim never closes it

    def train_step(ddp):
        epoch, position = live.progress["epoch"], live.progress["position"]
        w = live.world
        share = cursor.share(cursor.order(epoch), position, w.world_size, w.rank)
        step_size = cursor.step_size(position)
        out = ddp(x[share])
        if live.member == victim and live.step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        # sum of per-sample losses x W / G: the ranks' average is the step's mean loss
        loss = ((out - y[share]) ** 2).sum() * (w.world_size / step_size)
        loss.backward()
        trained[live.step + 1] = share
        position += step_size
        return {"epoch": epoch + 1, "position": 0} if position >= cursor.n else {"epoch": epoch, "position": position}

    fds = {}
    since_change = 0   # steps committed since the world last changed
    while live.step < total:
        if live.step == kill_step:   # open descriptors before the kill and at the end
            fds.setdefault("before", len(os.listdir("/proc/self/fd")))
        shrunk = live.recoveries and not live.recoveries[-1].joined
        if steps_before_growth is not None and shrunk and since_change == steps_before_growth:
            live.await_joiner(60.0)
        since_change += 1
        if not live.run_step(train_step):
            since_change = 0
        else:
            log.write(f"{live.step} {' '.join(map(str, trained[live.step]))}\n")
            world_sizes.append(live.world.world_size)
    live.check_replicas()
    live.close()
    log.close()
    fds["after"] = len(os.listdir("/proc/self/fd"))
    return {"member": live.member, "rank": live.world.rank, "world_size": live.world.world_size,
            "params": [p.detach().clone() for p in module.parameters()],
            "recoveries": [r.__dict__ for r in live.recoveries], "world_sizes": world_sizes, "fds": fds}


def train_with_a_pause(victim: int, pause_step: int, seconds: float, epochs: int, log_dir: str,
                       min_workers: int | None = None) -> dict:
    """train_with_a_kill's recipe, where member 0, as it starts step ``pause_step`` (0-based), stops member
    ``victim`` with SIGSTOP and continues it with SIGCONT ``seconds`` later: a member that goes silent
    while its process lives (its heartbeat stops with it), as a host cut off by the network does, and comes
    back. After two steps in the shrunk world the others wait (at most 60 s) until it asks to join again,
    so that it rejoins a short run before it ends. Each member appends "<step> <ids>" of every step it
    committed to log_dir/samples.<member>, and member 0 the monotonic times of the stop, the continue and
    each change of its world's size to log_dir/sizes.0."""
    import threading
    import time

    x, y = dataset()
    module = model()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    live = LiveDDP(module, optimizer, bucket_cap_mb=1, progress={"epoch": 0, "position": 0}, admit_joiners=False,
                   min_workers=min_workers)
    cursor = EpochCursor(N_SAMPLES, GLOBAL_BATCH, seed=0)
    total = epochs * cursor.steps_from(0)
    trained: dict[int, list[int]] = {}
    world_sizes = []
    (Path(log_dir) / f"pid.{live.member}").write_text(str(os.getpid()))
    log = open(Path(log_dir) / f"samples.{live.member}", "a", buffering=1)  # noqa: SIM115
    sizes = open(Path(log_dir) / f"sizes.{live.member}", "a", buffering=1)  # noqa: SIM115

    train_step = keep_global_step(live, cursor, x, y, trained)

    paused, since_change = False, 0
    while live.step < total:
        shrunk = live.recoveries and not live.recoveries[-1].joined
        if shrunk and since_change == 2:
            live.await_joiner(60.0)
        since_change += 1
        if live.member == 0 and live.step == pause_step and not paused:
            paused = True
            pid = int((Path(log_dir) / f"pid.{victim}").read_text())
            os.kill(pid, signal.SIGSTOP)
            sizes.write(f"stopped {time.monotonic()}\n")
            threading.Timer(seconds, lambda: (os.kill(pid, signal.SIGCONT),
                                              sizes.write(f"continued {time.monotonic()}\n"))).start()
        size = live.world.world_size
        if live.run_step(train_step):
            log.write(f"{live.step} {' '.join(map(str, trained[live.step]))}\n")
            world_sizes.append(live.world.world_size)
        else:
            since_change = 0
        if live.world.world_size != size and live.member == 0:
            sizes.write(f"{live.world.world_size} {time.monotonic()}\n")
    live.check_replicas()
    live.close()
    log.close()
    return {"member": live.member, "rank": live.world.rank, "world_size": live.world.world_size,
            "params": [p.detach().clone() for p in module.parameters()],
            "recoveries": [r.__dict__ for r in live.recoveries], "world_sizes": world_sizes}


def train_where_the_first_replacement_dies_joining(log_dir: str) -> dict:
    """train_with_a_kill (member 0 dies in step 4; the members wait for a joiner after 2 steps), where
    member 3, the first replacement, SIGKILLs itself as the state transfer to it begins."""
    from gradsync.group import runtime
    from gradsync.live import transfer

    replacement = runtime.replacement()
    if replacement is not None and replacement[0] == 3:
        transfer.share_state = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    return train_with_a_kill(0, 4, 2, log_dir, 2)


def void_steps(recoveries: list[dict]) -> dict[int, tuple[int, int]]:
    """Per member a survivor saw leave and rejoin, the steps (R, J] it did not train with the others: from
    the step R the survivors resumed from without it to the step J at which it rejoined (a survivor's
    Recovery records, in order). Its own lines for them, written before it was left out (a step it
    committed alone, or began), are not the job's."""
    void, left = {}, {}
    for record in recoveries:
        for member in record["lost"]:
            left[member] = record["step"]
        for member in record["joined"]:
            if member in left:
                void[member] = (left.pop(member), record["step"])
    return void


def trained_ids(ids_dir: Path, lost: list[int], resumed_from: int,
                void: dict[int, tuple[int, int]] | None = None) -> dict[int, list[int]]:
    """Per epoch, the sorted sample ids of every committed step in the GRADSYNC_SAMPLE_LOG files of
    ``gradsync train --fault-tolerance live`` (train/step.py's sample log): of a step written twice (tried again
    after a recovery) the last line counts, a lost member's steps count up to ``resumed_from``, and a member
    that left and rejoined (``void``: void_steps) counts none of its steps in (R, J]."""
    last_line: dict[tuple[int, int], tuple[int, list[int]]] = {}
    for path in Path(ids_dir).glob("live.*"):
        member = int(path.name.rsplit(".m", 1)[1])
        low, high = (void or {}).get(member, (0, -1))
        for line in path.read_text().splitlines():
            step, epoch, *ids = map(int, line.split())
            if (member not in lost or step <= resumed_from) and not low < step <= high:
                last_line[member, step] = (epoch, ids)
    by_epoch: dict[int, list[int]] = {}
    for epoch, ids in last_line.values():
        by_epoch.setdefault(epoch, []).extend(ids)
    return {epoch: sorted(ids) for epoch, ids in by_epoch.items()}


def samples_by_step(ids_dir: Path, lost: list[int], resumed_from: int) -> dict[int, tuple[int, list[int]]]:
    """Per committed step, (its epoch, the sorted sample ids every member trained in it), read from the
    GRADSYNC_SAMPLE_LOG files as trained_ids() reads them (the last line of a step a member wrote twice;
    a lost member's steps up to ``resumed_from``)."""
    last_line: dict[tuple[int, int], tuple[int, list[int]]] = {}
    for path in Path(ids_dir).glob("live.*"):
        member = int(path.name.rsplit(".m", 1)[1])
        for line in path.read_text().splitlines():
            step, epoch, *ids = map(int, line.split())
            if member not in lost or step <= resumed_from:
                last_line[member, step] = (epoch, ids)
    by_step: dict[int, tuple[int, list[int]]] = {}
    for (_, step), (epoch, ids) in last_line.items():
        before = by_step.get(step, (epoch, []))
        assert before[0] == epoch, f"step {step} logged in epochs {before[0]} and {epoch}"
        by_step[step] = (epoch, before[1] + ids)
    return {step: (epoch, sorted(ids)) for step, (epoch, ids) in sorted(by_step.items())}


def bytes_of_steps(admit_joiners: bool, steps: int = 3) -> int:
    """Bytes this rank sent in ``steps`` steps of LiveDDP on the recipe's model, full batch, after two
    uncounted steps."""
    x, y = dataset()
    module = model()
    live = LiveDDP(module, torch.optim.SGD(module.parameters(), lr=LR), bucket_cap_mb=1, admit_joiners=admit_joiners)
    for step in range(2 + steps):   # after two steps: the buckets are rebuilt once (rank 0 sends the order)
        if step == 2:
            gs.traffic_reset()
        live.run_step(lambda ddp: ((ddp(x) - y) ** 2).mean().backward() or {})
    sent = gs.traffic()["bytes_sent"]
    live.close()
    return sent


def train_through_breaks(breaks: dict, epochs: int, quorum_timeout: float) -> dict:
    """Train ``epochs`` epochs of the keep-global recipe with LiveDDP (no sample log) through the breaks
    planned in ``breaks``: {step: (what, members, seconds)}, each done once, in step ``step`` (0-based):

        "die"      the members SIGKILL themselves after their forward, before their backward
        "stall"    the members sleep ``seconds`` after their forward (past the world's timeout: the others'
                   collectives time out while the sleepers are alive)
        "declare"  the members, alive and well, end the generation before the step: live.recover()

    Returns this member's id, rank, the recoveries (Recovery fields), the world size of every committed
    step and the final parameters."""
    import time

    x, y = dataset()
    module = model()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    live = LiveDDP(module, optimizer, bucket_cap_mb=1, quorum_timeout=quorum_timeout,
                   progress={"epoch": 0, "position": 0})
    cursor = EpochCursor(N_SAMPLES, GLOBAL_BATCH, seed=0)
    total = epochs * cursor.steps_from(0)
    pending = {step: plan for step, plan in breaks.items() if live.member in plan[1]}

    def train_step(ddp):
        epoch, position = live.progress["epoch"], live.progress["position"]
        w = live.world
        share = cursor.share(cursor.order(epoch), position, w.world_size, w.rank)
        step_size = cursor.step_size(position)
        out = ddp(x[share])
        what, _, seconds = pending.pop(live.step, (None, (), 0.0))
        if what == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if what == "stall":
            time.sleep(seconds)
        loss = ((out - y[share]) ** 2).sum() * (w.world_size / step_size)
        loss.backward()
        position += step_size
        return {"epoch": epoch + 1, "position": 0} if position >= cursor.n else {"epoch": epoch, "position": position}

    world_sizes = []
    while live.step < total:
        if pending.get(live.step, ("",))[0] == "declare":
            del pending[live.step]
            live.recover(f"member {live.member} declares generation {live.membership.current.index} broken")
        if live.run_step(train_step):
            world_sizes.append(live.world.world_size)
    live.check_replicas()
    live.close()
    return {"member": live.member, "rank": live.world.rank, "world_sizes": world_sizes,
            "params": [p.detach().clone() for p in module.parameters()],
            "recoveries": [r.__dict__ for r in live.recoveries]}


def train_past_a_collective(steps: int) -> dict:
    """train_with_a_kill's recipe for ``steps`` steps, where after step 2 member 2 dies at the boundary and the
    two others stand where a ring all-reduce can leave them when a peer is lost in it: member 1 has finished
    the boundary's collective (it goes on to step 3), member 0 is still in it (LiveDDP.collective, a 2-element
    all-reduce as train/preempt.py's verdict is). Returns how often member 0 ran that collective and whether
    it was sent back to training (StepUndone)."""
    from gradsync.live.failures import StepUndone

    x, y = dataset()
    module = model()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    live = LiveDDP(module, optimizer, bucket_cap_mb=1, progress={"epoch": 0, "position": 0})
    cursor = EpochCursor(N_SAMPLES, GLOBAL_BATCH, seed=0)
    calls, undone = [], False

    def verdict():
        calls.append(live.world.world_size)
        return gs.all_reduce(torch.zeros(2, dtype=torch.int64), op="max")

    train_step = keep_global_step(live, cursor, x, y, {})

    while live.step < steps:
        if live.step == 2 and not live.recoveries:
            if live.member == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            if live.member == 0:
                try:
                    live.collective(verdict)
                except StepUndone:
                    undone = True
        live.run_step(train_step)
    live.check_replicas()
    live.close()
    return {"member": live.member, "step": live.step, "world_size": live.world.world_size, "calls": calls,
            "undone": undone, "recoveries": [r.__dict__ for r in live.recoveries],
            "params": [p.detach().clone() for p in module.parameters()]}


def train_two_collectives_apart(steps: int) -> dict:
    """train_with_a_kill's recipe for ``steps`` steps, where after step 2 member 2 dies at the boundary and
    the two others stand one collective apart, as a ring all-reduce can leave them when a peer is lost in it:
    member 1 has finished the first collective outside the step (a verdict; in the old world it ended on
    member 1 before the death, here by returning at once) and is in the second (statistics), member 0 is
    still in the first. Both are 2-element int64 sums, so run against each other they would not fail: they
    would mix. Returns each collective's (world size, result) on this member and its recoveries."""
    x, y = dataset()
    module = model()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    live = LiveDDP(module, optimizer, bucket_cap_mb=1, progress={"epoch": 0, "position": 0})
    cursor = EpochCursor(N_SAMPLES, GLOBAL_BATCH, seed=0)
    seen: dict[str, list] = {"verdict": [], "statistics": []}
    train_step = keep_global_step(live, cursor, x, y, {})
    while live.step < steps:
        if live.step == 2 and not live.recoveries:
            if live.member == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            two_collectives(live, seen, ahead=1)
        live.run_step(train_step)
    live.check_replicas()
    live.close()
    return {"member": live.member, "step": live.step, "world_size": live.world.world_size, "seen": seen,
            "recoveries": [r.__dict__ for r in live.recoveries],
            "params": [p.detach().clone() for p in module.parameters()]}


def two_collectives(live, seen: dict[str, list], ahead: int) -> None:
    """Two collectives in a row through live.collective, each a 2-element int64 sum of this member's values
    (a verdict [m + 1, 10 (m + 1)], then statistics [100 (m + 1)] x 2), each call's (world size, result)
    appended to seen[name]. On member ``ahead`` the first verdict returns at once: it ended there in the old
    world, as a ring all-reduce can end on one rank before a peer is lost."""
    def summed(name: str, values: list[int]):
        if name == "verdict" and live.member == ahead and not seen[name]:
            seen[name].append((live.world.world_size, None))
            return None
        t = torch.tensor(values, dtype=torch.int64)
        gs.all_reduce(t, op="sum")
        seen[name].append((live.world.world_size, t.tolist()))
        return t

    live.collective(lambda: summed("verdict", [live.member + 1, 10 * (live.member + 1)]))
    live.collective(lambda: summed("statistics", [100 * (live.member + 1)] * 2))
