"""Tool calling at the front door, socket-free: tools and tool_choice, the model
formats (rendering through real templates), the grammar of a forced call checked
token by token with the default model's tokenizer, the streaming parser under every
chunking, and OpenAI's answer shapes (whole and streamed)."""

import json

import msgspec
import pytest

from wire import openai as O
from wire import tools as T
from wire.openai_render import Response
from wire.tool_calls import ArgsDelta, CallStart, ToolCallStream
from replica.tokenizer import Tokenizer
from tests.wire.grammars import accepts

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"people": {"type": "integer", "minimum": 1}}, "required": ["people"]}}}
# Templates in the shape of the families' own (tool definitions, calls and results rendered by the template).
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n"
    "{% if m.tool_calls %}<|python_tag|>{{ {'name': m.tool_calls[0].function.name, 'parameters': "
    "m.tool_calls[0].function.arguments} | tojson }}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if tools %}[{% for t in tools %}{{ t.function.name }} {% endfor %}]{% endif %}"
    "<|start_header_id|>assistant<|end_header_id|>\n")


def with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok.backend, eos_token_ids=tok.eos_token_ids, chat_template=template)


def tools(choice=None, parallel=None, specs=(WEATHER, BOOK)) -> T.Tools:
    return T.parse_tools(list(specs), choice, parallel)


def test_tool_choice_modes():
    assert tools().choice == "auto" and tools().shown and not tools().forced and tools().parallel
    assert tools("none").shown is False and tools("required", False).forced and not tools("required", False).parallel
    named = tools({"type": "function", "function": {"name": "book"}})
    assert named.forced and named.choice == "function" and named.name == "book"
    assert T.parse_tools(None, "auto", None) is None and T.parse_tools([], None, None) is None


def test_formats_from_the_template(tok):
    assert T.ToolFormat.of(tok.chat_template).name == "edgechat"  # SmolLM2: no tools in its template
    assert T.ToolFormat.of(HERMES_TEMPLATE).name == "hermes"
    assert T.ToolFormat.of(LLAMA3_TEMPLATE).name == "llama3_json"
    with pytest.raises(T.ToolError):
        T.ToolFormat.of("{% for m in messages %}[AVAILABLE_TOOLS]{{ tools }}{% endfor %}")


CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
    {"role": "tool", "content": '{"temp": -3}', "tool_call_id": "call_1"},
]


@pytest.mark.parametrize("template, shows", [
    (None, ['"name": "get_weather"', "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"",
            "<|im_start|>tool\n{\"temp\": -3}"]),
    (HERMES_TEMPLATE, ['<tools>{"type": "function", "function": {"name": "get_weather"',
                       '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}']),
    (LLAMA3_TEMPLATE, ["[get_weather book ]", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"',
                       "ipython<|end_header_id|>\n{\"temp\": -3}"]),
])
def test_calls_results_and_definitions_reach_the_prompt(tok, template, shows):
    t = with_template(tok, template or tok.chat_template)
    text = t.decode(T.chat_ids(t, CONVERSATION, tools()), skip_special_tokens=False)
    for s in shows:
        assert s in text, (s, text)
    hidden = t.decode(T.chat_ids(t, CONVERSATION, tools("none")), skip_special_tokens=False)
    assert "book" not in hidden  # tool_choice none: definitions not shown, the history still is
    plain = [{"role": "user", "content": "hi"}]
    assert T.chat_ids(t, plain, None) == t.encode_chat(plain)


def test_llama3_renders_one_call_per_message(tok):
    t = with_template(tok, LLAMA3_TEMPLATE)
    two = [{**CONVERSATION[1], "tool_calls": CONVERSATION[1]["tool_calls"] * 2}]
    with pytest.raises(T.ToolError):
        T.chat_ids(t, [CONVERSATION[0], *two], tools())


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'


def test_forced_call_grammars(tok):
    hermes = T.Hermes()
    required = hermes.grammar(tools("required"))
    assert accepts(tok, required, CALL) and accepts(tok, required, CALL + "\n" + CALL.replace("Oslo", "Rome"))
    assert not accepts(tok, required, "Sure! " + CALL)  # calls only
    assert not accepts(tok, required, CALL.replace('"c"', '"k"'))  # arguments follow the schema
    assert not accepts(tok, required, CALL.replace('"unit": "c"', '"extra": 1'))
    single = hermes.grammar(tools("required", False))
    assert accepts(tok, single, CALL) and not accepts(tok, single, CALL + "\n" + CALL)
    named = hermes.grammar(tools({"type": "function", "function": {"name": "book"}}))
    assert accepts(tok, named, '<tool_call>\n{"name": "book", "arguments": {"people": 2}}\n</tool_call>')
    assert not accepts(tok, named, CALL)
    llama = T.Llama3Json().grammar(tools("required"))
    assert accepts(tok, llama, '{"name": "book", "parameters": {"people": 4}}')
    assert hermes.grammar(tools()) == ""  # auto: free text, parsed afterwards


