"""The replica-to-replica KV channel's routes (behind the replica secret, like every route but /healthz):

  GET  /v1/kv/spec    this replica's KvSpec as JSON (what its blocks hold; a proxy picking a
                      successor can compare two replicas before it asks for a pull)
  POST /v1/kv/export  (source) msgpack KvExport -> the stream of wire.kv_frames: KvSpec, KvFrame*, KvEnd
  POST /v1/kv/hot     (source) JSON HotAsk -> JSON HotList: the cached conversations no stream holds,
                      most recently used first (the engine's BlockManager.hot_chains), each listed
                      to one asker only (two proxies of a draining replica do not pull one chain
                      twice), with a hold on a draining replica's exit (replica.api.drain.Holds)
  DELETE /v1/kv/hot/{hold}  lets that hold go (204; 404 one unknown or run out)
  POST /v1/kv/pull    (receiver) JSON KvPull -> JSON PullResult (replica.api.kv_import): 200 when
                      every full block of the prompt is cached here (or as many as the source
                      had: `complete` says), 400 a bad body, 409 a layout mismatch, 502 the source
                      refused, broke off or sent a bad frame, 503 this engine is restarting or full,
                      504 its `timeout_ms` ran out (the blocks cached by then stay, counted)

An export reads `frame_blocks` blocks at a time from the engine (a KvRead, answered between two
of its steps, cut to MAX_FRAME_BYTES and to a KV slot: replica.kv_slots), READ_AHEAD reads asked
at once: the engine reads the next frames while one is sent, and no more, so a slow receiver
holds back the source's reads, not its memory. Each read's slot is copied into its frame as it
arrives and lent again at once. A block evicted meanwhile ends the export there
(KvEnd says why): a running sequence holds its blocks, so a drain's streams never lose theirs.
"""

from __future__ import annotations

import asyncio
from collections import deque

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from wire import protocol as P
from wire.kv_frames import (MAX_FRAME_BYTES, MEDIA_TYPE, HotAsk, HotChain, HotList, KvEnd, KvExport, KvFrame, KvPull,
                            StreamCodec, block_digest, chain_hashes)
from replica.api.engine_supervisor import EngineUnavailable
from replica.api import kv_import

MAX_BODY_BYTES = 8 << 20  # a KvExport or KvPull of MAX_PROMPT_TOKENS ids fits
READ_AHEAD = 2  # KvReads an export has asked of its engine at once: the next frame is read while one is sent


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


class _ReadFailed(Exception):
    """The engine refused a KvRead (its message says why)."""


async def _read(client, codec: StreamCodec, spec: P.KvSpec, hashes: list[int], start: int) -> tuple[int, bytearray]:
    """The engine's read of the blocks under `hashes` (the first is block `start`) into a KV slot,
    packed into an export frame as soon as it is there (the slot is then free for the next read):
    (blocks it had, a prefix of those asked; the frame, empty when none)."""
    lease = await client.kv_slots.lease()
    try:
        got = await client.kv_call(P.KvRead(id="", hashes=hashes, slot=lease.index), lease)
        if got.error:
            raise _ReadFailed(got.error)
        n, per = len(got.hashes), spec.block_bytes
        if not n:
            return 0, bytearray()
        view = lease.view(n * per)
        digests = [block_digest(view[k * per: (k + 1) * per]) for k in range(n)]
        return n, codec.pack(KvFrame(start=start, hashes=got.hashes, digests=digests, data=view))
    finally:
        lease.release()


