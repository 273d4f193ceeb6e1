"""The replica behind its own OpenAI routes (wire.openai_routes: /v1/chat/completions,
/v1/completions, /v1/models[/{id}], llama.cpp's /infill and /props, /tokenize,
/detokenize, /version): `ReplicaBackend` is what the replica adds to them.

The caller needs nothing more (the replica secret is checked before any route:
replica.api.auth); the one model is the served name (with its context length; its
slots are the engine's `max_num_seqs`); a prompt is tokenized on the event loop; each prompt of a request is one engine
request `<id>/<p>` (n samples each, see replica.api.engine_client) whose messages
feed the routes' shared renderer; every error answered or streamed is counted for
/metrics.
"""

from __future__ import annotations

from collections.abc import Callable

from wire import openai as O
from wire import protocol as P
from wire.openai_routes import PromptSink, Submission

MAX_BODY_BYTES = 4 << 20


class ReplicaBackend:
    """wire.openai_routes.OpenAIBackend over the API process's `EngineClient`."""

    hold = False  # the engine's Finished is the prompt's end
    max_body_bytes = MAX_BODY_BYTES

    def __init__(self, client, tokenizer, model_name: str, metrics, max_model_len, max_running: int):
        self.client, self.tokenizer, self.model_name, self.metrics = client, tokenizer, model_name, metrics  # client()
        self.max_model_len, self.max_running = max_model_len, max_running  # () -> int; the engine's max_num_seqs

    def authorize(self, request) -> None:
        return None  # replica.api.auth.RequireSecret let it in

    def models(self) -> dict[str, int]:
        return {self.model_name: self.max_model_len()}

    def slots(self) -> int:
        return self.max_running

    def served_model(self, name: str | None) -> str:
        if name is not None and name != self.model_name:
            raise O.not_found_model(name)
        return self.model_name

    async def run_tokenizer(self, prompt, fn, *args):
        return fn(*args)  # on the event loop: the body is bounded (MAX_BODY_BYTES)

    async def submit(self, sub: Submission, p: int, sink: PromptSink) -> Callable[[], None]:
        plan = sub.plan
        g = P.Generate(id=f"{sub.rid}/{p}", prompt_ids=sub.ids[p], sampling=sub.sampling, cache_salt=plan.cache_salt,
                       priority=P.INTERACTIVE if plan.priority is None else plan.priority,
                       deadline_ms=plan.deadline_ms, traceparent=sub.request.headers.get("traceparent", ""))
        c = self.client()
        try:
            c.submit(g, sink)  # a refusal comes back through the sink
        except ConnectionError as e:
            raise O.OpenAIError(str(e), status=500, code=P.INTERNAL) from None
        return lambda: c.abort(g.id)

    def count_error(self, code: str) -> None:
        self.metrics.errors.inc(code)
