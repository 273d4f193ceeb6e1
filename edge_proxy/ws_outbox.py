"""What one public WebSocket client has yet to receive: the coalescing outbox its
`wire.ws_writer.FrameWriter` sends from.

One entry per stream merges its text and token counts until the writer takes it,
so a client the writer cannot keep up with (its transport over the 64 KiB
high-water mark, or an ASGI send blocked) gets fewer, larger frames; a stream's
entry also carries its final done or error, sent after its last delta. Frames of
no stream (errors, the done of a request cancelled while being admitted) queue
beside them and leave first.

`pending_bytes` approximates the frame bytes held: a delta's text plus
`FRAME_OVERHEAD` for its JSON, `IDS_BYTES` per token id of a resumable stream's
delta, done and error frames at their usual size. The connection closes a client
whose outbox holds more than `max_pending_bytes` (`too_slow`, 1008), so the memory a
slow client can pin is bounded.
"""

from __future__ import annotations

from edge_proxy import protocol as pp

# Accounting of the outbox (`max_pending_bytes`): a frame's text plus this much for
# its JSON around it; done and error frames are counted at their usual size.
FRAME_OVERHEAD = 48
DONE_BYTES = 320
IDS_BYTES = 7  # a token id in a delta's `ids` (resumable requests)


class ClientOutbox:
    """A `wire.ws_writer.Box` of public-protocol frames, keyed by stream."""

    __slots__ = ("encode", "coalesced", "entries", "loose", "with_ids", "pending_bytes")

    def __init__(self, codec: pp.ClientCodec, coalesced):
        self.encode = codec.encode
        self.coalesced = coalesced  # metrics counter: deltas that merged more than one
        self.entries: dict = {}  # stream -> [text, tokens, merged, final, index of its first id in stream.ids]
        self.loose: list = []  # frames of no stream
        self.with_ids: set = set()  # streams whose deltas carry their token ids (`resumable`)
        self.pending_bytes = 0

    def __bool__(self) -> bool:
        return bool(self.entries or self.loose)

    def delta(self, s, text: str, ntok: int) -> None:
        """`ntok` more tokens of stream `s` (hot path), the last `ntok` of `s.ids`."""
        ids = self.with_ids and s in self.with_ids  # a resumable stream: its frames carry their ids
        e = self.entries.get(s)
        if e is None:
            self.entries[s] = [text, ntok, 1, None, len(s.ids) - ntok if ids else 0]
            self.pending_bytes += len(text) + len(s.cid) + FRAME_OVERHEAD
        else:
            e[0] += text
            e[1] += ntok
            e[2] += 1
            self.pending_bytes += len(text)
        if ids:
            self.pending_bytes += IDS_BYTES * ntok

    def final(self, s, msg: pp.Done | pp.Error) -> None:
        """Request `s`'s last frame, after its deltas."""
        e = self.entries.get(s)
        if e is None:
            self.entries[s] = ["", 0, 0, msg, 0]
        else:
            e[3] = msg
        self._count(msg)

    def answer(self, msg: pp.Done | pp.Error) -> None:
        """A frame of no stream."""
        self.loose.append(msg)
        self._count(msg)

    def _count(self, msg) -> None:
        if type(msg) is pp.Error:
            self.pending_bytes += len(msg.message) + len(msg.id or "") + FRAME_OVERHEAD
        else:
            self.pending_bytes += DONE_BYTES + len(msg.id)

    def _delta(self, s, text: str, ntok: int, first: int) -> pp.Delta:
        if self.with_ids and s in self.with_ids:
            return pp.Delta(s.cid, text, ntok, s.ids[first:first + ntok])
        return pp.Delta(s.cid, text, ntok)

    def take(self) -> list[bytes]:
        """Everything queued, encoded, in order: loose frames, then per stream its delta and final."""
        enc = self.encode
        loose, self.loose = self.loose, []
        batch, self.entries = self.entries, {}
        self.pending_bytes = 0
        out = [enc(msg) for msg in loose]
        coalesced = 0
        for s, (text, ntok, merged, final, first) in batch.items():
            if merged:
                out.append(enc(self._delta(s, text, ntok, first)))
                coalesced += merged > 1
            if final is not None:
                out.append(enc(final))
                self.with_ids.discard(s)
        if coalesced:
            self.coalesced.inc(by=coalesced)
        return out

    def clear(self) -> None:
        self.entries.clear()
        self.loose.clear()
        self.pending_bytes = 0
