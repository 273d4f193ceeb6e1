"""The one OpenAI schema, socket-free: what is honoured becomes SamplingParams, what
is not is a 400 naming its param; responses and SSE chunks in OpenAI's shapes."""

from __future__ import annotations

import json

import msgspec
import pytest

from edge_proxy.prompt import ByteTokenizer
from replica.fim import FimTokens
from wire import infill as IF
from wire import openai as O
from wire import openai_prompts as OP
from wire import protocol as P
from wire.openai_render import Response

HI = [{"role": "user", "content": "hi"}]


def chat(**kw) -> bytes:
    return msgspec.json.encode({"messages": HI, **kw})


def refused(body: bytes, parse=O.parse_chat) -> O.OpenAIError:
    with pytest.raises(O.OpenAIError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"
    return e.value


def test_honoured_parameters_reach_sampling_params():
    plan = O.parse_chat(chat(max_completion_tokens=7, temperature=0.5, top_p=0.9, n=3, seed=11, stop="x",
                             presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"42": 5.0}, logprobs=True,
                             top_logprobs=4, top_k=-1, min_p=0.1, repetition_penalty=1.2, min_tokens=2,
                             ignore_eos=True, stop_token_ids=[9], include_stop_str_in_output=True, user="u",
                             stream=True, stream_options={"include_usage": True}, prompt_cache_key="conv-1",
                             response_format={"type": "text"}, tool_choice="none", tools=[]))
    assert plan.sampling == P.SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, n=3, seed=11, stop=["x"], presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={42: 5.0}, logprobs=4, top_k=0, min_p=0.1, repetition_penalty=1.2,
        min_tokens=2, ignore_eos=True, stop_token_ids=[9], include_stop_str_in_output=True)
    assert plan.stream and plan.include_usage and plan.logprobs == 4 and plan.session == "conv-1"
    assert O.parse_chat(chat()).sampling.max_tokens == P.DEFAULT_MAX_TOKENS  # the one default
    c = O.parse_completion(b'{"prompt": [[1, 2], [3]], "echo": true, "logprobs": 2, "n": 2, "best_of": 2}')
    assert c.prompts == [[1, 2], [3]] and c.echo and c.sampling.prompt_logprobs == 2 and c.sampling.n == 2
    assert O.parse_completion(b'{"prompt": ["a", "b"]}').prompts == ["a", "b"]
    assert O.parse_completion(b'{"prompt": [5, 6]}').prompts == [[5, 6]]


CALLS = {"role": "assistant", "content": None, "tool_calls": [
    {"id": c, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}} for c in ("c1", "c2")]}
RESULTS = [{"role": "tool", "content": "18 C", "tool_call_id": c} for c in ("c1", "c2")]


