"""How a receiver's blocks come from a source replica: today HTTP over the network as it is.

Contract of a transport (`fetch`): an async iterator over the source's export stream for one
`KvExport` (wire.kv_frames): KvSpec first, then KvFrame messages, then KvEnd, in order, each
one whole (a message cut short is never yielded); it raises `KvTransportError`, with a message
naming the source and what happened, when the source refuses (a wrong replica secret: 401),
cannot be reached or the stream breaks. It checks nothing inside the frames: the importer
(replica.api.kv_routes) does, so every transport is held to the same checks.

`HttpKvTransport` POSTs to the source's /v1/kv/export with the replica secret (the replicas of
one deployment share it, as the proxy presents one to all) and reads the stream in bounded
messages (the source cuts frames to wire.kv_frames.MAX_FRAME_BYTES; the receiver holds one frame
at a time, and TCP's window holds the source back). One client serves every pull, its
connections kept alive: a drain's short repeat pulls then start on an open connection (a new
client and connection a pull took 50-190 ms to its first byte on two busy cores, four at once,
where the whole one-block pull should take a few steps; docs/perf.md).

On GPU clusters an RDMA transport replaces this one behind the same `fetch`. The choice is
NIXL (ai-dynamo/nixl, `pip install nixl`): one agent per process registers DRAM or VRAM
regions, exchanges agent metadata out of band (it would ride this same authenticated route),
and posts one-sided READs from a remote agent's registered descriptors, choosing UCX (RoCE,
InfiniBand, GPUDirect, TCP as the fallback), NVLink or GDS per pair of memories, with
notifications on completion; vLLM's NixlConnector and Dynamo move KV with it. A receiver-driven
READ fits this pull: the source would register its KV slots (replica.kv_slots: the segment its
engine already reads frames into, pinned with cudaHostRegister on CUDA) or its pool once, its
export would carry a slot's descriptor instead of the bytes, and the frames' hashes and digests stay.
Mooncake's transfer engine (segments and batch transfers, multi-NIC RDMA, used by SGLang's
PD disaggregation) is as fast but needs its metadata service and is RDMA-first; raw UCX would
leave the rkey exchange and memory registration to us.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import msgspec

from wire.kv_frames import MEDIA_TYPE, KvExport, StreamCodec


class KvTransportError(ConnectionError):
    """A source refused an export, could not be reached, or its stream broke."""


class HttpKvTransport:
    def __init__(self, secret: str, connect_timeout_s: float = 5.0, read_timeout_s: float = 60.0):
        self._headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/msgpack",
                         "Accept": MEDIA_TYPE}
        self._timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        self._enc = msgspec.msgpack.Encoder()
        self._client: httpx.AsyncClient | None = None  # made on the first pull, in the server's loop

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def fetch(self, source: str, req: KvExport) -> AsyncIterator:
        url = source.rstrip("/") + "/v1/kv/export"
        codec = StreamCodec()
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout)
        try:
            async with self._client.stream("POST", url, content=self._enc.encode(req), headers=self._headers) as r:
                if r.status_code != 200:
                    body = (await r.aread())[:300].decode(errors="replace")
                    why = " (the replica secret is not the source's)" if r.status_code == 401 else ""
                    raise KvTransportError(f"{source} refused the export: HTTP {r.status_code}{why}: {body}")
                async for chunk in r.aiter_raw():
                    for msg in codec.feed(chunk):
                        yield msg
        except httpx.HTTPError as e:
            raise KvTransportError(f"the export stream from {source} broke: {type(e).__name__}: {e}") from e
        except ValueError as e:  # a message over the size bound, or one that does not decode
            raise KvTransportError(f"{source} sent a malformed KV stream: {e}") from e
        if codec.pending:
            raise KvTransportError(f"the export stream from {source} ended inside a message")
