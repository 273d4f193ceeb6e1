"""Tool calling at the front door: OpenAI's `tools` / `tool_choice`, a conversation's
tool calls and results rendered for the model, and the grammar that makes a call
when the choice requires one (no torch; wire.tool_calls parses the answer back).

Formats, by what the model's chat template shows (`ToolFormat.of`):

  * `hermes` -- Hermes 2 Pro, Qwen2 / Qwen2.5 / Qwen3 and every template that writes
    `<tool_call>`: the template renders the tool definitions (`tools=`), assistant
    `tool_calls` and `tool` messages itself; the model answers
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per
    call (parallel calls: several blocks).
  * `llama3_json` -- Llama 3.1 / 3.2 / 3.3 (templates with `<|python_tag|>`): the
    template renders the definitions; the model answers one JSON object
    `{"name": ..., "parameters": {...}}` (one call per turn: the template renders
    no more than one back).
  * `edgechat` -- templates that know nothing of tools (SmolLM2, the default model):
    edgechat writes the definitions into the system message itself and asks for the
    hermes answer; past calls become `<tool_call>` blocks in the assistant's text and
    each result a turn of the role `tool` holding the result's text (the template
    prints the role as it prints any other; SmolLM2 answers from a `tool` turn, where
    a `<tool_response>` block in a user turn made it echo the block).

A template that renders tools in another format (Mistral's `[TOOL_CALLS]`, ...) is
refused with a 400 rather than parsed wrongly.

tool_choice: `auto` -- the model writes freely, calls it makes are parsed back;
`none` -- no tools are shown and nothing is parsed; `required` -- the grammar
makes the answer one or more calls (one if `parallel_tool_calls` is false) of
any of the tools, arguments valid against their schema; a named function -- one
call of that function.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import msgspec

from wire import structured as S

MAX_TOOLS = 128


class ToolError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class Function(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    function: Function


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    """One call, as OpenAI names it in messages and answers."""

    id: str
    function: FunctionCall
    type: str = "function"


@dataclass
class Tools:
    """A request's tools and how it wants them used."""

    tools: list[Function]
    choice: str = "auto"  # "auto" | "required" | "none" | "function" (named: `name`)
    name: str | None = None
    parallel: bool = True

    @property
    def shown(self) -> bool:
        """Whether the model sees the tools and its answer is parsed for calls."""
        return self.choice != "none" and bool(self.tools)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")


def parse_tools(tools, tool_choice, parallel_tool_calls) -> Tools | None:
    """Tools from the request's fields (JSON values), or None when there are none."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "tool_choice needs tools")
        return None
    try:
        specs = msgspec.convert(tools, list[Tool])
    except msgspec.ValidationError as e:
        raise ToolError("tools", f"tools: {e} (each is {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                 "\"parameters\": {...}}}})") from None
    if len(specs) > MAX_TOOLS:
        raise ToolError("tools", f"at most {MAX_TOOLS} tools")
    names = set()
    for i, t in enumerate(specs):
        if t.type != "function":
            raise ToolError(f"tools[{i}].type", f"tools[{i}].type must be \"function\", got {t.type!r}")
        if not t.function.name or len(t.function.name) > 64 or t.function.name in names:
            raise ToolError(f"tools[{i}].function.name", "tool names are 1..64 characters and unique")
        names.add(t.function.name)
    out = Tools([t.function for t in specs], parallel=parallel_tool_calls is not False)
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        out.choice = tool_choice or "auto"
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        out.choice, out.name = "function", tool_choice["function"]["name"]
        if out.name not in names:
            raise ToolError("tool_choice.function.name", f"tool_choice names {out.name!r}, which is not in tools")
    else:
        raise ToolError("tool_choice", 'tool_choice is "none", "auto", "required" or {"type": "function", '
                                       '"function": {"name": ...}}')
    return out


def parse_calls(value, where: str) -> list[dict]:
    """An assistant message's tool_calls as plain dicts (id, type, function: name, arguments)."""
    try:
        calls = msgspec.convert(value, list[ToolCall])
    except msgspec.ValidationError as e:
        raise ToolError(f"{where}.tool_calls", f"{where}.tool_calls: {e}") from None
    return [msgspec.to_builtins(c) for c in calls]