@pytest.mark.parametrize("body, param", [
    (chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), "tools[1].function.name"),
    (chat(tools=[{"type": "function"}]), "tools"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function",
                                                                               "function": {"name": "g"}}),
     "tool_choice.function.name"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
          response_format={"type": "json_object"}), "tool_choice"),
    (chat(response_format={"type": "xml"}), "response_format.type"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}),
     "response_format.json_schema.schema"),
    (chat(guided_regex="("), "guided_regex"),
    (chat(guided_grammar="start: undefined_rule"), "guided_grammar"),
    (chat(guided_choice=[]), "guided_choice"),
    (chat(guided_regex="a+", guided_choice=["a"]), "guided_choice"),
    (chat(guided_decoding_backend="outlines"), "guided_decoding_backend"),
    (chat(structured_outputs={"regex": "a", "json_object": True}), "structured_outputs.json_object"),
    (chat(functions=[{"name": "f"}]), "functions"),
    (chat(audio={"voice": "x"}), "audio"),
    (chat(modalities=["text", "audio"]), "modalities"),
    (chat(store=True), "store"),
    (chat(reasoning_effort="high"), "reasoning_effort"),
    (chat(prediction={"type": "content", "content": "x"}), "prediction"),
    (chat(service_tier="flex"), "service_tier"),
    (chat(top_logprobs=3), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(frobnicate=1), "frobnicate"),
    (chat(temperature="hot"), "temperature"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(n=0), "n"),
    (chat(n=2**64), "n"),
    (chat(seed=-1), "seed"),
    (chat(seed=2**64), "seed"),
    (chat(presence_penalty=2.5), "presence_penalty"),
    (chat(repetition_penalty=0), "repetition_penalty"),
    (chat(min_p=1.5), "min_p"),
    (chat(logit_bias={"x": 1}), "logit_bias"),
    (chat(logit_bias={"5": 101}), "logit_bias"),
    (chat(min_tokens=300), "min_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "temperature"),  # no inf
    (msgspec.json.encode({"messages": []}), "messages"),
    (msgspec.json.encode({"messages": [{"role": "robot", "content": "x"}]}), "messages[0].role"),
    (msgspec.json.encode({"messages": [{"role": "function", "content": "x", "name": "f"}]}), "messages[0].role"),
    (msgspec.json.encode({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}),
     "messages[0].tool_call_id"),
    (msgspec.json.encode({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
     "messages[0].tool_calls"),
    (msgspec.json.encode({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}),
     "messages[0].tool_calls"),
    (msgspec.json.encode({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}), "messages[0].content[0].type"),
    (msgspec.json.encode({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}),
     "messages[0].content[0].type"),
    (msgspec.json.encode({"messages": [{"role": "user", "content": "x", "foo": 1}]}), "messages[0].foo"),
    (msgspec.json.encode({"messages": [{"role": "assistant", "content": None}]}), "messages[0].content"),
    *[(msgspec.json.encode({"messages": msgs}), param) for msgs, param in [
        ([{"role": "tool", "content": "18 C"}] * 3, "messages[0].tool_call_id"),  # bare results
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": "18 C", "tool_call_id": "c1"}],
         "messages[1].role"),  # a result of no call
        ([{"role": "user", "content": "x"}, CALLS, {"role": "tool", "content": "1", "tool_call_id": "c9"}],
         "messages[2].tool_call_id"),  # not one of the calls
        ([{"role": "user", "content": "x"}, CALLS, *RESULTS, {"role": "tool", "content": "1", "tool_call_id": "c1"}],
         "messages[4].tool_call_id"),  # answered twice
        ([{"role": "user", "content": "x"}, CALLS, RESULTS[0], {"role": "user", "content": "and?"}],
         "messages[1].role"),  # c2 never answered
        ([{"role": "user", "content": "x"}, CALLS], "messages[1].role"),  # the conversation ends on the calls
    ]],
])
def test_what_cannot_be_honoured_is_a_400_naming_the_param(body, param):
    e = refused(body)
    assert e.param == param, (e.param, e.message)
    if param:
        assert e.body()["error"]["param"] == param


def test_calls_answered_in_any_order_then_a_new_turn():
    msgs = [{"role": "user", "content": "x"}, CALLS, *RESULTS[::-1], {"role": "assistant", "content": "18 C twice"},
            {"role": "user", "content": "thanks"}]
    plan = O.parse_chat(msgspec.json.encode({"messages": msgs}))
    assert [m["role"] for m in plan.prompts[0]] == ["user", "assistant", "tool", "tool", "assistant", "user"]
    assert [m.get("tool_call_id") for m in plan.prompts[0][2:4]] == ["c2", "c1"]


@pytest.mark.parametrize("body, param", [
    (b'{"prompt": "x", "best_of": 3}', "best_of"),
    (b'{"prompt": "x", "suffix": "y", "echo": true}', "echo"),
    (b'{"prompt": [1, "a"]}', "prompt"),
    (b'{"prompt": []}', "prompt"),
    (b'{"prompt": "x", "logprobs": 21}', "logprobs"),
    (b'{"prompt": "x", "max_completion_tokens": 3}', "max_completion_tokens"),
])
def test_completion_refusals(body, param):
    assert refused(body, O.parse_completion).param == param


