"""Parameter server: sync, async and SSP SGD over a sharded key space (see parameter_server.py).

Ranks 0..S-1 serve (server.py: the loop, owning the shard at its version, versioned_shard.py, the
applying of pushes, push_applier.py, and the answers, pull_answerer.py, sent through outbox.py); the
others are workers (client.py). Why the server's loop is shaped as it is, with the measurements:
docs/studies/ps-server.md; sparse rows: docs/studies/sparse-ps-messages.md.
"""

from gradsync.ps.parameter_server import ParameterServer
from gradsync.ps.protocol import ProtocolError, ServerAbortedError
from gradsync.ps.server import WorkerLostError

__all__ = ["ParameterServer", "ProtocolError", "ServerAbortedError", "WorkerLostError"]
