"""The OpenAI routes, one class for the proxy and the replica: POST /v1/chat/completions,
POST /v1/completions, llama.cpp's POST /infill, GET /v1/models[/{id}], vLLM's POST /tokenize,
POST /detokenize and GET /version, llama.cpp's GET /props (no torch).

`OpenAIRoutes` does everything the two front doors do alike: the caller authorized,
the body read (413 past the backend's limit) and validated into a `Plan` (a 400
naming its param), the model checked (404), each prompt tokenized, the sampling
made for the model (FIM stop, tool grammar), one generation started per prompt
with a `PromptSink` feeding the request's `Pump` (wire.openai_stream), and the
answer rendered (n, echo, logprobs, usage, SSE or JSON: wire.openai_render,
wire.infill). Every refusal has OpenAI's error shape and its status from
`wire.openai.HTTP_STATUS`; a client that goes away stops every generation.
A model's entry is built here, the same on both sides (`model_entry`: its context
length as vLLM's `max_model_len`, whether it does fill-in-the-middle); so are the
tokenizer's routes (wire.tokenize) and what IDE plugins read of llama.cpp's /props:
`default_generation_settings.n_ctx` (llama.vscode sizes its prompts by it),
`total_slots`, `model_alias`/`model_path`, `chat_template`, `bos_token`/`eos_token`,
`modalities`, `build_info`.

What differs is the `OpenAIBackend` a process implements: the proxy's
(edge_proxy.openai_api: API keys, the pool's models, its limits and tokenizer
threads, one proxy stream per prompt) and the replica's (replica.api.openai_http:
its one model, the engine client, its error counter).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Protocol, runtime_checkable

import msgspec

from wire import openai as O
from wire import openai_prompts as OP
from wire import protocol as P
from wire import tokenize as TK
from wire import tools as T
from wire.openai import OpenAIError, Plan
from wire.openai_stream import Disconnected, End, Pump, error_response, json_response, parse, read_body, response

_enc = msgspec.json.Encoder()


def _version() -> str:
    try:
        return metadata.version("edgechat")
    except metadata.PackageNotFoundError:  # a checkout run without `pip install -e .`
        return "unknown"


VERSION = _version()


def model_entry(name: str, max_model_len: int, fim: bool) -> dict:
    """One model as GET /v1/models lists it, at the proxy and the replica alike."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "edgechat", "max_model_len": max_model_len,
            "edgechat": {"fim": fim}}  # clients choose prefix+suffix (FIM) by it


@dataclass
class Submission:
    """A validated request, as the routes hand its prompts to the backend."""

    request: object  # the HTTP request (Starlette's): headers, query parameters
    caller: object  # what the backend's `authorize` returned (the proxy's API key)
    plan: Plan
    rid: str  # the answer's id: chatcmpl-, cmpl- or infill- (wire.openai.response_id)
    ids: list[list[int]]  # each prompt's token ids
    sampling: P.SamplingParams  # the plan's sampling for this model (wire.openai_prompts.sampling_for)


class PromptSink:
    """One prompt's generation -> the request's Pump. Called with the internal protocol's
    Tokens, Finished or Error (wire.protocol); `end` when the process ends the prompt
    itself (the proxy's Done), `fail` with an error it already has in OpenAI's shape."""

    __slots__ = ("put", "p", "count_error")

    def __init__(self, pump: Pump, p: int, count_error: Callable[[str], None]):
        self.put, self.p, self.count_error = pump.put, p, count_error

    def __call__(self, msg) -> None:
        if type(msg) is P.Error:
            self.fail(O.error_of(msg.code, msg.message))
        else:
            self.put((self.p, msg))

    def end(self, reason: str, extra: dict | None = None) -> None:
        self.put(End(self.p, reason, extra))

    def fail(self, e: OpenAIError) -> None:
        self.count_error(e.code)
        self.put(e)


@runtime_checkable
class OpenAIBackend(Protocol):
    """What a process implements to serve the OpenAI routes. Its methods raise `OpenAIError`
    (a `ValueError` is answered as a 400 too: a malformed header, say)."""

    hold: bool  # True: a prompt's last chunk waits for its `end` (the process adds to it)

    @property
    def tokenizer(self):
        """The model's tokenizer: encode, decode, piece, chat template, fim (echo, tools, FIM stops)."""

    @property
    def max_body_bytes(self) -> int:
        """A longer body is a 413."""

    def authorize(self, request) -> object:
        """The caller of an HTTP request (handed back in `Submission.caller`), or an OpenAIError."""

    def models(self) -> dict[str, int]:
        """The models served, each with its context length in tokens (max_model_len)."""

    def served_model(self, name: str | None) -> str:
        """The model a request names (None: none named) as its answer names it; a 404 if not served."""

    def slots(self) -> int:
        """Requests the model's engines run at once (llama.cpp's total_slots)."""

    async def run_tokenizer(self, prompt, fn: Callable, *args):
        """`fn(*args)` (rendering, tokenizing, decoding: wire.openai_prompts.prompt_ids, wire.tokenize)
        where the process runs its tokenizer, once `prompt` (messages, text, token ids, Fim) is within
        its limits."""

    async def submit(self, sub: Submission, p: int, sink: PromptSink) -> Callable[[], None]:
        """Start prompt p's generation, its messages to `sink`; returns what stops it."""

    def count_error(self, code: str) -> None:
        """An error was answered or streamed (the replica counts them for /metrics)."""


