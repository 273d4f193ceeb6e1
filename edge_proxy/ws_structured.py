"""Structured output and tool calling over the public WebSocket.

A `generate` may carry OpenAI's `response_format` (or vLLM's `structured_outputs`:
regex, choice, grammar) and `tools` / `tool_choice` / `parallel_tool_calls`, with
the same meaning and checks as the OpenAI API (wire.structured, wire.tools): the
grammar travels in the request's SamplingParams, the tools are rendered into the
prompt in the model's format. With tools shown, `ToolSink` (a `sinks.DeltaSink`)
sits between the request and the connection: deltas carry the content only
(tool-call markup is held back and parsed by wire.tool_calls) and `done` carries
the calls in `tool_calls`, its finish_reason "tool_calls" where it would say "stop"
(a named tool_choice keeps "stop", as OpenAI does).
"""

from __future__ import annotations

import msgspec

from edge_proxy import protocol as pp
from edge_proxy.sinks import DeltaSink, Served
from wire import openai_prompts as OP
from wire import structured as S
from wire import tools as T
from wire.openai import OpenAIError
from wire.tool_calls import ToolCallStream


def structured(m: pp.Generate, tokenizer):
    """(the request's sampling with its grammar, its Tools or None); ProtocolError when refused."""
    try:
        grammar = S.grammar_of(response_format=m.response_format, structured_outputs=m.structured_outputs)
        tools = T.parse_tools(m.tools, m.tool_choice, m.parallel_tool_calls)
        if tools is not None and tools.forced:
            if grammar:
                raise T.ToolError("tool_choice", "a required or named tool_choice already constrains the answer: "
                                                 "drop response_format or use tool_choice \"auto\"")
            grammar = OP.tool_grammar(tools, tokenizer)
    except (S.StructuredError, T.ToolError, OpenAIError) as e:
        raise pp.ProtocolError(pp.BAD_REQUEST, str(e)) from None
    sp = m.sampling.params()
    if grammar:
        sp = msgspec.structs.replace(sp, grammar=grammar)
    return sp, tools


def messages(m: pp.Generate) -> list[dict] | None:
    """The conversation as wire.tools renders it (tool calls and results included)."""
    if m.messages is None:
        return None
    out = []
    for x in m.messages:
        d = {"role": x.role, "content": x.content}
        if x.tool_calls:
            d["tool_calls"] = msgspec.to_builtins(x.tool_calls)
        if x.tool_call_id is not None:
            d["tool_call_id"] = x.tool_call_id
        out.append(d)
    return out


class ToolSink:
    """A request's sink that parses tool calls out of its text (then hands on to `inner`)."""

    __slots__ = ("inner", "parser", "named")

    def __init__(self, inner: DeltaSink, tokenizer, tools: T.Tools):
        self.inner = inner
        self.parser = ToolCallStream(OP.tool_format(tokenizer).name)
        self.named = tools.choice == "function"

    def delta(self, s: Served, text: str, ntok: int) -> None:
        content = "".join(e for e in self.parser.feed(text) if isinstance(e, str))
        if content:
            self.inner.delta(s, content, ntok)

    def finish(self, s: Served, msg: pp.Done | pp.Error) -> None:
        if type(msg) is pp.Done:
            rest = "".join(e for e in self.parser.finish() if isinstance(e, str))
            if rest:
                self.inner.delta(s, rest, 0)
            calls = self.parser.calls
            if calls:
                msg.tool_calls = calls
                if msg.finish_reason == "stop" and not self.named:
                    msg.finish_reason = "tool_calls"
        self.inner.finish(s, msg)
