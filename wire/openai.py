"""The one OpenAI request schema, for the proxy and the replica alike (no torch).

`parse_chat` / `parse_completion` turn a request body into a validated `Plan`:
the prompts to run, one `SamplingParams` for all of them, and how to answer.
Whatever the service cannot honour is an `OpenAIError` (HTTP 400 in OpenAI's
shape, `param` naming the field), never a silent 200: unknown fields, image or
audio content, tools, structured output, and any value out of range. Fields that
OpenAI defines as hints with no effect on the output (`user`, `metadata`,
`safety_identifier`) are accepted; `prompt_cache_key` is honoured as the session
(the proxy routes a key's requests to the replica holding its prefix).

Structured output: `response_format` (json_object, json_schema) and vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (or its
`structured_outputs` object) become one grammar (wire.structured); chat `tools` /
`tool_choice` / `parallel_tool_calls` and tool messages go through wire.tools, the
grammar of a required or named tool choice is built with the model's tokenizer
(`wire.openai_prompts.sampling_for`), and answers are parsed back into `tool_calls`
(wire.tool_calls).

Extensions, as vLLM names them: top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, include_stop_str_in_output, guided_*, structured_outputs;
edgechat's: session, priority, deadline_ms, cache_salt.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

import msgspec

from wire import protocol as P
from wire import structured as S
from wire import tools as T

Json = object  # a JSON value the schema only checks for presence

PRIORITIES = {"interactive": P.INTERACTIVE, "batch": P.BATCH}
ROLES = {"system", "developer", "user", "assistant", "tool"}
# The HTTP status of every error code the OpenAI routes (wire/openai_routes.py) answer with,
# over the proxy's backend or the replica's: the internal protocol's codes and the proxy's own
# public ones (edge_proxy/protocol.py, named here by value: wire imports nothing above it).
HTTP_STATUS = {P.BAD_REQUEST: 400, P.PROMPT_TOO_LONG: 400, P.UNAUTHORIZED: 401, "forbidden": 403, P.NOT_FOUND: 404,
               "too_large": 413, "rate_limited": 429, P.OVERLOADED: 503, "unavailable": 503, "shutting_down": 503,
               "too_many_connections": 503, P.INTERNAL: 500, P.ENGINE_FAULT: 500}
_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-", "infill": "infill-"}


def http_status(code: str) -> int:
    return HTTP_STATUS.get(code, 500)


def response_id(kind: str) -> str:
    """A fresh answer id: chatcmpl-, cmpl- or infill- and 24 hex digits, as both front doors give."""
    return _ID_PREFIX[kind] + secrets.token_hex(12)


_STATUS_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error"}


class OpenAIError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = P.BAD_REQUEST,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return error_body(self.message, self.status, self.code, self.param)


def error_body(message: str, status: int, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _STATUS_TYPE.get(status, "server_error"), "param": param,
                      "code": code}}


# -- request schemas ----------------------------------------------------------------------
class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None
    image_url: Json = None
    input_audio: Json = None
    file: Json = None
    refusal: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Json = None
    tool_call_id: str | None = None
    function_call: Json = None
    refusal: str | None = None
    audio: Json = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class _Request(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    response_format: Json = None
    guided_json: Json = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: S.StructuredOutputs | None = None
    # edgechat extensions
    session: str | None = None
    priority: str | int | None = None
    deadline_ms: float | None = None
    cache_salt: str | None = None


class ChatCompletionRequest(_Request, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Json = None
    tool_choice: Json = None
    parallel_tool_calls: bool | None = None
    functions: Json = None
    function_call: Json = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    audio: Json = None
    prediction: Json = None
    reasoning_effort: Json = None
    verbosity: Json = None
    web_search_options: Json = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[Json]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


# -- what a request asks for ----------------------------------------------------------------
@dataclass
class Fim:
    """A fill-in-the-middle prompt: the model writes what goes between prefix and suffix."""

    prefix: str
    suffix: str
    extra: list[tuple[str, str]] = field(default_factory=list)  # (filename, text) of other files, repo-level
    middle: str = ""  # text already typed after the prefix (llama.cpp's `prompt`)


@dataclass
class Plan:
    """A validated request: prompts[i] runs with `sampling` (n samples each); choice
    p * n + j is sample j of prompt p."""

    kind: str  # "chat" | "completion" | "infill"
    prompts: list  # chat: [messages (list of dicts)]; completion: str | list[int] | Fim each
    sampling: P.SamplingParams
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token in the answer (chat: top_logprobs), None: off
    session: str | None = None
    priority: int | None = None
    deadline_ms: float = 0.0
    cache_salt: str = ""
    tools: T.Tools | None = None  # chat: the tools shown and how they are to be used


def _param_of(e: msgspec.ValidationError) -> str | None:
    """`$.messages[0].role` or `unknown field `x`` -> the param OpenAI would name."""
    text = str(e)
    unknown = re.match(r"Object contains unknown field `([^`]*)`(?: - at `\$\.?(.*)`)?", text)
    if unknown:
        return ".".join(p for p in (unknown.group(2), unknown.group(1)) if p)
    at = re.search(r"`\$\.?([^`]*)`", text)
    return (at.group(1) or None) if at else None


def decode(body: bytes, schema):
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as e:
        raise OpenAIError(f"invalid request: {e}", _param_of(e)) from None
    except msgspec.DecodeError as e:
        raise OpenAIError(f"malformed JSON body: {e}") from None
    except UnicodeDecodeError as e:
        raise OpenAIError(f"the body is not valid UTF-8: {e}") from None
    except RecursionError:
        raise OpenAIError("the body's JSON is nested too deeply") from None


def refuse(param: str, why: str):
    raise OpenAIError(f"{param} is not supported: {why}", param)


def _check(cond: bool, param: str, message: str) -> None:
    if not cond:
        raise OpenAIError(message, param)


def sampling_of(r: _Request, max_tokens: int | None, logprobs: int | None = None,
                prompt_logprobs: int | None = None) -> P.SamplingParams:
    """SamplingParams from the common fields; raises OpenAIError naming a bad field."""
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    bias = {}
    for k, v in (r.logit_bias or {}).items():
        _check(k.isdigit() and len(k) < 11, "logit_bias", f"logit_bias keys must be token ids, got {k[:32]!r}")
        bias[int(k)] = v
    kw = dict(temperature=r.temperature, top_p=r.top_p, n=r.n, seed=r.seed, presence_penalty=r.presence_penalty,
              frequency_penalty=r.frequency_penalty, min_p=r.min_p, repetition_penalty=r.repetition_penalty,
              min_tokens=r.min_tokens, ignore_eos=r.ignore_eos, stop_token_ids=r.stop_token_ids,
              include_stop_str_in_output=r.include_stop_str_in_output, max_tokens=max_tokens)
    kw = {k: v for k, v in kw.items() if v is not None}
    try:
        kw["grammar"] = S.grammar_of(**{f: getattr(r, f) for f in S.FIELDS})
    except S.StructuredError as e:
        raise OpenAIError(str(e), e.param) from None
    if r.top_k is not None:
        kw["top_k"] = 0 if r.top_k == -1 else r.top_k  # vLLM spells "off" -1
    sp = P.SamplingParams(stop=stop, logit_bias=bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **kw)
    return check_sampling(sp)


def check_sampling(sp: P.SamplingParams, limit: int = 1 << 20) -> P.SamplingParams:
    """Ranges every front door shares (the engine checks the model-specific ones again)."""
    problem = sp.validate(limit)
    if problem:
        raise OpenAIError(problem, problem.split(" ", 1)[0])
    return sp


def _extensions(plan: Plan, r: _Request) -> Plan:
    plan.session = r.session
    if r.priority is not None:
        p = PRIORITIES.get(r.priority) if isinstance(r.priority, str) else r.priority
        _check(p in (P.INTERACTIVE, P.BATCH), "priority", f"priority must be one of {sorted(PRIORITIES)}")
        plan.priority = p
    if r.deadline_ms is not None:
        _check(0.0 <= r.deadline_ms <= 3.6e6, "deadline_ms", "deadline_ms must be in [0, 3600000]")
        plan.deadline_ms = r.deadline_ms
    if r.cache_salt is not None:
        _check(len(r.cache_salt) <= 256, "cache_salt", "cache_salt takes at most 256 characters")
        plan.cache_salt = r.cache_salt
    if r.stream_options is not None:
        _check(bool(r.stream), "stream_options", "stream_options needs stream: true")
        if r.stream_options.include_obfuscation:
            refuse("stream_options.include_obfuscation", "chunks are sent without obfuscation padding")
    plan.stream = bool(r.stream)
    plan.include_usage = bool(r.stream_options and r.stream_options.include_usage)
    return plan


# -- chat -------------------------------------------------------------------------------------
_UNSUPPORTED_CHAT = {
    "functions": "function calling is not available (deprecated by OpenAI in favour of tools)",
    "function_call": "function calling is not available (deprecated by OpenAI in favour of tools)",
    "audio": "the model is text-only",
    "prediction": "predicted outputs are not available",
    "reasoning_effort": "the model does not reason",
    "verbosity": "the model has no verbosity setting",
    "web_search_options": "there is no web search",
}


def parse_chat(body: bytes) -> Plan:
    r = decode(body, ChatCompletionRequest)
    for name, why in _UNSUPPORTED_CHAT.items():
        value = getattr(r, name)
        if value is None or value == []:
            continue
        refuse(name, why)
    if r.store:
        refuse("store", "completions are not stored")
    if r.service_tier not in (None, "auto", "default"):
        refuse("service_tier", "only 'auto' and 'default'")
    if r.modalities not in (None, ["text"]):
        refuse("modalities", "the model is text-only: ['text']")
    _check(not (r.top_logprobs is not None and not r.logprobs), "top_logprobs",
           "top_logprobs needs logprobs: true")
    _check(r.top_logprobs is None or 0 <= r.top_logprobs <= P.MAX_LOGPROBS, "top_logprobs",
           f"top_logprobs must be in [0, {P.MAX_LOGPROBS}]")
    if r.max_tokens is not None and r.max_completion_tokens is not None and r.max_tokens != r.max_completion_tokens:
        raise OpenAIError("give max_completion_tokens or max_tokens, not two different values", "max_tokens")
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    logprobs = (r.top_logprobs or 0) if r.logprobs else None
    plan = Plan("chat", [messages(r.messages)], sampling_of(r, max_tokens, logprobs), r.model, logprobs=logprobs)
    try:
        plan.tools = T.parse_tools(r.tools, r.tool_choice, r.parallel_tool_calls)
    except T.ToolError as e:
        raise OpenAIError(str(e), e.param) from None
    if plan.tools is not None and plan.tools.forced and plan.sampling.grammar:
        raise OpenAIError("a required or named tool_choice already constrains the answer: drop response_format "
                          "(or the guided_* field), or use tool_choice \"auto\"", "tool_choice")
    plan = _extensions(plan, r)
    plan.session = plan.session or r.prompt_cache_key
    return plan


def messages(msgs: list[ChatMessage]) -> list[dict]:
    """The conversation as the chat template takes it (tool calls and results as
    wire.tools renders them); every refusal names the message."""
    _check(bool(msgs), "messages", "messages must not be empty")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if m.role == "function":
            refuse(f"{where}.role", "function messages are deprecated by OpenAI: answer tool calls with role "
                                    "\"tool\" and their tool_call_id")
        _check(m.role in ROLES, f"{where}.role", f"{where}.role must be one of {sorted(ROLES)}, got {m.role!r}")
        for name in ("function_call", "audio"):
            if getattr(m, name) is not None:
                refuse(f"{where}.{name}", "function_call is deprecated (use tool_calls); the model is text-only")
        _check(m.tool_calls is None or m.role == "assistant", f"{where}.tool_calls",
               f"{where}: only assistant messages carry tool_calls")
        _check(m.tool_call_id is None or m.role == "tool", f"{where}.tool_call_id",
               f"{where}: only tool messages carry a tool_call_id")
        if m.content is None:
            _check(m.role == "assistant" and (m.refusal is not None or bool(m.tool_calls)), f"{where}.content",
                   f"{where}.content is required")
        out.append({"role": "system" if m.role == "developer" else m.role, "content": _text(m, where)})
        if m.name is not None:
            out[-1]["name"] = m.name
        if m.tool_calls:
            try:
                out[-1]["tool_calls"] = T.parse_calls(m.tool_calls, where)
            except T.ToolError as e:
                raise OpenAIError(str(e), e.param) from None
        if m.tool_call_id is not None:
            out[-1]["tool_call_id"] = m.tool_call_id
    _check_tool_turns(out)
    return out


def _check_tool_turns(msgs: list[dict]) -> None:
    """OpenAI's pairing of calls and results: every tool message answers, by its
    tool_call_id, a call of the assistant message before its run of tool messages, and
    every such call is answered before the conversation goes on."""
    pending: dict[str, None] = {}  # ids of the last assistant message's calls not yet answered
    called = -1  # index of the assistant message they came from
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if m["role"] == "tool":
            _check("tool_call_id" in m, f"{where}.tool_call_id", f"{where}: a tool message needs its tool_call_id")
            _check(called >= 0, f"{where}.role", f"{where}: a message with role 'tool' must answer a preceding "
                                                 "assistant message's tool_calls")
            _check(m["tool_call_id"] in pending, f"{where}.tool_call_id",
                   f"{where}.tool_call_id {m['tool_call_id']!r} is not an unanswered call of messages[{called}]")
            del pending[m["tool_call_id"]]
            continue
        _unanswered(pending, called)
        called, pending = (i, dict.fromkeys(c["id"] for c in m["tool_calls"])) if m.get("tool_calls") else (-1, {})
    _unanswered(pending, called)


def _unanswered(pending: dict[str, None], called: int) -> None:
    _check(not pending, f"messages[{called}].role",
           f"messages[{called}]: an assistant message with tool_calls must be followed by tool messages "
           f"answering each tool_call_id; unanswered: {', '.join(pending)}")


def _text(m: ChatMessage, where: str) -> str:
    if m.content is None:
        return m.refusal or ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for j, part in enumerate(m.content):
        p = f"{where}.content[{j}]"
        if part.type == "text" and part.text is not None:
            parts.append(part.text)
        elif part.type == "refusal" and m.role == "assistant" and part.refusal is not None:
            parts.append(part.refusal)
        elif part.type in ("image_url", "input_audio", "file"):
            raise OpenAIError(f"{p}: {part.type} content is not supported: the model reads text only",
                              f"{p}.type")
        else:
            raise OpenAIError(f"{p}: a {part.type!r} part needs its {part.type!r} field (text parts: "
                              "{\"type\": \"text\", \"text\": ...})", f"{p}.type")
    return "".join(parts)


# -- completions ------------------------------------------------------------------------------
def parse_completion(body: bytes) -> Plan:
    r = decode(body, CompletionRequest)
    n = 1 if r.n is None else r.n
    if r.best_of is not None and r.best_of != n:
        refuse("best_of", "only best_of == n (every sample is returned; none is ranked away)")
    prompts = _prompts(r.prompt)
    if r.suffix is not None:
        _check(all(isinstance(p, str) for p in prompts), "suffix", "suffix needs text prompts")
        prompts = [Fim(prefix=p, suffix=r.suffix) for p in prompts]
        _check(not r.echo, "echo", "echo cannot be combined with suffix")
    prompt_logprobs = r.logprobs if r.echo and r.logprobs is not None else None
    plan = Plan("completion", prompts, sampling_of(r, r.max_tokens, r.logprobs, prompt_logprobs), r.model,
                echo=bool(r.echo), logprobs=r.logprobs)
    return _extensions(plan, r)


def _prompts(prompt) -> list:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    _check(bool(prompt), "prompt", "prompt must not be empty")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_id(t) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise OpenAIError("prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                      "lists", "prompt")


def _is_id(t) -> bool:
    return type(t) is int and 0 <= t < 1 << 31


MAX_PROMPTS = 64


def fan_out(plan: Plan) -> Plan:
    _check(len(plan.prompts) <= MAX_PROMPTS, "prompt", f"at most {MAX_PROMPTS} prompts per request")
    _check(len(plan.prompts) * plan.sampling.n <= 4 * P.MAX_N, "n", "prompts x n must be at most "
           f"{4 * P.MAX_N}")
    return plan


SAMPLING_FIELDS = frozenset(P.SamplingParams.__struct_fields__)


def error_of(code: str, message: str, retry_after_s: float | None = None) -> OpenAIError:
    """An error of the internal protocol (a replica's, the engine's) or of the proxy's public one as an
    OpenAI error: its status from `HTTP_STATUS`, `param` the sampling field its message starts with."""
    first = message.split(" ", 1)[0]
    return OpenAIError(message, first if first in SAMPLING_FIELDS else None, http_status(code), code, retry_after_s)


def not_found_model(name: str) -> OpenAIError:
    return OpenAIError(f"model {name[:200]!r} is not served here; see GET /v1/models", "model", 404, P.NOT_FOUND)
