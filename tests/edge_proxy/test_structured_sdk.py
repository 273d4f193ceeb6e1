"""Structured output and tool calling end to end on the default model, with the
official `openai` SDK (and the WebSocket client) through the proxy: pydantic
models parsed, json_object for 20 prompts, vLLM's guided fields, forced tool calls
whose arguments validate, a tool round trip, streamed tool-call deltas, constrained
and free requests in one batch, speculation on and off, and failover mid-answer.

Two real replicas: R decodes plainly, S speculates (n-gram prompt lookup). Proxies:
`off` over R, `spec` over S, `both` over R and S (failover).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import json
import os
import signal
import subprocess
import sys
from enum import Enum
from typing import Literal, Optional

import jsonschema
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from edge_proxy.client import EdgeClient
from replica.tokenizer import Tokenizer
from wire import openai as O
from wire import openai_prompts as OP
from tests.replica.server import free_port, stop_group, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "SmolLM2-135M-Instruct"
SECRET = {"EDGECHAT_REPLICA_SECRET": "structured-secret"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Book a table at a restaurant",
    "parameters": {"type": "object", "properties": {"restaurant": {"type": "string", "maxLength": 40},
                                                    "people": {"type": "integer", "minimum": 1, "maximum": 12}},
                   "required": ["restaurant", "people"], "additionalProperties": False}}}
TOOLS = [WEATHER, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def stack():
    procs, urls = [], {}
    try:
        for rid, extra in (("R", []), ("S", ["--speculative", "ngram"])):  # both load at once
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "replica", "--port", str(port), "--replica-id", rid,
                                           "--kv-memory-gb", "0.25", *extra], env={**os.environ, **SECRET},
                                          start_new_session=True))
            urls[rid] = f"http://127.0.0.1:{port}"
        for (rid, url), proc in zip(urls.items(), procs):
            wait_healthy(url, proc)
        for name, reps in (("off", ["R"]), ("spec", ["S"]), ("both", ["R", "S"])):
            port = free_port()
            cmd = [sys.executable, "-m", "edge_proxy", "--port", str(port), "--allow-anonymous", "--stall-timeout", "3"]
            for rid in reps:
                cmd += ["--replica", urls[rid].replace("http://", "ws://") + "/v1/replica"]
            procs.append(subprocess.Popen(cmd, env={**os.environ, **SECRET}, start_new_session=True))
            urls[name] = f"http://127.0.0.1:{port}"
            wait_healthy(urls[name], procs[-1])
        yield {**urls, "procs": dict(zip(["R", "S"], procs[:2]))}
    finally:
        for p in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
            stop_group(p)


def chat(c, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 60)
    return c.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK_WEATHER), **kw)


# -- response_format ------------------------------------------------------------------------
class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):  # nested objects
    name: str
    age: int
    address: Address


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Paint(BaseModel):  # enums
    color: Color
    finish: Literal["matte", "gloss"]


class Shopping(BaseModel):  # an array with bounds
    items: list[str] = Field(min_length=2, max_length=3)


class Event(BaseModel):  # optional fields
    title: str
    location: Optional[str]
    attendees: Optional[int] = None


@pytest.mark.parametrize("model, ask", [
    (Person, "Invent a person who lives in Paris."), (Paint, "Pick a paint for a kitchen."),
    (Shopping, "List things to buy for a picnic."), (Event, "Describe a birthday party."),
])
def test_parse_returns_objects_that_validate(sdk, model, ask):
    r = sdk("off").chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ask}], response_format=model,
                                     temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, model)
    assert model.model_validate_json(choice.message.content) == choice.message.parsed
    if model is Shopping:
        assert 2 <= len(choice.message.parsed.items) <= 3


QUESTIONS = ["What is 2 + 2?", "What is the capital of France?", "What color is the sky?",
             "How many legs does a dog have?", "Name a fruit.", "What is the capital of Japan?", "Who wrote Hamlet?",
             "What is the largest planet?", "What language is spoken in Spain?", "What is the capital of Italy?",
             "What is frozen water called?", "Name a primary color.", "What animal says moo?", "What is 10 minus 3?",
             "What is the boiling point of water in Celsius?", "Which ocean is the largest?",
             "What is the chemical symbol for gold?", "How many continents are there?", "What do bees make?",
             "What is the square root of 9?"]


def test_json_object_parses_for_20_prompts(sdk):
    def ask(q):
        return chat(sdk("off"), max_tokens=48, response_format={"type": "json_object"}, messages=[
            {"role": "system", "content": 'Answer with a JSON object: {"answer": ...}'},
            {"role": "user", "content": q}])

    with cf.ThreadPoolExecutor(len(QUESTIONS)) as ex:  # in one batch, as clients send them
        answers = list(ex.map(ask, QUESTIONS))
    for a in answers:
        assert a.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(a.choices[0].message.content), dict)


def test_n_sampled_answers_each_follow_the_schema(sdk):
    r = sdk("off").chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Pick a paint."}],
                                          response_format=Paint, n=3, temperature=1.0, seed=5, max_tokens=40)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.finish_reason == "stop" and isinstance(c.message.parsed, Paint)


def test_vllm_guided_fields(sdk):
    phone = chat(sdk("off"), max_tokens=20, extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"},
                 messages=[{"role": "user", "content": "Give me a phone number."}]).choices[0].message.content
    assert len(phone) == 8 and phone[3] == "-" and (phone[:3] + phone[4:]).isdigit()
    yes_no = chat(sdk("off"), max_tokens=5, extra_body={"guided_choice": ["yes", "no"]},
                  messages=[{"role": "user", "content": "Is the sky blue?"}]).choices[0].message.content
    assert yes_no in ("yes", "no")
    way = chat(sdk("off"), max_tokens=10, extra_body={"guided_grammar": 'root ::= "go " ("north" | "south" | "east")'},
               messages=[{"role": "user", "content": "Where should I go?"}]).choices[0].message.content
    assert way in ("go north", "go south", "go east")
    done = sdk("off").completions.create(model=MODEL, prompt="The answer is", max_tokens=8, temperature=0,
                                    extra_body={"structured_outputs": {"regex": " (yes|no)\\."}})
    assert done.choices[0].text in (" yes.", " no.")


# -- tools ----------------------------------------------------------------------------------
def validated(calls) -> list:
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def test_required_and_named_tool_choice_produce_valid_calls(sdk):
    r = chat(sdk("off"), tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls" and len(validated(r.choices[0].message.tool_calls)) == 1
    named = chat(sdk("off"), tools=TOOLS, tool_choice={"type": "function", "function": {"name": "book_table"}})
    calls = validated(named.choices[0].message.tool_calls)
    assert [c.function.name for c in calls] == ["book_table"] and named.choices[0].finish_reason == "stop"
    free = chat(sdk("off"), tools=TOOLS, tool_choice="none", max_tokens=12)
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content


def test_tool_round_trip(sdk):
    first = chat(sdk("off"), tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    call = validated(first.choices[0].message.tool_calls)[0]
    assert json.loads(call.function.arguments)["city"] == "Paris"
    result = json.dumps({"city": "Paris", "temperature": 18, "unit": "celsius", "sky": "sunny"})
    history = ASK_WEATHER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                             {"role": "tool", "tool_call_id": call.id, "content": result}]
    answer = chat(sdk("off"), messages=history, tools=[WEATHER], tool_choice="none", max_tokens=30)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content.strip()
    assert answer.choices[0].message.tool_calls is None
    # The second prompt is the conversation with the call and its result, as wire.tools renders them.
    plan = O.parse_chat(json.dumps({"messages": history, "tools": [WEATHER], "tool_choice": "none"}).encode())
    tok = Tokenizer.from_spec("default")
    ids = OP.prompt_ids(tok, plan.prompts[0], plan.tools)
    assert answer.usage.prompt_tokens == len(ids)
    prompt = tok.decode(ids, skip_special_tokens=False)
    assert call.function.arguments in prompt and f"<|im_start|>tool\n{result}<|im_end|>" in prompt


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(sdk):
    whole = chat(sdk("off"), tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    pieces = 0
    for chunk in chat(sdk("off"), tools=TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            c["arguments"] += d.function.arguments or ""
            pieces += 1
        last = chunk.choices[0].finish_reason
    want = whole.choices[0].message.tool_calls[0]
    assert list(calls) == [0] and calls[0]["id"].startswith("call_") and pieces > 5  # arguments in pieces
    assert (calls[0]["name"], calls[0]["arguments"]) == (want.function.name, want.function.arguments)
    assert last == "tool_calls"


# -- batching, speculation, failover --------------------------------------------------------
def test_constrained_and_free_requests_in_one_batch(sdk):
    free_kw = dict(messages=[{"role": "user", "content": "Write a short poem about the sea."}], max_tokens=48)
    json_kw = dict(messages=[{"role": "user", "content": "Invent a person who lives in Paris."}], max_tokens=80,
                   response_format={"type": "json_schema", "json_schema": {
                       "name": "Person", "schema": Person.model_json_schema() | {"additionalProperties": False}}})
    alone = [chat(sdk("off"), **free_kw).choices[0].message.content, chat(sdk("off"), **json_kw).choices[0].message.content]
    with cf.ThreadPoolExecutor(2) as ex:
        together = [f.result().choices[0].message.content
                    for f in [ex.submit(chat, sdk("off"), **free_kw), ex.submit(chat, sdk("off"), **json_kw)]]
    assert together == alone
    Person.model_validate_json(together[1])


def test_greedy_constrained_output_identical_with_speculation_on_and_off(sdk):
    copy = [{"role": "user", "content": 'Copy this JSON exactly: {"name": "Ada Lovelace", "city": "London", '
                                        '"tags": ["math", "poetry", "engines"]}'}]
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
              "required": ["name", "city", "tags"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    off, on = (chat(sdk(w), messages=copy, response_format=rf) for w in ("off", "spec"))
    assert off.choices[0].message.content == on.choices[0].message.content
    jsonschema.validate(json.loads(on.choices[0].message.content), schema)
    assert on.usage.completion_tokens_details.accepted_prediction_tokens > 5  # drafts were verified and kept
    assert off.usage.completion_tokens_details.accepted_prediction_tokens == 0
    ask = [{"role": "user", "content": "Weather in Paris in celsius? Call get_weather with city Paris and unit "
                                       "celsius."}]
    off, on = (chat(sdk(w), messages=ask, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
               for w in ("off", "spec"))
    assert [(c.function.name, c.function.arguments) for c in off.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in on.choices[0].message.tool_calls]
    assert on.usage.completion_tokens_details.accepted_prediction_tokens > 0


# -- the WebSocket protocol -----------------------------------------------------------------
def test_websocket_response_format_and_tools(stack):
    async def run():
        url = stack["off"].replace("http://", "ws://") + "/v1/stream"
        async with await EdgeClient.connect(url) as c:
            text, done = await c.complete(messages=[{"role": "user", "content": "Pick a paint for a kitchen."}],
                                          max_tokens=40, temperature=0, response_format={
                                              "type": "json_schema", "json_schema": {
                                                  "name": "Paint", "schema": Paint.model_json_schema()}})
            Paint.model_validate_json(text)
            assert done.finish_reason == "stop" and not done.tool_calls
            req = await c.generate(messages=ASK_WEATHER, max_tokens=60, temperature=0, tools=TOOLS,
                                   tool_choice="required", parallel_tool_calls=False)
            text, done = await req.result()
            assert text == "" and done.finish_reason == "tool_calls"  # no markup in the deltas
            call = done.tool_calls[0]
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            history = ASK_WEATHER + [{"role": "assistant", "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                 "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'}]
            text, done = await c.complete(messages=history, max_tokens=20, temperature=0, tools=TOOLS,
                                          tool_choice="none")
            assert text.strip() and not done.tool_calls
    asyncio.run(run())


def test_failover_mid_answer_resumes_the_grammar(stack):
    """The replica serving a constrained stream freezes mid-answer: the proxy resumes it
    on the other replica from the tokens so far, and the answer is the uninterrupted one."""
    import httpx

    rf = {"type": "json_schema", "json_schema": {"name": "Person", "strict": True,
                                                 "schema": to_strict_json_schema(Person)}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Invent a person who lives in Paris."}],
            "response_format": rf, "max_tokens": 80, "temperature": 0}
    first = httpx.post(stack["both"] + "/v1/chat/completions", json=body, timeout=120).json()
    whole, served = first["choices"][0]["message"]["content"], first["edgechat"]["replica"]
    text, frozen, failovers = "", False, 0
    try:  # the same prompt again goes where its prefix is cached: the replica that served it
        with httpx.stream("POST", stack["both"] + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    text += chunk["choices"][0]["delta"].get("content") or ""
                if not frozen and len(text) > 12:  # mid-answer
                    os.killpg(stack["procs"][served].pid, signal.SIGSTOP)
                    frozen = True
                if "edgechat" in chunk:
                    failovers, last = chunk["edgechat"]["failovers"], chunk["edgechat"]["replica"]
    finally:
        os.killpg(stack["procs"][served].pid, signal.SIGCONT)
    assert frozen and failovers >= 1 and last != served
    assert text == whole
    Person.model_validate_json(text)
