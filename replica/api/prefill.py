"""POST /v1/prefill: compute a prompt into this replica's prefix cache, for another to pull.

The prefill half of prefill/decode disaggregation (edge_proxy.disagg): a proxy sends a new
prompt's full blocks here (a replica of role prefill), then asks the decode replica it chose to
pull them (`POST /v1/kv/pull`, replica.api.kv_routes), where the stream starts.

    body    JSON {"token_ids": [...], "cache_salt": "..."}  (the proxy's Generate's prompt and salt)
    200     {"blocks": full blocks of the prompt, "cached_tokens": of its tokens this replica's cache
            already served, "ms": arrival to answer}: every full block is now in the prefix cache
            (committed as it was computed; an eviction before the pull ends that pull early)
    400     a bad body or prompt; 503 the engine restarting, full or draining (the Error's message)

It runs one engine request like any other (same scheduler, same chunked prefill, the same
checks as a Generate) with max_tokens 1 at temperature 0: the engine has no prefill-only
request, and the one token it samples (one row of the lm_head) is dropped here; nothing streams.
Send it the whole prompt, not its full blocks only: each row's numerics follow from what the row
is (prompt rows that only leave KV run on int8 activations from INT8_PROMPT_TOKENS on, the last
row samples: replica.config), so the KV of the whole prompt's blocks is byte for byte what the
decode replica computes itself for that prompt, and a shorter prompt's would not be.
"""

from __future__ import annotations

import asyncio
import itertools
from time import perf_counter

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from wire import protocol as P

MAX_BODY_BYTES = 8 << 20  # MAX_PROMPT_TOKENS ids as JSON fit
_STATUS = {P.BAD_REQUEST: 400, P.PROMPT_TOO_LONG: 400, P.OVERLOADED: 503, P.INTERNAL: 503}


class PrefillBody(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: list[int]
    cache_salt: str = ""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


class PrefillRoute:
    """`client()`: the EngineClient."""

    def __init__(self, client):
        self.client = client
        self._ids = itertools.count()  # engine ids "prefill/<n>": never reused in this process

    def routes(self) -> list[Route]:
        return [Route("/v1/prefill", self.prefill, methods=["POST"])]

    async def prefill(self, request: Request):
        t0 = perf_counter()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                return _error(400, f"body larger than {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
        try:
            body = msgspec.json.decode(b"".join(chunks), type=PrefillBody)
        except msgspec.DecodeError as e:  # ValidationError included
            return _error(400, f"bad prefill body: {e}")
        client = self.client()
        spec = client.kv_spec
        if spec is None:
            return _error(503, "the engine process is restarting")
        done: asyncio.Future = asyncio.get_running_loop().create_future()

        def sink(msg) -> None:
            if isinstance(msg, (P.Finished, P.Error)) and not done.done():
                done.set_result(msg)

        g = P.Generate(f"prefill/{next(self._ids)}", body.token_ids, P.SamplingParams(max_tokens=1, temperature=0.0),
                       body.cache_salt)
        client.submit(g, sink)  # a refusal comes back through the sink at once
        try:
            end = await done
        finally:
            if not done.done():  # the proxy went away (cancelled): stop the engine's work
                client.abort(g.id)
        if isinstance(end, P.Error):
            return _error(_STATUS.get(end.code, 500), end.message)
        return JSONResponse({"blocks": len(body.token_ids) // spec.block_size, "cached_tokens": end.usage.cached_tokens,
                             "ms": round((perf_counter() - t0) * 1e3, 3)})
