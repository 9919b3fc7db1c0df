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
surviving agents then leave as soon as the last of them has checked in. Should a gone node's agent
check in after all (its worker came back and found the run over), the count passes the node count; the
barrier only waits for the key, which is set already.

Keys (torchrun's static rendezvous, the one its --master-addr/--master-port set up: its agents' store is
the job's store under the prefix TORCHELASTIC_RUN_ID):
    <run id>/torchelastic/agent/terminal_state/num_members     the counter
    <run id>/torchelastic/agent/terminal_state/last_member     set when the counter reaches the node count
"""

from __future__ import annotations

import os

TERMINAL_STATE = "torchelastic/agent/terminal_state"
"""torch.distributed.elastic.agent.server.api._TERMINAL_STATE_SYNC_ID."""


def _agents_key(name: str) -> str | None:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return f"{run_id}/{TERMINAL_STATE}/{name}"


def gone_nodes(nodes_here: set[str]) -> int:
    """How many of torchrun's nodes (GROUP_WORLD_SIZE) have no member in ``nodes_here`` (their GROUP_RANKs);
    0 outside torchrun."""
    try:
        nodes = int(os.environ["GROUP_WORLD_SIZE"])
    except (KeyError, ValueError):
        return 0
    return nodes - len({n for n in nodes_here if n != ""})


def check_in_for_gone_nodes(store, nodes_here: set[str]) -> int:
    """Raise the agents' exit-barrier counter once per gone node (module docstring) on ``store``, a
    BoundedStore of the job's store whose underlying client has the agents' keys without a prefix of
    gradsync's (the worker's attempt prefix is torchrun's own, /worker/attempt_<n>: the agents' keys are
    beside it, reached through the client underneath); returns how many it checked in for."""
    gone = gone_nodes(nodes_here)
    count_key, last_key = _agents_key("num_members"), _agents_key("last_member")
    if gone <= 0 or count_key is None:
        return 0
    raw = store.store
    agents = raw.underlying_store if hasattr(raw, "underlying_store") else raw
    count = store.call(f"add {count_key}", agents.add, count_key, gone)
    if count >= int(os.environ["GROUP_WORLD_SIZE"]):
        store.call(f"set {last_key}", agents.set, last_key, "<val_ignored>", answered=False)
    return gone
