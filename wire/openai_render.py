"""OpenAI response bodies and SSE chunks, for the proxy and the replica alike (no torch).

`Response` follows one request's choices (choice p * n + j: sample j of prompt p) as
its token messages arrive and renders either the final JSON body or, streaming,
each chunk exactly as OpenAI sends them:

    data: {... "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, ...}]}   chat, per choice
    data: {... "choices": [{"index": i, "delta": {"content": "..."}, "logprobs": ..., "finish_reason": null}]}
    data: {... "choices": [{"index": i, "delta": {}, "logprobs": null, "finish_reason": "stop"}]}
    data: {... "choices": [], "usage": {...}}                     with stream_options.include_usage
    data: [DONE]

(completions: `"text"` instead of `"delta"`). With include_usage every other chunk
carries `"usage": null`, as OpenAI's do. A plain text chunk is a pre-rendered
prefix + the JSON-encoded text + a suffix: no dict is built per token.

Logprobs: chat `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`;
completions `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (the sampled
token is always among `top_logprobs`, as OpenAI documents). With `echo`, a
completion choice starts with its prompt (and, with logprobs, the prompt's tokens,
the first one's logprob null). `piece(id) -> (text, bytes)` names tokens.

Tools (chat, `tool_format` set): each choice's text runs through a
wire.tool_calls.ToolCallStream; content and calls stream as OpenAI's deltas
(`{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}`,
then `{"tool_calls": [{"index", "function": {"arguments": piece}}]}`), the whole
answer's message carries `tool_calls` (content null when there is none), and a
choice that called a tool finishes with "tool_calls" where it would say "stop"
(unless tool_choice named the function: OpenAI then says "stop").
"""

from __future__ import annotations

import msgspec

from wire import protocol as P
from wire.openai import Plan
from wire.tool_calls import ArgsDelta, CallStart, ToolCallStream

_enc = msgspec.json.Encoder()
_MARK = "\x00edgechat\x00"


def sse(obj) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, accepted: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted}}


class _Choice:
    __slots__ = ("text", "lp", "offset", "finish", "started", "ntok", "tools")

    def __init__(self, tools: ToolCallStream | None = None):
        self.text: list[str] = []
        self.lp: list = []  # chat: entries; completions: (token, logprob, top dict, offset)
        self.offset = 0  # completions: text offset of the next token
        self.finish: str | None = None
        self.started = False
        self.ntok = 0
        self.tools = tools  # parses tool calls out of the text (chat with tools)


