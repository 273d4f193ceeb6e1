"""A KV transfer's blocks between the pool and its bytes through one staging buffer (CUDA).

An export reads frames of blocks out of the pool and an import writes them in
(replica.engine.kv_transfer, between two steps). On CUDA, a copy between device memory and
pageable host memory is synchronous and staged by the driver, one such copy per block and
pool. Here a frame's blocks are gathered on the device into one buffer in the travel layout
(per block: every layer's k and v, then the draft head's layer), copied at once into pinned
host memory kept for the process (grown to the largest frame), and only then into the frame's
bytes; an import runs the reverse and scatters with `index_copy_`. The pinned buffer is what
an RDMA transport (replica.api.kv_transport names NIXL) would register once for the NIC to
read, in place of the copy into the frame.

On CPU the pool's views are copied straight into the bytes (Runner._move: one copy, where
this path makes three); `pin=False` runs this path on CPU, which is how the tests hold its
layout to that one's.
"""

from __future__ import annotations

import math

import torch


class KvStaging:
    def __init__(self, pin: bool):
        self.pin = pin
        self._buf: torch.Tensor | None = None

    def _stage(self, nbytes: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return self._buf[:nbytes]

    def _sync(self, device: torch.device) -> None:
        if self.pin:  # the staging buffer is read (export) or reused (import) by the host next
            torch.cuda.current_stream(device).synchronize()

    @torch.inference_mode()
    def read(self, pools: list[tuple[torch.Tensor, int]], ids: list[int], out: torch.Tensor) -> None:
        """Blocks `ids` of `pools` ((pool, its block dimension), in travel order) into `out` (uint8,
        len(ids) blocks' bytes)."""
        device, n = pools[0][0].device, len(ids)
        idx = torch.tensor(ids, device=device)
        cols = [t.index_select(d, idx).movedim(d, 0).contiguous().view(torch.uint8).reshape(n, -1) for t, d in pools]
        gathered = torch.cat(cols, dim=1) if len(cols) > 1 else cols[0]  # (n, block bytes), on the device
        stage = self._stage(out.numel())
        stage.view(n, -1).copy_(gathered, non_blocking=self.pin)
        self._sync(device)
        out.copy_(stage)

    @torch.inference_mode()
    def write(self, pools: list[tuple[torch.Tensor, int]], ids: list[int], data: torch.Tensor) -> None:
        """`data` (uint8, laid out as `read` writes it) into blocks `ids` of `pools`."""
        device, n = pools[0][0].device, len(ids)
        idx = torch.tensor(ids, device=device)
        stage = self._stage(data.numel())
        stage.copy_(data)
        rows = stage.to(device, non_blocking=self.pin).view(n, -1)  # (n, block bytes)
        at = 0
        for t, d in pools:
            shape = t.movedim(d, 0).shape[1:]  # one block of this pool
            nbytes = math.prod(shape) * t.element_size()
            part = rows[:, at: at + nbytes].contiguous().view(t.dtype).view(n, *shape)
            t.index_copy_(d, idx, part.movedim(0, d))
            at += nbytes
        self._sync(device)
