"""torchrun's exit barrier, when a node is gone: the live job checks in for it.

A torchrun agent whose workers succeeded waits, before it exits, until every node's agent has said the
same: torch.distributed.elastic's exit barrier (agent/server/api.py ``_exit_barrier``), a counter on the
rendezvous store that each agent raises by one, and a key the last one sets. Its timeout is 300 s and
torchrun has no flag or setting for it (LocalElasticAgent's ``exit_barrier_timeout`` is not reachable from
the command line). An agent whose node was lost, or whose workers failed, never raises the counter, so
after a live job trained on without a node the surviving agents waited the full 300 s before exiting.

The live job knows which nodes are gone: at its end, rank 0 of the final world raises the counter once
for every node none of whose members is in that world (they will not check in: their workers died, were
left out and stopped, or their agent is gone), and sets the last key if that completes the count. The
surviving agents then leave as soon as the last of them has checked in.

The count must be exact: the agent of the store's node leaves once the last key is set, and the store
with it, so a count complete too early leaves an agent still to check in facing a closed store (an
error in its log). A gone node's worker may come back, left out by a partition that healed after the
run ended, and find the run over: then its agent checks in after all. So each gone node's fate is
settled once, by compare_set on one key: rank 0 sets it to "counted" and checks in for the node, or the
returning worker sets it to "own" first and its agent checks in itself (claim_own_check_in). A worker
that finds its node counted exits non-zero (failures.EXIT_LOST_CONTACT): its agent then reports a failed
group and does not check in.

Keys (torchrun's static rendezvous, the one its --master-addr/--master-port set up: its agents' store is
the job's store under the prefix TORCHELASTIC_RUN_ID):
    <run id>/torchelastic/agent/terminal_state/num_members     the counter
    <run id>/torchelastic/agent/terminal_state/last_member     set when the counter reaches the node count
    gradsync/agent_barrier/node/<GROUP_RANK>                  "counted" or "own" (gradsync's, the job's store)
"""

from __future__ import annotations

import os

TERMINAL_STATE = "torchelastic/agent/terminal_state"
"""torch.distributed.elastic.agent.server.api._TERMINAL_STATE_SYNC_ID."""
FATE = "gradsync/agent_barrier/node"
"""f"{FATE}/{node}": who checks in for a gone node (module docstring)."""


def _agents_key(name: str) -> str | None:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return f"{run_id}/{TERMINAL_STATE}/{name}"


def _agents(store):
    """The client underneath ``store`` (a BoundedStore), which reaches the agents' keys without a prefix of
    gradsync's."""
    raw = store.store
    return raw.underlying_store if hasattr(raw, "underlying_store") else raw


def gone_nodes(nodes_here: set[str]) -> list[str]:
    """torchrun's nodes (GROUP_RANKs 0 .. GROUP_WORLD_SIZE - 1) with no member in ``nodes_here``; none
    outside torchrun."""
    try:
        nodes = int(os.environ["GROUP_WORLD_SIZE"])
    except (KeyError, ValueError):
        return []
    return [str(n) for n in range(nodes) if str(n) not in nodes_here]


def check_in_for_gone_nodes(store, nodes_here: set[str]) -> int:
    """Raise the agents' exit-barrier counter once per gone node whose worker has not come back for it
    (module docstring) on ``store``, a BoundedStore of the job's store whose underlying client has the
    agents' keys without a prefix of gradsync's (the worker's attempt prefix is torchrun's own,
    /worker/attempt_<n>: the agents' keys are beside it, reached through the client underneath); returns
    how many it checked in for."""
    count_key, last_key = _agents_key("num_members"), _agents_key("last_member")
    if count_key is None:
        return 0
    agents = _agents(store)
    counted = [node for node in gone_nodes(nodes_here)
               if store.call(f"compare_set {FATE}/{node}", agents.compare_set, f"{FATE}/{node}", "", "counted")
               == b"counted"]
    if not counted:
        return 0
    count = store.call(f"add {count_key}", agents.add, count_key, len(counted))
    if count >= int(os.environ["GROUP_WORLD_SIZE"]):
        store.call(f"set {last_key}", agents.set, last_key, "<val_ignored>", answered=False)
    return len(counted)


def claim_own_check_in(store) -> bool:
    """A worker that came back to a finished run: whether its agent may check in at the exit barrier
    itself (True; rank 0 will not count its node now), or rank 0 counted its node already (False: exit
    non-zero, so that the agent does not check in a second time). True outside torchrun. ``store``: as
    check_in_for_gone_nodes'."""
    node = os.environ.get("GROUP_RANK")
    if node is None or _agents_key("num_members") is None:
        return True
    agents = _agents(store)
    return store.call(f"compare_set {FATE}/{node}", agents.compare_set, f"{FATE}/{node}", "", "own") == b"own"