def _arguments(text: str):
    """A call's arguments as the template wants them: the JSON value, or the text if it is none."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# -- formats --------------------------------------------------------------------------------
class ToolFormat:
    """How one family of models is shown tools and writes calls."""

    name = ""
    args_key = "arguments"
    native = True  # the chat template renders tools, calls and results itself

    @staticmethod
    def of(chat_template: str | None) -> ToolFormat:
        t = chat_template or ""
        if "<tool_call>" in t:
            return Hermes()
        if "<|python_tag|>" in t:
            return Llama3Json()
        if "tools" not in t and "tool_calls" not in t:
            return EdgechatHermes()
        raise ToolError("tools", "this model's chat template renders tools in a format edgechat does not parse "
                                 "(hermes <tool_call>, llama3 JSON, or a template without tools)")

    # -- prompt ------------------------------------------------------------------
    def render(self, messages: list[dict], tools: Tools | None) -> tuple[list[dict], dict]:
        """(messages for the chat template, its extra keyword arguments)."""
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [{"id": c["id"], "type": "function", "function": {
                    "name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
                    for c in m["tool_calls"]]}
            out.append(m)
        kw = {"tools": [{"type": "function", "function": msgspec.to_builtins(f)} for f in tools.tools]} \
            if tools is not None and tools.shown else {}
        return out, kw

    # -- forced calls ----------------------------------------------------------------
    def call_schema(self, fns: list[Function]) -> dict:
        """JSON schema of one call's object: the name first, then the arguments."""
        def one(f: Function) -> dict:
            params = f.parameters if f.parameters is not None else {"type": "object"}
            return {"type": "object", "properties": {"name": {"const": f.name}, self.args_key: params},
                    "required": ["name", self.args_key], "additionalProperties": False}
        return one(fns[0]) if len(fns) == 1 else {"anyOf": [one(f) for f in fns]}

    def grammar(self, tools: Tools) -> str:
        """The llguidance grammar of an answer that is calls only ("" unless forced)."""
        if not tools.forced:
            return ""
        fns = [f for f in tools.tools if tools.choice == "required" or f.name == tools.name]
        schema = {**self.call_schema(fns), "x-guidance": S.JSON_LAYOUT}
        lark = self.lark(json.dumps(schema), tools.parallel and tools.choice == "required")
        return S.check(S.cfg_grammar(lark), "tools")

    def lark(self, call_json: str, parallel: bool) -> str:
        raise NotImplementedError


class Hermes(ToolFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def lark(self, call_json: str, parallel: bool) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        return f'start: call{more}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {call_json}\n'


class EdgechatHermes(Hermes):
    """The hermes answer, for a template without tools: edgechat renders the rest."""

    name = "edgechat"
    native = False

    def render(self, messages: list[dict], tools: Tools | None) -> tuple[list[dict], dict]:
        out: list[dict] = []
        for m in messages:
            if m["role"] == "tool":
                m = {"role": "tool", "content": m["content"]}
            elif m.get("tool_calls"):
                blocks = [self.block(c["function"]) for c in m["tool_calls"]]
                m = {"role": m["role"], "content": "\n".join(([m["content"]] if m.get("content") else []) + blocks)}
            out.append(m)
        if tools is not None and tools.shown:
            prompt = self.system_prompt(tools)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out, {}

    @staticmethod
    def block(fn: dict) -> str:
        """A past call as the model writes one."""
        call = {"name": fn["name"], "arguments": _arguments(fn["arguments"])}
        return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"

    @staticmethod
    def system_prompt(tools: Tools) -> str:
        defs = "\n".join(json.dumps({"type": "function", "function": msgspec.to_builtins(f)}, ensure_ascii=False)
                         for f in tools.tools)
        return ("You can call functions to answer. The functions you can call are listed between <tools> and "
                f"</tools>, one JSON definition per line:\n<tools>\n{defs}\n</tools>\n\n"
                "To call a function, answer with one block per call, each holding a JSON object with the "
                "function's name and its arguments:\n<tool_call>\n"
                '{"name": "function name", "arguments": {"argument": "value"}}\n</tool_call>\n'
                "Each result comes back in a tool turn of its own.")


class Llama3Json(ToolFormat):
    name = "llama3_json"
    args_key = "parameters"

    def render(self, messages: list[dict], tools: Tools | None) -> tuple[list[dict], dict]:
        for i, m in enumerate(messages):
            if len(m.get("tool_calls") or ()) > 1:
                raise ToolError(f"messages[{i}].tool_calls", "Llama 3 chat templates render one tool call per "
                                                             "assistant message")
        return super().render(messages, tools)

    def lark(self, call_json: str, parallel: bool) -> str:
        return f"start: %json {call_json}\n"  # one call per turn


def chat_ids(tokenizer, messages: list[dict], tools: Tools | None) -> list[int]:
    """Token ids of a conversation that may hold tool calls, results and definitions."""
    if tools is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return list(tokenizer.encode_chat(messages))
    fmt = ToolFormat.of(getattr(tokenizer, "chat_template", None))
    msgs, kw = fmt.render(messages, tools)
    return list(tokenizer.encode_chat(msgs, **kw))