def test_malformed_bodies():
    assert "malformed" in refused(b'{"messages": ').message
    assert "UTF-8" in refused(b'{"messages": [{"role": "user", "content": "\xff"}]}').message
    assert refused(b'[1, 2]').param is None


def test_fim_needs_fim_tokens_and_names_why():
    plan = O.parse_completion(b'{"prompt": "def f(", "suffix": "\\n    return x"}')
    with pytest.raises(O.OpenAIError) as e:
        OP.prompt_ids(ByteTokenizer(), plan.prompts[0])
    assert e.value.param == "suffix" and "FIM tokens" in e.value.message


class _Vocab:
    def __init__(self, tokens):
        self.ids = {t: i for i, t in enumerate(tokens)}

    def token_to_id(self, t):
        return self.ids.get(t)

    def encode(self, text, add_special_tokens=True):
        return ([99] if add_special_tokens else []) + [ord(c) for c in text]


@pytest.mark.parametrize("tokens, name", [
    (["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>"], "starcoder"),
    (["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"], "qwen2.5-coder"),
    (["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"], "codellama"),
    (["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"], "deepseek-coder"),
    (["<fim_prefix>", "<fim_suffix>"], None),
])
def test_fim_conventions_are_detected_from_the_vocabulary(tokens, name):
    v = _Vocab(tokens)
    fim = FimTokens.detect(v.token_to_id)
    assert (fim.name if fim else None) == name
    if fim is None:
        return
    ids = fim.encode(v, "ab", "c", [("f.py", "x")], "d")
    head = [99]
    if name == "starcoder":  # repo-level layout, as llama.cpp's /infill builds it
        head += [3] + [ord(c) for c in "myproject\n"] + [4] + [ord(c) for c in "f.py\nx"] + [4] + \
            [ord(c) for c in "filename\n"]
    else:
        head += [ord("x")]
    assert ids == head + [0, ord("a"), ord("b"), 1, ord("c"), 2, ord("d")]
    assert (fim.end is not None) == (name == "codellama")


def test_infill_request_as_llama_vim_sends_it():
    body = json.dumps({"input_prefix": "def f():\n", "input_suffix": "\n", "input_extra": [
        {"text": "x = 1\n", "time": 12.5, "filename": "a.py"}], "prompt": "    ", "n_predict": 0, "stop": [],
        "n_indent": 4, "top_k": 40, "top_p": 0.9, "samplers": ["top_k", "top_p", "infill"], "stream": False,
        "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "id_slot": 0,
        "response_fields": ["content", "timings/prompt_n"]}).encode()
    plan, r = IF.parse(body)
    assert plan.kind == "infill" and plan.sampling.max_tokens == 1 and plan.sampling.top_k == 40
    assert plan.prompts[0] == O.Fim("def f():\n", "\n", [("a.py", "x = 1\n")], "    ")
    assert refused(b'{"input_prefix": "x", "nonsense": 1}', lambda b: IF.parse(b)).param == "nonsense"
    stop = IF.InfillStop(IF.InfillRequest(n_indent=4))
    assert stop.cut("    a = 1\n") is None and stop.cut("    b = 2\nprint(") == "    b = 2\n"
    assert IF.select({"content": "x", "timings": {"prompt_n": 3, "x": 1}}, ["content", "timings/prompt_n", "no"]) \
        == {"content": "x", "timings/prompt_n": 3}


def _sse(data: bytes) -> list:
    out = []
    for block in data.decode().split("\n\n"):
        if block:
            assert block.startswith("data: ")
            out.append(block[6:] if block == "data: [DONE]" else json.loads(block[6:]))
    return out


def piece(i: int) -> tuple[str, bytes]:
    return chr(i), bytes([i])