class Response:
    def __init__(self, plan: Plan, rid: str, model: str, created: int, piece, prompt_ids: list[list[int]],
                 prompts_text: list[str] | None = None, tool_format: str = ""):
        self.plan, self.rid, self.model, self.created, self.piece = plan, rid, model, created, piece
        self.chat = plan.kind == "chat"
        self.n = plan.sampling.n
        self.choices = [_Choice(ToolCallStream(tool_format) if tool_format else None)
                        for _ in range(len(plan.prompts) * self.n)]
        self.prompts_text = prompts_text  # echo: each prompt's text
        self.prompt_ids = prompt_ids
        self.prompt_lps: list[list | None] = [None for _ in plan.prompts]  # echo with logprobs
        self.cached = [0] * len(plan.prompts)  # prompt tokens served from the prefix cache (sample 0's)
        self.accepted = 0
        self.pending = len(self.choices)
        self.extra: dict | None = None  # added to the body / last chunk (the proxy's `edgechat`)
        self.held: dict[int, str] = {}  # choice -> finish reason not rendered yet (message(hold=True))
        self.base = {"id": rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": created, "model": model}
        self._tpl: dict[int, tuple[bytes, bytes]] = {}

    # -- messages ----------------------------------------------------------------------------
    def message(self, p: int, msg, hold: bool = False) -> bytes:
        """A Tokens or Finished message of prompt p's generation (sample msg.index).
        `hold`: a Finished only records its reason; `end(p)` renders it (the proxy's
        last chunk carries what its Done adds)."""
        index = p * self.n + msg.index
        c = self.choices[index]
        if c.finish is not None:
            return b""
        out = b""
        if msg.ids or msg.text or msg.prompt_logprobs:
            c.ntok += len(msg.ids)
            out = self.tokens(index, msg.text, msg.ids, msg.logprobs, msg.prompt_logprobs)
        if type(msg) is P.Finished:
            if msg.index == 0:
                self.cached[p] = msg.usage.cached_tokens
            self.accepted += msg.usage.accepted_draft_tokens
            if hold:
                self.held[index] = msg.finish_reason
            else:
                out += self.finish(index, msg.finish_reason)
        return out

    def end(self, p: int, reason: str) -> bytes:
        """Prompt p's generation is over: its choices not finished yet finish (held reasons first)."""
        return b"".join(self.finish(i, self.held.pop(i, reason)) for i in range(p * self.n, (p + 1) * self.n)
                        if self.choices[i].finish is None)

    @property
    def done(self) -> bool:
        return self.pending == 0

    def usage(self) -> dict:
        return usage_dict(sum(len(ids) for ids in self.prompt_ids), sum(c.ntok for c in self.choices),
                          sum(self.cached), self.accepted)

    def close(self) -> bytes:
        """Streaming: what follows the last choice's finish."""
        return self.usage_chunk(self.usage()) + DONE

    def answer(self) -> bytes:
        return self.body(self.usage(), self.extra)

    # -- streaming -------------------------------------------------------------------------
    def _chunk(self, choice: dict) -> bytes:
        obj = {**self.base, "choices": [choice]}
        if self.plan.include_usage:
            obj["usage"] = None
        return sse(obj)

    def _text_chunk(self, index: int, text: str) -> bytes:
        tpl = self._tpl.get(index)
        if tpl is None:
            body = {"index": index, "delta": {"content": _MARK}} if self.chat else {"index": index, "text": _MARK}
            body.update(logprobs=None, finish_reason=None)
            tpl = self._tpl[index] = tuple(self._chunk(body).split(_enc.encode(_MARK)))
        return tpl[0] + _enc.encode(text) + tpl[1]

    def start(self) -> bytes:
        """Chat: the role delta of every choice, sent before any token."""
        if not self.chat:
            return b""
        return b"".join(self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}) for i in range(len(self.choices)))

    def tokens(self, index: int, text: str, ids: list[int], logprobs: list, prompt_logprobs: list = ()) -> bytes:
        """A choice's new text (and token logprobs): the SSE chunk when streaming, else b""."""
        c = self.choices[index]
        p = index // self.n
        if prompt_logprobs and self.prompt_lps[p] is None:
            self.prompt_lps[p] = list(prompt_logprobs)
        head, head_lp = "", []
        if not c.started:
            c.started = True
            if self.plan.echo:
                head, head_lp = self.prompts_text[p], self._echo_logprobs(c, p)
        entries = head_lp + (self._entries(c, ids, logprobs) if self.plan.logprobs is not None else [])
        c.text.append(head + text)
        events = c.tools.feed(text) if c.tools is not None else None
        if not self.plan.stream:
            c.lp.extend(entries)
            return b""
        if events is not None:
            return self._tool_chunks(index, events, entries)
        if self.plan.logprobs is None:
            return self._text_chunk(index, head + text) if head or text else b""
        body = {"index": index, "delta": {"content": text}} if self.chat else {"index": index, "text": head + text}
        body.update(logprobs=self._logprobs_obj(entries), finish_reason=None)
        return self._chunk(body)

    def _tool_chunks(self, index: int, events: list, entries: list) -> bytes:
        """A choice's content and tool-call deltas (logprobs on the first chunk)."""
        out = []
        lp = self._logprobs_obj(entries) if self.plan.logprobs is not None and entries else None
        if not events and lp is not None:
            events = [""]
        for e in events:
            if isinstance(e, str):
                delta = {"content": e}
            elif isinstance(e, CallStart):
                delta = {"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                         "function": {"name": e.name, "arguments": ""}}]}
            else:
                assert isinstance(e, ArgsDelta)
                delta = {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}
            out.append(self._chunk({"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}))
            lp = None
        return b"".join(out)

    def finish(self, index: int, reason: str) -> bytes:
        c = self.choices[index]
        pre = self.tokens(index, "", [], []) if not c.started and self.plan.echo else b""
        if c.tools is not None:
            events = c.tools.finish()
            if self.plan.stream:
                pre += self._tool_chunks(index, events, [])
            if c.tools.calls and reason == P.FINISH_STOP and self.plan.tools.choice != "function":
                reason = "tool_calls"  # (OpenAI says "stop" after a call it was told to make)
        c.finish = reason
        self.pending -= 1
        if not self.plan.stream:
            return b""
        body = {"index": index, "delta": {}} if self.chat else {"index": index, "text": ""}
        body.update(logprobs=None, finish_reason=reason)
        obj = {**self.base, "choices": [body]}
        if self.plan.include_usage:
            obj["usage"] = None
        if self.pending == 0 and self.extra:
            obj.update(self.extra)
        return pre + sse(obj)

    def usage_chunk(self, usage: dict) -> bytes:
        return sse({**self.base, "choices": [], "usage": usage}) if self.plan.include_usage else b""

    # -- the whole answer ----------------------------------------------------------------------
    def body(self, usage: dict, extra: dict | None = None) -> bytes:
        choices = []
        for i, c in enumerate(self.choices):
            lp = self._logprobs_obj(c.lp) if self.plan.logprobs is not None else None
            text = "".join(c.text)
            if self.chat:
                message = {"role": "assistant", "content": text, "refusal": None}
                if c.tools is not None:
                    message["content"] = c.tools.content or (None if c.tools.calls else "")
                    if c.tools.calls:
                        message["tool_calls"] = msgspec.to_builtins(c.tools.calls)
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": c.finish})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish})
        obj = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices, "usage": usage}
        if extra:
            obj.update(extra)
        return _enc.encode(obj)

    # -- logprobs ------------------------------------------------------------------------------
    def _entries(self, c: _Choice, ids: list[int], logprobs: list) -> list:
        out = []
        for tok, rec in zip(ids, logprobs):
            out.append(self._entry(c, tok, rec))
        return out

    def _entry(self, c: _Choice, tok: int, rec: P.TokenLogprob | None):
        text, raw = self.piece(tok)
        if self.chat:
            top = [] if rec is None else [_named(self.piece(t), v) for t, v in zip(rec.top_ids, rec.top_logprobs)]
            return {"token": text, "logprob": rec.logprob, "bytes": list(raw), "top_logprobs": top}
        top = None
        if rec is not None:
            top = {self.piece(t)[0]: v for t, v in zip(rec.top_ids, rec.top_logprobs)}
            top.setdefault(text, rec.logprob)
        entry = (text, None if rec is None else rec.logprob, top, c.offset)
        c.offset += len(text)
        return entry

    def _echo_logprobs(self, c: _Choice, p: int) -> list:
        if self.plan.logprobs is None:
            c.offset += len(self.prompts_text[p])
            return []
        ids, lps = self.prompt_ids[p], self.prompt_lps[p] or []
        return [self._entry(c, t, lps[j - 1] if 0 < j <= len(lps) else None) for j, t in enumerate(ids)]

    def _logprobs_obj(self, entries: list) -> dict:
        if self.chat:
            return {"content": entries, "refusal": None}
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}


def _named(piece: tuple[str, bytes], logprob: float) -> dict:
    return {"token": piece[0], "logprob": logprob, "bytes": list(piece[1])}