class KvRoutes:
    """`client()`: the EngineClient; `transport`: how a pull reaches a source (replica.api.kv_transport);
    `holds`: the drain's holds on this replica's exit (replica.api.drain.Holds)."""

    def __init__(self, client, transport, holds):
        self.client, self.transport, self.holds = client, transport, holds
        self.listed: set[tuple[int, int, int]] = set()  # hot chains listed to a hold: (seed, blocks, last block's hash)

    def routes(self) -> list[Route]:
        return [Route("/v1/kv/spec", self.spec, methods=["GET"]),
                Route("/v1/kv/export", self.export, methods=["POST"]),
                Route("/v1/kv/hot", self.hot, methods=["POST"]),
                Route("/v1/kv/hot/{hold}", self.release, methods=["DELETE"]),
                Route("/v1/kv/pull", self.pull, methods=["POST"])]

    async def _body(self, request: Request, kind, decode):
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ValueError(f"body larger than {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
        return decode(b"".join(chunks), type=kind)

    async def spec(self, request: Request):
        spec = self.client().kv_spec
        if spec is None:
            return _error(503, "the engine process is restarting")
        return Response(msgspec.json.encode(msgspec.structs.asdict(spec)), media_type="application/json")

    async def export(self, request: Request):
        try:
            req = await self._body(request, KvExport, msgspec.msgpack.decode)
        except ValueError as e:  # msgspec's errors are ValueErrors
            return _error(400, f"bad KvExport body: {e}")
        client = self.client()
        spec = client.kv_spec
        if spec is None:
            return _error(503, "the engine process is restarting")
        hashes = chain_hashes(req.token_ids, spec.block_size, req.cache_salt, req.seed)[req.start:]
        slot_blocks = client.kv_slots.map.slot_bytes // spec.block_bytes
        per_frame = max(1, min(req.frame_blocks, MAX_FRAME_BYTES // spec.block_bytes, slot_blocks))
        return StreamingResponse(self._stream(client, spec, hashes, req.start, per_frame), media_type=MEDIA_TYPE)

    @staticmethod
    async def _stream(client, spec: P.KvSpec, hashes: list[int], start: int, per_frame: int):
        codec, sent, reason = StreamCodec(), 0, ""
        yield memoryview(codec.pack(spec))  # Starlette sends bytes or memoryviews
        reads: deque = deque()  # (index, its frame to come: _read), READ_AHEAD at most
        ahead = iter(range(0, len(hashes), per_frame))

        def read_next() -> None:
            i = next(ahead, None)
            if i is not None:
                reads.append((i, asyncio.ensure_future(_read(client, codec, spec, hashes[i: i + per_frame], start + i))))

        try:
            for _ in range(READ_AHEAD):
                read_next()
            while reads:
                i, fut = reads.popleft()
                want = min(per_frame, len(hashes) - i)
                try:
                    n, frame = await fut
                except (EngineUnavailable, _ReadFailed) as e:
                    reason = str(e)
                    break
                read_next()  # the engine reads the next frame while this one is sent
                if n:
                    yield memoryview(frame)
                    sent += n
                if n < want:
                    reason = f"block {start + i + n} is not cached here (never computed, or evicted)"
                    break
            yield memoryview(codec.pack(KvEnd(blocks=sent, reason=reason)))
        finally:  # ended early (a short read, the receiver gone): the reads still asked are not awaited
            for _, fut in reads:
                if not fut.cancel() and not fut.cancelled():
                    fut.exception()  # retrieved (the engine lost meanwhile), so none is logged as never seen

    async def hot(self, request: Request):
        try:
            req = await self._body(request, HotAsk, msgspec.json.decode)
        except ValueError as e:
            return _error(400, f"bad HotAsk body: {e}")
        client = self.client()
        spec = client.kv_spec
        if spec is None:
            return _error(503, "the engine process is restarting")
        try:
            got = await client.kv_call(P.KvHot(id="", max_blocks=req.max_blocks))
        except EngineUnavailable as e:
            return _error(503, str(e))
        out = HotList()
        for c in got.chains:
            key = (c.seed, len(c.token_ids), chain_hashes(c.token_ids, spec.block_size, "", c.seed)[-1])
            if req.hold_s and key in self.listed:
                continue  # another proxy has it to place
            if req.hold_s:
                self.listed.add(key)
            out.chains.append(HotChain(c.seed, c.token_ids))
        if req.hold_s:
            out.hold = self.holds.take(req.hold_s)
        return Response(msgspec.json.encode(out), media_type="application/json")

    async def release(self, request: Request):
        if self.holds.release(request.path_params["hold"]):
            return Response(status_code=204)
        return _error(404, "no such hold (let go already, or run out)")

    async def pull(self, request: Request):
        try:
            req = await self._body(request, KvPull, msgspec.json.decode)
        except ValueError as e:
            return _error(400, f"bad KvPull body: {e}")
        if not req.source.startswith(("http://", "https://")):  # it is given this replica's secret: a replica only
            return _error(400, f"source must be a replica's http:// or https:// base URL, got {req.source[:100]!r}")
        res = await kv_import.pull(self.client(), self.transport, req)
        return JSONResponse(res.body(), status_code=res.status)