class OpenAIRoutes:
    """The route handlers (Starlette endpoints) over one backend; `routes()` lists them."""

    def __init__(self, backend: OpenAIBackend):
        self.backend = backend

    def routes(self) -> list[tuple[str, Callable, list[str]]]:
        """(path, endpoint, methods) of every route, for the app to mount."""
        return [("/v1/chat/completions", self.chat, ["POST"]), ("/v1/completions", self.completions, ["POST"]),
                ("/infill", self.infill, ["POST"]), ("/v1/models", self.models, ["GET"]),
                ("/v1/models/{model:path}", self.model, ["GET"]), ("/tokenize", self.tokenize, ["POST"]),
                ("/detokenize", self.detokenize, ["POST"]), ("/version", self.version, ["GET"]),
                ("/props", self.props, ["GET"])]

    def _refuse(self, e: OpenAIError):
        self.backend.count_error(e.code)
        return error_response(e)

    def _answer(self, e: Exception):
        """The answer to a request refused with `e` (a ValueError is a 400; a client gone mid-body, 499)."""
        if isinstance(e, Disconnected):
            return json_response(499, b"")
        return self._refuse(e if isinstance(e, OpenAIError) else OpenAIError(str(e), None))

    # -- models ----------------------------------------------------------------------------
    def entries(self) -> list[dict]:
        fim = getattr(self.backend.tokenizer, "fim", None) is not None
        return [model_entry(name, n, fim) for name, n in self.backend.models().items()]

    async def models(self, request):
        try:
            self.backend.authorize(request)
        except OpenAIError as e:
            return self._refuse(e)
        return json_response(200, _enc.encode({"object": "list", "data": self.entries()}))

    async def model(self, request):
        try:
            self.backend.authorize(request)
            name = request.path_params["model"]
            found = [m for m in self.entries() if m["id"] == name]
            if not found:
                raise O.not_found_model(name)
        except OpenAIError as e:
            return self._refuse(e)
        return json_response(200, _enc.encode(found[0]))

    async def version(self, request):
        try:
            self.backend.authorize(request)
        except OpenAIError as e:
            return self._refuse(e)
        return json_response(200, _enc.encode({"version": VERSION}))

    async def props(self, request):
        b = self.backend
        try:
            b.authorize(request)
            name = b.served_model(request.query_params.get("model"))  # llama.vscode names it when several are listed
        except OpenAIError as e:
            return self._refuse(e)
        tok = b.tokenizer
        return json_response(200, _enc.encode({
            "default_generation_settings": {"n_ctx": b.models().get(name, 0)}, "total_slots": b.slots(),
            "model_alias": name, "model_path": name, "chat_template": getattr(tok, "chat_template", None) or "",
            "bos_token": getattr(tok, "bos_token", None) or "", "eos_token": getattr(tok, "eos_token", None) or "",
            "modalities": {"vision": False, "audio": False}, "build_info": f"edgechat {VERSION}"}))

    # -- the tokenizer -----------------------------------------------------------------------
    async def tokenize(self, request):
        b = self.backend
        try:
            b.authorize(request)
            t = TK.parse_tokenize(await read_body(request, b.max_body_bytes))
            model = b.served_model(t.model)
            ids = await b.run_tokenizer(t.prompt, TK.tokenize, b.tokenizer, t)
        except (OpenAIError, ValueError, Disconnected) as e:
            return self._answer(e)
        return json_response(200, _enc.encode({"count": len(ids), "max_model_len": b.models().get(model, 0),
                                               "tokens": ids}))

    async def detokenize(self, request):
        b = self.backend
        try:
            b.authorize(request)
            body = await read_body(request, b.max_body_bytes)
            r = TK.parse_detokenize(body, getattr(b.tokenizer, "vocab_size", None))
            b.served_model(r.model)
            text = await b.run_tokenizer(r.tokens, TK.detokenize, b.tokenizer, r.tokens)
        except (OpenAIError, ValueError, Disconnected) as e:
            return self._answer(e)
        return json_response(200, _enc.encode({"prompt": text}))

    # -- generation --------------------------------------------------------------------------
    async def chat(self, request):
        return await self._generate(request, "chat")

    async def completions(self, request):
        return await self._generate(request, "completion")

    async def infill(self, request):
        return await self._generate(request, "infill")

    async def _generate(self, request, kind: str):
        b = self.backend
        pump, stops = None, []
        try:
            caller = b.authorize(request)
            plan, ireq = parse(kind, await read_body(request, b.max_body_bytes))
            model = b.served_model(plan.model if kind != "infill" else None)
            ids = [await b.run_tokenizer(p, OP.prompt_ids, b.tokenizer, p, plan.tools) for p in plan.prompts]
            sub = Submission(request, caller, plan, O.response_id(kind), ids, OP.sampling_for(plan, b.tokenizer))
            pump = Pump(request.receive, hold=b.hold)
            pump.abort = lambda: [stop() for stop in stops]
            for p in range(len(ids)):
                stops.append(await b.submit(sub, p, PromptSink(pump, p, b.count_error)))
        except (OpenAIError, ValueError, Disconnected) as e:
            if pump is not None:
                pump.abort()
                pump.close()
            return self._answer(e)
        return await pump.reply(response(kind, plan, ireq, sub.rid, model, b.tokenizer, ids), plan.stream)
