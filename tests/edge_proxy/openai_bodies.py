"""Mutated OpenAI request bodies and the check of what answers them, shared by the
seeded fuzz of the proxy's HTTP front door (test_openai_fuzz.py) and its lighter run
against a real replica's own API (test_openai_sdk.py)."""

from __future__ import annotations

import copy
import json
import random

from tests.edge_proxy.jsonpaths import paths, set_at

MSG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
BASES = [
    ("/v1/chat/completions", {"model": "stub", "messages": MSG, "max_tokens": 3, "temperature": 0}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "stream": True, "n": 2, "seed": 5,
                              "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hey"}]}],
                              "max_completion_tokens": 3, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                              "logit_bias": {"97": 3.0}, "stop": ["zz"], "top_p": 0.9, "user": "u1"}),
    ("/v1/completions", {"prompt": "once upon", "max_tokens": 3, "echo": True, "logprobs": 1}),
    ("/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": 2, "n": 2, "stream": True, "temperature": 0.5}),
    ("/v1/completions", {"prompt": [[104, 105], [106]], "max_tokens": 2, "min_tokens": 1, "ignore_eos": True,
                         "stop_token_ids": [0], "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1}),
    ("/infill", {"input_prefix": "def f(", "input_suffix": ")", "n_predict": 3}),
]
EXTREMES = [2**31, 2**63, 2**64, -1, 0, -(2**63) - 1, 1.5, "x", "", True, None, [], {}, [[]], {"a": {"b": [1]}},
            "a" * 70000, "\ud7ff" * 3000]
RAW = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "[" * 6000 + "]" * 6000, "01", "tru", '"\\ud800"']


BOUNDING = {"max_tokens", "max_completion_tokens", "n_predict"}  # never dropped nor nulled: the default is long


def mutate(rng: random.Random, body: dict) -> bytes:
    """None to three mutations (an unmutated body keeps valid traffic flowing);
    RAW values are spliced into the JSON text."""
    body = copy.deepcopy(body)
    raw = None
    for _ in range(rng.choice([0, 1, 1, 1, 2, 2, 3])):
        where = [p for p in paths(body) if p and p[-1] not in BOUNDING]
        kind = rng.random()
        if kind < 0.1:
            body[rng.choice(["frobnicate", "tools", "response_format", "functions", "suffix", "audio", "best_of",
                             "guided_json", "grammar"])] = copy.deepcopy(rng.choice(EXTREMES[:9] + [{"type": "json_object"}]))
        elif kind < 0.2 and where:
            path = rng.choice(where)
            target = body
            for p in path[:-1]:
                target = target[p]
            del target[path[-1]]
        elif kind < 0.35 and where:
            raw = (rng.choice(where), rng.choice(RAW))
            set_at(body, raw[0], "\x00RAW\x00")
        elif where:
            set_at(body, rng.choice(where), copy.deepcopy(rng.choice(EXTREMES)))
        bounded = [k for k in BOUNDING if k in body]
        if bounded and rng.random() < 0.15:  # the bounding fields get the extremes too, but never null
            body[bounded[0]] = rng.choice([e for e in EXTREMES if e is not None])
    text = json.dumps(body)
    if raw is not None:
        text = text.replace('"\\u0000RAW\\u0000"', raw[1], 1)
    return text.encode()


def check_answer(status: int, ctype: str, data: bytes) -> str:
    if status == 200:
        if ctype.startswith("text/event-stream"):
            events = [b for b in data.decode().split("\n\n") if b]
            assert all(e.startswith("data: ") for e in events)
            if events and events[-1] != "data: [DONE]":  # /infill: the last event says stop
                assert json.loads(events[-1][6:])["stop"] is True
            for e in events:
                if e != "data: [DONE]":
                    assert "error" not in json.loads(e[6:]), e
            return "stream"
        json.loads(data)
        return "json"
    assert 400 <= status < 500, (status, data[:300])
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == ("rate_limit_error" if status == 429 else "invalid_request_error"), err
    return str(status)
