"""KV slots for the socket-free fakes of an EngineClient (replica.kv_slots): a real segment, mapped
as an engine's Hello would have it, and the lease discipline of EngineClient.kv_call."""

from __future__ import annotations

import os
from contextlib import contextmanager

from replica.kv_slots import Lease, Slots


def mapped_slots(block_bytes: int, count: int = 4, slot_blocks: int = 8) -> Slots:
    """A segment of `count` slots of `slot_blocks` blocks, sized (the engine's part) and mapped."""
    slots = Slots()
    os.ftruncate(slots.fd, count * slot_blocks * block_bytes)
    slots.mapped(count, slot_blocks * block_bytes)
    return slots


@contextmanager
def engine_holds(lease: Lease | None):
    """The slot is the engine's from the command's send to its answer (EngineClient.kv_call and _dispatch)."""
    if lease is not None:
        lease.sent()
    try:
        yield
    finally:
        if lease is not None:
            lease.answered()
