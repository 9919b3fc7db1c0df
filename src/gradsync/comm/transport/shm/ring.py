"""Ring: the single-producer single-consumer byte ring that carries one ordered pair's messages.

Vocabulary
    C        capacity in bytes, a multiple of FRAME
    head     bytes the sender has ever written (only the sender stores it)
    tail     bytes the receiver has ever consumed (only the receiver stores it)
    free     C - (head - tail): what the sender may write now; position = counter mod C
    frame    one message: a FRAME-byte header (magic, payload bytes, per-pair sequence) and the
             payload, padded to FRAME bytes. head and tail only ever move by whole FRAME units
             (except inside a frame, where they move by what fitted, still a FRAME multiple), so
             every header lies whole at an aligned position and every payload piece starts
             aligned for any dtype's view.

Ordering: the sender writes payload bytes, then stores head; the receiver reads head, then the
bytes below it. Aligned 8-byte stores are atomic on x86-64 and stores are seen in program order
(total store order), so a receiver that sees a head value sees every byte under it (doorbell.py
says where this is checked).

The ring knows nothing of peers or waiting: ``write`` and ``read`` move what fits now and report
whether anything moved, so the transport (progress.py) knows whom to wake.
"""

from __future__ import annotations

import ctypes
import mmap
import struct

import torch

FRAME = 64
"""Frame header and alignment, bytes."""
MAGIC = 0x6753484D  # "gSHM"
HEADER = struct.Struct("qqq")  # magic, payload bytes, sequence


def round_up(nbytes: int) -> int:
    """``nbytes`` rounded up to whole frames."""
    return (nbytes + FRAME - 1) // FRAME * FRAME


def slot_bytes(capacity: int) -> int:
    """Bytes one ring takes in a segment: head and tail on cache lines of their own, then the data."""
    return 2 * FRAME + capacity


class Ring:
    """One ordered pair's ring at offset ``base`` of the receiver's segment ``mapping``.

    A message being moved is any object with ``nbytes``, ``offset`` (bytes moved so far),
    ``header_done``, ``data`` (its bytes, uint8), ``reduce_into`` (None, or the tensor to reduce the
    payload into instead of copying it) and ``combine`` (how: reduce_ops.py).
    """

    def __init__(self, mapping: mmap.mmap, base: int, capacity: int) -> None:
        self.mapping = mapping
        self.capacity = capacity
        self.data_offset = base + 2 * FRAME
        self.head = ctypes.c_uint64.from_buffer(mapping, base)
        self.tail = ctypes.c_uint64.from_buffer(mapping, base + FRAME)
        self.data = torch.frombuffer(mapping, dtype=torch.uint8, count=capacity, offset=self.data_offset)
        self.sequence = 0     # frames written (sender) or accepted (receiver) so far
        self.current = None   # receiver only: the message consuming the frame at the tail

    def release(self) -> None:
        """Drop every reference into the mapping (so it can be closed)."""
        self.head = self.tail = self.data = None

    # sender
    def write(self, message) -> tuple[bool, bool]:
        """Write as much of ``message`` as fits, header first: (anything written, all of it written)."""
        head = start = self.head.value
        free = self.capacity - (head - self.tail.value)
        if not message.header_done:
            if free < FRAME:
                return False, False
            HEADER.pack_into(self.mapping, self.data_offset + head % self.capacity, MAGIC, message.nbytes,
                             self.sequence)
            self.sequence += 1
            message.header_done = True
            head += FRAME
            free -= FRAME
        while message.offset < message.nbytes and free > 0:
            pos = head % self.capacity
            take = min(free, message.nbytes - message.offset, self.capacity - pos)
            self.data[pos:pos + take].copy_(message.data[message.offset:message.offset + take])
            message.offset += take
            head += round_up(take)
            free = self.capacity - (head - self.tail.value)
        if head != start:
            self.head.value = head
        return head != start, message.offset == message.nbytes

    # receiver
    def has_header(self) -> bool:
        """True when a whole frame header waits at the tail."""
        return self.head.value - self.tail.value >= FRAME

    def accept(self, message) -> str | None:
        """Take the header at the tail for ``message``; None, or what was wrong with the frame."""
        tail = self.tail.value
        magic, nbytes, sequence = HEADER.unpack_from(self.mapping, self.data_offset + tail % self.capacity)
        if magic != MAGIC or sequence != self.sequence:
            return f"a corrupt frame (magic {magic:#x}, sequence {sequence}, expected {self.sequence})"
        if nbytes != message.nbytes:
            return f"{nbytes} bytes"
        self.sequence += 1
        self.tail.value = tail + FRAME
        self.current = message
        return None

    def read(self, message) -> tuple[bool, bool]:
        """Copy (or add) what has arrived of ``message``'s payload: (anything read, all of it read)."""
        head, tail = self.head.value, self.tail.value
        start = tail
        while message.offset < message.nbytes and head > tail:
            pos = tail % self.capacity
            take = min(head - tail, message.nbytes - message.offset, self.capacity - pos)
            incoming = self.data[pos:pos + take]
            if message.reduce_into is not None:
                size = message.reduce_into.element_size()
                message.combine(message.reduce_into[message.offset // size:(message.offset + take) // size],
                                incoming.view(message.reduce_into.dtype))
            else:
                message.data[message.offset:message.offset + take].copy_(incoming)
            message.offset += take
            tail += round_up(take)
        if tail != start:
            self.tail.value = tail
        return tail != start, message.offset == message.nbytes
