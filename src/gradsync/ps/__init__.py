"""Parameter server: sync, async and SSP SGD over a sharded key space (see parameter_server.py)."""

from gradsync.ps.parameter_server import ParameterServer
from gradsync.ps.protocol import ProtocolError, ServerAbortedError
from gradsync.ps.server import WorkerLostError

__all__ = ["ParameterServer", "ProtocolError", "ServerAbortedError", "WorkerLostError"]
