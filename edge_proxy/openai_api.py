"""OpenAI-compatible HTTP: POST /v1/chat/completions, POST /v1/completions, GET
/v1/models[/{id}], and llama.cpp's POST /infill, on the schema the replica uses too
(wire.openai: what is honoured, what is a 400 naming the param).

Each prompt of a request is one proxy stream (routing, failover and exact resume
as for the WebSocket); its messages feed the shared renderer (wire.openai_render,
wire.openai_stream), which streams SSE exactly as OpenAI does or answers with one
JSON body. A client that goes away aborts the replicas' work at once.

Extensions beyond OpenAI's schema (all optional): body fields `session`,
`priority`, `deadline_ms`, `cache_salt` and vLLM's sampling extensions; headers
`X-Session-ID`, `X-Priority`, `X-Deadline-Ms`, `traceparent`,
`X-Edgechat-Forwarded-By` (set by a peer region's proxy: never forwarded again);
query parameter `session_id`. Answers carry an `edgechat` object (timing, region,
replica, failovers, and `forwarded_from` when another region's proxy forwarded the
request to the region that served it).
"""

from __future__ import annotations


import msgspec
from starlette.requests import ClientDisconnect, Request

from edge_proxy import protocol as pp
from edge_proxy.auth import bearer
from edge_proxy.core import SubmitRequest
from edge_proxy.peering import FORWARDED_HEADER
from edge_proxy.prompt import plan_prompt_ids
from wire import openai as O
from wire import openai_prompts as OP
from wire import protocol as rp
from wire.openai_stream import End, Pump, error_response, json_response, parse, read_body, response

_NAMES = {v: k for k, v in O.PRIORITIES.items()}


def openai_error(e: pp.ProtocolError | pp.Error) -> O.OpenAIError:
    param = e.message.split(" ", 1)[0]
    return O.OpenAIError(e.message, param if param in O.SAMPLING_FIELDS else None, O.http_status(e.code), e.code,
                         e.retry_after_s)


def _ext(d: pp.Done) -> dict:
    ext = {"timing": msgspec.to_builtins(d.timing), "region": d.region, "replica": d.replica,
           "failovers": d.failovers}
    if d.forwarded_from:
        ext["forwarded_from"] = d.forwarded_from
    return {"edgechat": ext}


class _Sink:
    """One prompt's stream -> the request's Pump (the rich sink interface of edge_proxy.stream)."""

    __slots__ = ("put", "p")

    def __init__(self, pump: Pump, p: int):
        self.put, self.p = pump.put, p

    def tokens(self, s, msg) -> None:
        self.put((self.p, msg))

    def delta(self, s, text: str, ntok: int) -> None:
        # A request forwarded to a peer region (public protocol: text and a token count). Only
        # the count of ids is used: no logprobs can be asked of a forwarded request.
        self.put((self.p, rp.Tokens("", [0] * ntok, text)))

    def finish(self, s, msg) -> None:
        if type(msg) is pp.Done:
            self.put(End(self.p, msg.finish_reason, _ext(msg)))
        else:
            self.put(openai_error(msg))


class OpenAIRoutes:
    def __init__(self, proxy):
        self.proxy = proxy

    def _auth(self, request: Request):
        client = request.client
        try:
            return self.proxy.authenticate(bearer(request.headers.get("authorization")),
                                           client.host if client else None)
        except pp.ProtocolError as e:  # unauthorized, or rate_limited (failed-auth throttle)
            raise openai_error(e) from None

    def _model(self, name: str | None) -> str:
        models = self.proxy.pool.models()
        if name and models and name not in models:
            raise O.not_found_model(name)
        return name or (models[0] if models else "default")

    def _models(self) -> list[dict]:
        fim = getattr(self.proxy.tokenizer, "fim", None) is not None  # clients choose prefix+suffix by it
        return [{"id": m, "object": "model", "created": 0, "owned_by": "edgechat", "edgechat": {"fim": fim}}
                for m in self.proxy.pool.models()]

    async def models(self, request: Request):
        try:
            self._auth(request)
        except O.OpenAIError as e:
            return error_response(e)
        return json_response(200, msgspec.json.encode({"object": "list", "data": self._models()}))

    async def model(self, request: Request):
        try:
            self._auth(request)
            name = request.path_params["model"]
            found = [m for m in self._models() if m["id"] == name]
            if not found:
                raise O.not_found_model(name)
        except O.OpenAIError as e:
            return error_response(e)
        return json_response(200, msgspec.json.encode(found[0]))

    async def chat(self, request: Request):
        return await self._handle(request, "chat")

    async def completions(self, request: Request):
        return await self._handle(request, "completion")

    async def infill(self, request: Request):
        return await self._handle(request, "infill")

    async def _handle(self, request: Request, kind: str):
        proxy, tok = self.proxy, self.proxy.tokenizer
        pump, streams = None, []
        try:
            key = self._auth(request)
            plan, ireq = parse(kind, await read_body(request, proxy.cfg.max_frame_bytes))
            model = self._model(plan.model if kind != "infill" else None)
            ids = [await plan_prompt_ids(proxy.tokenizers, proxy.cfg.limits, p, plan.tools) for p in plan.prompts]
            sampling = OP.sampling_for(plan, tok)
            cid = O.response_id(kind)
            h = request.headers
            pump = Pump(request.receive, hold=True)
            pump.abort = lambda: [s.cancel(notify=False) for s in streams]
            for p, prompt in enumerate(plan.prompts):
                req = SubmitRequest(
                    cid=cid if len(ids) == 1 else f"{cid}/{p}",
                    messages=prompt if kind == "chat" else None,
                    prompt=None if kind == "chat" else prompt if isinstance(prompt, str) else ids[p], ids=ids[p],
                    session=plan.session or h.get("x-session-id") or request.query_params.get("session_id"),
                    sampling=sampling, priority=_NAMES.get(plan.priority) or h.get("x-priority"),
                    deadline_ms=plan.deadline_ms or float(h.get("x-deadline-ms") or 0),
                    traceparent=h.get("traceparent"), forwarded_by=h.get(FORWARDED_HEADER),
                    cache_salt=plan.cache_salt, rich=True, tools=plan.tools)
                streams.append(await proxy.submit(key, req, _Sink(pump, p)))
        except (O.OpenAIError, pp.ProtocolError, ValueError, ClientDisconnect) as e:
            if pump is not None:
                pump.abort()
                pump.close()
            if isinstance(e, ClientDisconnect):
                return json_response(499, b"")
            if isinstance(e, ValueError):  # a malformed numeric header
                e = O.OpenAIError(str(e), None)
            return error_response(openai_error(e) if isinstance(e, pp.ProtocolError) else e)
        return await pump.reply(response(kind, plan, ireq, cid, model, tok, ids), plan.stream)
