"""Worker side of the parameter server: pull parameters, push gradients, close.

    pull()    one PULL header to every server, then from each: PARAMS header + payload, written into
              the model's parameters. Blocks while the server's consistency model holds the answer
              back (sync: until every worker pushed; ssp: while this worker is too far ahead).
    push()    from each server's pieces of the gradients: PUSH header (the version the gradient was
              computed on, a checksum) + payload. Then the gradients are cleared (set to None), as
              optimizer.zero_grad() would; a parameter without a gradient pushes zeros.
    close()   CLOSE to every server, then wait for each one's BYE.

A server that stopped on an error sends ABORT; the next pull() or close() raises ServerAbortedError
naming the rank at fault. A server that stops answering gives a PeerError after the timeout.
"""

from __future__ import annotations

import time

import torch

from gradsync.comm.transport import PeerError, Transport
from gradsync.ps import protocol as wire
from gradsync.ps.protocol import Header, ProtocolError, ServerAbortedError
from gradsync.ps.sharding import ShardPlan, gather_shard, scatter_shard


class Client:
    """One worker's view of the S servers."""

    def __init__(self, transport: Transport, plan: ShardPlan, params: list[torch.Tensor], mode: str,
                 channel: wire.Channel) -> None:
        self.transport = transport
        self.channel = channel
        self.rank = transport.rank
        self.plan = plan
        self.params = params
        self.mode = mode
        dtype = params[0].dtype
        self.servers = list(range(len(plan.pieces)))
        self.buffers = [torch.empty(n, dtype=dtype) for n in plan.shard_numels]
        self.versions = [0] * len(self.servers)   # version of each shard the model now holds
        self.clock = 0
        self.pulled_since_push = True
        self.closed = False
        self.pull_wait_seconds = 0.0
        self.push_seconds = 0.0

    def pull(self) -> None:
        self._check_open("pull")
        started = time.monotonic()
        sends = [self._send_header(s, Header(wire.PULL, self.rank, self.clock, s)) for s in self.servers]
        for server in self.servers:
            header = self._receive_header(server, expect=wire.PARAMS, op="ps/pull")
            buffer = self.buffers[server]
            if header.shard != server:
                raise ProtocolError(f"worker rank {self.rank}: server rank {server} answered for shard "
                                    f"{header.shard}", server)
            wire.check_payload_header(header, buffer.numel(), buffer.element_size(), server)
            self._wait(self.transport.irecv(buffer, server, "ps/pull", tag=self.channel.payload_tag), server)
            wire.check_payload(header, buffer, server)
            scatter_shard(buffer, self.plan.pieces[server], self.params)
            self.versions[server] = header.version
        for handle, server in zip(sends, self.servers):
            self._wait(handle, server)
        self.pulled_since_push = True
        self.pull_wait_seconds += time.monotonic() - started

    def push(self) -> None:
        self._check_open("push")
        if self.mode == "sync" and not self.pulled_since_push:
            raise RuntimeError(f"worker rank {self.rank}: push() twice without pull() in sync mode: the server "
                               f"takes one gradient per worker per version; call pull() before every push()")
        started = time.monotonic()
        grads = [p.grad for p in self.params]
        handles = []
        for server in self.servers:
            payload = gather_shard(grads, self.plan.pieces[server], self.buffers[server])
            header = Header(wire.PUSH, self.rank, self.versions[server], server, payload.numel(),
                            payload.numel() * payload.element_size(), wire.checksum(payload))
            handles.append((self._send_header(server, header), server))
            handles.append((self.transport.isend(payload, server, "ps/push", tag=self.channel.payload_tag), server))
        for handle, server in handles:
            self._wait(handle, server)
        for p in self.params:
            p.grad = None
        self.clock += 1
        self.pulled_since_push = False
        self.push_seconds += time.monotonic() - started

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        sends = [self._send_header(s, Header(wire.CLOSE, self.rank, self.clock, s)) for s in self.servers]
        for server in self.servers:
            self._receive_header(server, expect=wire.BYE, op="ps/close")
        for handle, server in zip(sends, self.servers):
            self._wait(handle, server)

    # -- helpers -----------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"worker rank {self.rank}: {what}() after close(); this worker has left the "
                               f"parameter server")

    def _send_header(self, server: int, header: Header):
        return self.transport.isend(header.encode(), server, "ps/header", control=True, tag=self.channel.header_tag)

    def _receive_header(self, server: int, expect: int, op: str) -> Header:
        buffer = wire.empty_header()
        self._wait(self.transport.irecv(buffer, server, op, control=True, tag=self.channel.header_tag), server)
        header = wire.decode(buffer, server)
        if header.kind == wire.ABORT:
            raise self._aborted(server, header)
        if header.kind != expect:
            raise ProtocolError(f"worker rank {self.rank}: expected {wire.KIND_NAMES[expect]} from server rank "
                                f"{server}, got {header.describe()}", server)
        return header

    def _aborted(self, server: int, header: Header) -> ServerAbortedError:
        culprit = header.version if header.version >= 0 else None
        why = wire.REASON_NAMES.get(header.numel, f"reason {header.numel}")
        who = f" (rank {culprit})" if culprit is not None else ""
        posted = self.channel.read_abort(wait_seconds=1.0)
        detail = f": {posted[1]}" if posted else ""
        return ServerAbortedError(f"worker rank {self.rank}: parameter server rank {server} stopped: "
                                  f"{why}{who}{detail}", culprit)

    def _wait(self, handle, server: int) -> None:
        """Wait for a transfer; if it fails, report the server's abort notice when there is one."""
        try:
            handle.wait()
        except PeerError as exc:
            posted = self.channel.read_abort(wait_seconds=5.0)
            if posted is None:
                raise
            culprit, message = posted
            raise ServerAbortedError(f"worker rank {self.rank}: a parameter server stopped: {message}",
                                     culprit) from exc

    def stats(self) -> dict:
        return {"role": "worker", "rank": self.rank, "mode": self.mode, "steps": self.clock,
                "pull_wait_seconds": self.pull_wait_seconds, "push_seconds": self.push_seconds}