def test_chat_stream_is_openais_shape_with_n_logprobs_and_usage():
    plan = O.parse_chat(chat(n=2, logprobs=True, top_logprobs=1, stream=True,
                             stream_options={"include_usage": True}))
    resp = Response(plan, "chatcmpl-1", "m", 5, piece, [[1, 2, 3]])
    lp = [P.TokenLogprob(-0.5, [104], [-0.5])]
    out = resp.start()
    out += resp.message(0, P.Tokens("r", [104], "h", 1, lp))
    out += resp.message(0, P.Finished("r", "length", P.Usage(3, 1, 2), ids=[105], text="i", index=0, logprobs=lp))
    assert not resp.done
    out += resp.message(0, P.Finished("r", "stop", P.Usage(3, 1, 0), index=1))
    assert resp.done
    chunks = _sse(out + resp.close())
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == 2
    assert chunks[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert all(c["usage"] is None for c in chunks[:-2])
    body = [c["choices"][0] for c in chunks[2:-2]]
    assert [(b["index"], b["delta"].get("content"), b["finish_reason"]) for b in body] == [
        (1, "h", None), (0, "i", None), (0, None, "length"), (1, None, "stop")]
    assert body[0]["logprobs"]["content"][0] == {"token": "h", "logprob": -0.5, "bytes": [104],
                                                 "top_logprobs": [{"token": "h", "logprob": -0.5, "bytes": [104]}]}


def test_completion_body_with_echo_and_logprobs():
    plan = O.parse_completion(b'{"prompt": "ab", "echo": true, "logprobs": 1, "max_tokens": 2}')
    resp = Response(plan, "cmpl-1", "m", 5, piece, [[97, 98]], ["ab"])
    plp = [P.TokenLogprob(-1.0, [98], [-1.0])]
    resp.message(0, P.Tokens("r", [99], "c", 0, [P.TokenLogprob(-2.0, [100], [-0.1])], plp))
    resp.message(0, P.Finished("r", "length", P.Usage(2, 2), ids=[100], text="d",
                               logprobs=[P.TokenLogprob(-0.1, [100], [-0.1])]))
    body = json.loads(resp.answer())
    ch = body["choices"][0]
    assert body["object"] == "text_completion" and ch["text"] == "abcd" and ch["finish_reason"] == "length"
    assert ch["logprobs"] == {"tokens": ["a", "b", "c", "d"], "token_logprobs": [None, -1.0, -2.0, -0.1],
                              "top_logprobs": [None, {"b": -1.0}, {"d": -0.1, "c": -2.0}, {"d": -0.1}],
                              "text_offset": [0, 1, 2, 3]}
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                             "prompt_tokens_details": {"cached_tokens": 0},
                             "completion_tokens_details": {"accepted_prediction_tokens": 0}}


def test_one_status_table_covers_every_error_code_of_both_front_doors():
    """Every error code the internal protocol or the proxy's public protocol defines has its
    HTTP status in wire.openai.HTTP_STATUS (the proxy's and the replica's OpenAI routes share
    it), except the WebSocket-only too_slow; answer ids share one format."""
    import re as _re

    from edge_proxy import protocol as pp
    from wire import openai as O
    from wire import protocol as P

    codes = {P.BAD_REQUEST, P.PROMPT_TOO_LONG, P.OVERLOADED, P.UNAUTHORIZED, P.NOT_FOUND, P.INTERNAL, P.ENGINE_FAULT,
             pp.FORBIDDEN, pp.RATE_LIMITED, pp.UNAVAILABLE, pp.SHUTTING_DOWN, pp.TOO_LARGE, pp.TOO_SLOW,
             pp.TOO_MANY_CONNECTIONS}
    assert codes - set(O.HTTP_STATUS) == {pp.TOO_SLOW}
    assert O.http_status(pp.RATE_LIMITED) == 429 and O.http_status(P.OVERLOADED) == 503 and O.http_status("?") == 500
    for kind, prefix in (("chat", "chatcmpl-"), ("completion", "cmpl-"), ("infill", "infill-")):
        a, b = O.response_id(kind), O.response_id(kind)
        assert a != b and _re.fullmatch(prefix + "[0-9a-f]{24}", a)
