"""KV frames between a replica's API process and its engine cross in shared memory, not the socket.

One segment of `count` slots, `slot_bytes` each (one export frame: SLOT_BLOCKS blocks), is an
anonymous memory file (memfd) the API process makes and hands to its engine process at spawn
(`--kv-slots-fd`); the engine sizes it from its pool's block bytes and says the geometry in its
Hello, and both map it. A KvRead names the slot the engine copies the blocks into; a KvBlocks
(API -> engine) names the slot the API process copied a checked frame into. Only the slot's
index crosses the socket, so:
  * a step boundary's KV reads cost the pool copy (1-3 ms a 3 MB frame on two cores), not
    3 MB pushed through the socket ahead of the streams' tokens (its sendall blocked 45-60 ms
    whenever the API process could not read it at once) nor a receiver's boundary waiting for
    a frame's bytes to arrive in socket-buffer chunks (docs/perf.md, drain with hand-off);
  * the API processes copy a frame once into or out of a slot instead of through two sockets.

Ownership (the invariant that keeps a slot's bytes whole): the API process lends slots
(`Slots.lease`, FIFO when none is free); a lease is free again only once both its holder let go
(`Lease.release`) and the engine answered the command that named it (`Lease.answered`, called
by EngineClient on the answer or when the engine process is gone). A caller that gives up on a
command (a cancelled export) releases its hold, but the slot stays lent until the engine's
answer: the engine may still copy into it, and a write lent the slot meanwhile would import
those bytes unchecked.

No network peer ever names a slot; it is a local handle between two processes of one replica.
An RDMA transport (replica.api.kv_transport) would register this segment once for its NIC.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import tempfile
from collections import deque

SLOT_BLOCKS = 8  # blocks a slot holds: the proxy's export frame (edge_proxy.handoff.FRAME_BLOCKS)
MAX_SLOTS = 16  # a drain's four pulls with four frames each in flight on one side
MAX_SEGMENT_BYTES = 512 << 20  # the 8B shape's 2 MB blocks: 16 slots of 16 MB, 256 MB


def geometry(block_bytes: int) -> tuple[int, int]:
    """(count, slot_bytes) of the segment for blocks of `block_bytes`: at least two slots of one block."""
    slot_bytes = SLOT_BLOCKS * block_bytes
    count = min(MAX_SLOTS, MAX_SEGMENT_BYTES // slot_bytes)
    if count < 2:
        slot_bytes = max(block_bytes, MAX_SEGMENT_BYTES // 2)
        count = 2
    return count, slot_bytes


def new_segment() -> int:
    """A file descriptor for a segment (size 0 until the engine sizes it): a memfd on Linux, else an
    unlinked temporary file. Not inheritable: the spawn passes it (subprocess's pass_fds)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("edgechat-kv-slots", os.MFD_CLOEXEC)
    fd, path = tempfile.mkstemp(prefix="edgechat-kv-slots-")
    os.unlink(path)
    return fd


class SlotMap:
    """The segment mapped in one process: slot i's first n bytes as a writable memoryview."""

    def __init__(self, fd: int, count: int, slot_bytes: int, size_it: bool = False):
        assert count >= 1 and slot_bytes >= 1
        self.count, self.slot_bytes = count, slot_bytes
        if size_it:  # the engine: the same size on every (re)start, so the API process's map stays valid
            os.ftruncate(fd, count * slot_bytes)
        size = os.fstat(fd).st_size
        if size < count * slot_bytes:
            raise ValueError(f"KV slot segment of {size} bytes, {count} slots of {slot_bytes} wanted")
        self._map = mmap.mmap(fd, count * slot_bytes)
        self._view = memoryview(self._map)

    def view(self, i: int, nbytes: int) -> memoryview:
        if not 0 <= i < self.count or not 0 <= nbytes <= self.slot_bytes:
            raise ValueError(f"slot {i} of {self.count}, {nbytes} bytes of {self.slot_bytes}")
        at = i * self.slot_bytes
        return self._view[at: at + nbytes]


class Lease:
    """One slot lent to one command: free once released by its holder and answered by the engine."""

    __slots__ = ("index", "_slots", "_held", "_owed")

    def __init__(self, slots: "Slots", index: int):
        self.index, self._slots, self._held, self._owed = index, slots, True, False

    def view(self, nbytes: int) -> memoryview:
        return self._slots.map.view(self.index, nbytes)

    def sent(self) -> None:
        """A command naming this slot went to the engine: it is the engine's until its answer."""
        self._owed = True

    def answered(self) -> None:
        self._owed = False
        self._free()

    def release(self) -> None:
        self._held = False
        self._free()

    def _free(self) -> None:
        if not self._held and not self._owed and self.index >= 0:
            self._slots._give_back(self.index)
            self.index = -1


class Slots:
    """The API process's side: the segment's fd, its map once the engine said the geometry, the leases."""

    def __init__(self):
        self.fd = new_segment()
        self.map: SlotMap | None = None
        self._free: deque[int] = deque()
        self._waiters: deque[asyncio.Future] = deque()

    def mapped(self, count: int, slot_bytes: int) -> None:
        """The engine (re)started with this geometry (its Hello): map the segment the first time."""
        if count == 0:
            return  # an engine that moves no KV
        if self.map is not None:
            assert (self.map.count, self.map.slot_bytes) == (count, slot_bytes), "an engine changed its KV slots"
            return
        self.map = SlotMap(self.fd, count, slot_bytes)
        self._free.extend(range(count))

    @property
    def free(self) -> int:
        """Slots not lent."""
        return len(self._free)

    async def lease(self) -> Lease:
        """A free slot, waiting (first come, first served) while every one is lent."""
        assert self.map is not None, "KV slots before the engine's Hello"
        if self._free and not self._waiters:
            return Lease(self, self._free.popleft())
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return Lease(self, await fut)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slot as it was cancelled: pass it on
                self._give_back(fut.result())
            raise

    def _give_back(self, i: int) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(i)
                return
        self._free.append(i)

    def close(self) -> None:
        """Close the fd; the map goes with its last view (a transfer cut short at shutdown may still
        hold one: unmapping under it would fail, and the process is ending)."""
        os.close(self.fd)
        self.map = None