def stream(fmt: str, text: str, chunk: int):
    ids = iter(range(100))
    st = ToolCallStream(fmt, new_id=lambda: f"id{next(ids)}")
    events = [e for i in range(0, len(text), chunk) for e in st.feed(text[i:i + chunk])] + st.finish()
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, CallStart):
            calls[e.index] = [e.id, e.name, ""]
        elif isinstance(e, ArgsDelta):
            calls[e.index][2] += e.text
    content = "".join(e for e in events if isinstance(e, str))
    return content, [tuple(v) for _, v in sorted(calls.items())], st


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("edgechat", "Let me check.\n" + CALL + "\n" + CALL.replace("Oslo", "Rome") + "\n", "Let me check.",
     [("get_weather", '{"city": "Oslo", "unit": "c"}'), ("get_weather", '{"city": "Rome", "unit": "c"}')]),
    ("hermes", "No call here, only <tool talk> and a < sign.\n", "No call here, only <tool talk> and a < sign.\n", []),
    ("hermes", '<tool_call>\n{"arguments": {"x": "}{"}, "name": "late"}\n</tool_call>', "", [("late", '{"x": "}{"}')]),
    ("hermes", "<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", []),
    ("hermes", '<tool_call>\n{"name": "cut", "arguments": {"x": "ab', "", [("cut", '{"x": "ab')]),
    ("hermes", '<tool_call>\n{"name": "noargs"}\n</tool_call>', "", [("noargs", "{}")]),
    ("llama3_json", ' {"name": "f", "parameters": {"q": [1, 2]}}; {"name": "g", "parameters": {}}', "",
     [("f", '{"q": [1, 2]}'), ("g", "{}")]),
    ("llama3_json", 'Hello {"name": "f"}', 'Hello {"name": "f"}', []),
    ("llama3_json", '{"nope": 1} trailing', '{"nope": 1} trailing', []),
])
def test_streamed_calls_reassemble_under_any_chunking(fmt, text, content, calls):
    for chunk in (1, 2, 3, 5, 8, 13, len(text)):
        got_content, got, st = stream(fmt, text, chunk)
        assert got_content == content == st.content
        assert [(name, args) for _, name, args in got] == calls
        assert [(c.id, c.function.name, c.function.arguments) for c in st.calls] == got


def chat_plan(**kw) -> O.Plan:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, BOOK], **kw}
    return O.parse_chat(msgspec.json.encode(body))


def render(plan: O.Plan, texts: list[str], reason: str = "stop"):
    from wire import protocol as P

    resp = Response(plan, "chatcmpl-1", "m", 0, lambda t: ("x", b"x"), [[1]], tool_format="edgechat")
    out = resp.start()
    for t in texts:
        out += resp.message(0, P.Tokens("r", [1], t))
    out += resp.message(0, P.Finished("r", reason))
    return resp, out


def test_openai_answers_with_tool_calls():
    resp, _ = render(chat_plan(), ["Sure.\n<tool", "_call>\n", CALL[12:40], CALL[40:]])
    msg = json.loads(resp.answer())["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] == "Sure."
    call = msg["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"] == {"name": "get_weather",
                                                               "arguments": '{"city": "Oslo", "unit": "c"}'}
    _, sse = render(chat_plan(stream=True), ["<tool", "_call>\n", CALL[12:40], CALL[40:]])
    chunks = [json.loads(line[6:]) for line in sse.decode().split("\n\n") if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    first = next(d["tool_calls"][0] for d in deltas if "tool_calls" in d)
    assert first["id"].startswith("call_") and first["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d)
    assert args == call["function"]["arguments"] and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(d.get("content") for d in deltas)  # the markup never shows as content
    named, _ = render(chat_plan(tool_choice={"type": "function", "function": {"name": "get_weather"}}), [CALL])
    assert json.loads(named.answer())["choices"][0]["finish_reason"] == "stop"  # as OpenAI answers a named call
    cut, _ = render(chat_plan(), [CALL[:60]], "length")  # max_tokens inside the arguments
    body = json.loads(cut.answer())["choices"][0]
    assert body["finish_reason"] == "length" and body["message"]["tool_calls"][0]["function"]["arguments"] \
        == '{"city": "O'
    plain, _ = render(chat_plan(), ["Just words."])
    body = json.loads(plain.answer())["choices"][0]
    assert body["message"]["content"] == "Just words." and "tool_calls" not in body["message"]
