"""The replica's own OpenAI front door: /v1/chat/completions, /v1/completions,
/v1/models[/{id}] and llama.cpp's /infill, on the schema the proxy uses too
(wire.openai, wire.infill, wire.openai_render, wire.openai_stream).

Each prompt of a request is one engine request `<id>/<p>` (n samples each, see
replica.api.engine_client); the answer is rendered from their messages as they come.
"""

from __future__ import annotations


import msgspec

from wire import openai as O
from wire import openai_prompts as OP
from wire import protocol as P
from wire.openai_stream import Pump, error_response, json_response, parse, read_body, response

MAX_BODY_BYTES = 4 << 20


class OpenAIRoutes:
    def __init__(self, client, tokenizer, model_name: str, metrics, max_model_len):
        self.client, self.tokenizer, self.model_name, self.metrics = client, tokenizer, model_name, metrics
        self.max_model_len = max_model_len  # () -> int

    def error(self, e: O.OpenAIError):
        self.metrics.errors.inc(e.code)
        return error_response(e)

    def engine_error(self, err: P.Error) -> O.OpenAIError:
        self.metrics.errors.inc(err.code)
        return O.engine_error(err.code, err.message, O.http_status(err.code))

    # -- models ----------------------------------------------------------------------------
    def _model(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "edgechat",
                "max_model_len": self.max_model_len()}

    async def models(self, request):
        return json_response(200, msgspec.json.encode({"object": "list", "data": [self._model()]}))

    async def model(self, request):
        name = request.path_params["model"]
        if name != self.model_name:
            return self.error(O.not_found_model(name))
        return json_response(200, msgspec.json.encode(self._model()))

    # -- generation --------------------------------------------------------------------------
    async def chat(self, request):
        return await self._generate(request, "chat")

    async def completions(self, request):
        return await self._generate(request, "completion")

    async def infill(self, request):
        return await self._generate(request, "infill")

    async def _generate(self, request, kind: str):
        tok = self.tokenizer
        try:
            plan, ireq = parse(kind, await read_body(request, MAX_BODY_BYTES))
            if plan.model is not None and plan.model != self.model_name and kind != "infill":
                raise O.not_found_model(plan.model)
            ids = [OP.prompt_ids(tok, p, plan.tools) for p in plan.prompts]
            sampling = OP.sampling_for(plan, tok)
        except O.OpenAIError as e:
            return self.error(e)
        rid = O.response_id(kind)
        pump = Pump(request.receive)
        c = self.client()
        gens = [P.Generate(id=f"{rid}/{p}", prompt_ids=ids[p], sampling=sampling, cache_salt=plan.cache_salt,
                           priority=P.INTERACTIVE if plan.priority is None else plan.priority,
                           deadline_ms=plan.deadline_ms, traceparent=request.headers.get("traceparent", ""))
                for p in range(len(ids))]
        pump.abort = lambda: [c.abort(g.id) for g in gens]
        try:
            for p, g in enumerate(gens):
                c.submit(g, self._sink(pump, p))
        except ConnectionError as e:
            pump.abort()
            pump.close()
            return self.error(O.OpenAIError(str(e), status=500, code=P.INTERNAL))
        return await pump.reply(response(kind, plan, ireq, rid, self.model_name, tok, ids), plan.stream)

    def _sink(self, pump: Pump, p: int):
        put = pump.put

        def sink(msg) -> None:
            put(self.engine_error(msg) if type(msg) is P.Error else (p, msg))
        return sink
