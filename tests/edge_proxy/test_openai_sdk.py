"""The official `openai` SDK against a proxy in front of a real default-model replica,
and against that replica's own HTTP API: every honoured parameter shows its effect,
every unsupported one is a 400 naming its param, streams are OpenAI's shape.

One module-scoped replica + proxy; short max_tokens throughout.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest
import torch

from replica.model.loader import load_checkpoint
from replica.tokenizer import Tokenizer
from tests.replica.reference import reference_logits
from tests.replica.server import free_port, replica_server, wait_healthy

pytestmark = pytest.mark.timeout(600)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"proxy": "EMPTY", "replica": "sdk-secret"}  # a replica takes its secret as the bearer (replica.api.auth)


def auth(where: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[where]}"}


@pytest.fixture(scope="module")
def stack():
    env = {"EDGECHAT_REPLICA_SECRET": KEYS["replica"]}
    with replica_server("--replica-id", "R", "--kv-memory-gb", "0.25", env=env) as (rep, _):
        port = free_port()
        proxy = subprocess.Popen([sys.executable, "-m", "edge_proxy", "--port", str(port), "--allow-anonymous",
                                  "--replica", rep.replace("http://", "ws://") + "/v1/replica"],
                                 env={**os.environ, **env}, start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proxy)
            yield {"proxy": f"http://127.0.0.1:{port}", "replica": rep}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proxy.pid, signal.SIGTERM)
            proxy.wait(30)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_spec("default")


@pytest.fixture(scope="module")
def ref():
    ckpt = load_checkpoint("default")
    return ckpt.config, ckpt.weights


@pytest.fixture(scope="module")
def sdk_keys() -> dict:
    """The keys of this module's `sdk` clients (tests/edge_proxy/conftest.py): sdk("proxy"), sdk("replica")."""
    return KEYS


BOTH = pytest.mark.parametrize("where", ["proxy", "replica"])


def chat(c, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return c.chat.completions.create(model=MODEL, messages=kw.pop("messages", FRANCE), **kw)


@BOTH
def test_chat_and_completions_streaming_and_not(stack, sdk, where):
    c = sdk(where)
    r = chat(c)
    assert r.choices[0].message.content == "The capital of France is Paris." and r.choices[0].finish_reason == "stop"
    assert r.object == "chat.completion" and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    parts = [ch for ch in chat(c, stream=True, stream_options={"include_usage": True})]
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == r.choices[0].message.content
    assert parts[-2].choices[0].finish_reason == "stop" and parts[-1].choices == []
    assert parts[-1].usage.completion_tokens == r.usage.completion_tokens
    cr = c.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=4, temperature=0)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=4, temperature=0, stream=True))
    assert cr.choices[0].text.startswith(" 5") and streamed == cr.choices[0].text
    assert c.models.retrieve(MODEL).id == MODEL and [m.id for m in c.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-9")


@BOTH
def test_sse_is_exactly_openais_shape(stack, sdk, where):
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 5, "temperature": 0, "stream": True, "n": 2,
            "logprobs": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", stack[where] + "/v1/chat/completions", json=body, timeout=120, headers=auth(where)) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert {c["choices"][0]["index"] for c in chunks[:-1]} == {0, 1}
    last = {}
    for ch in chunks[:-1]:
        assert ch["object"] == "chat.completion.chunk" and ch["usage"] is None and len(ch["choices"]) == 1
        choice = ch["choices"][0]
        assert choice["index"] not in last, "a choice continued after its finish_reason"
        if choice["finish_reason"]:
            last[choice["index"]] = choice["finish_reason"]
        elif choice["delta"].get("content"):
            assert len(choice["logprobs"]["content"]) >= 1
    assert set(last) == {0, 1} and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_logit_bias_forces_a_token(stack, sdk, tok):
    forced = tok.encode(" banana")
    assert len(forced) == 1
    for where in ("proxy", "replica"):
        r = chat(sdk(where), max_tokens=3, logit_bias={str(forced[0]): 100})
        assert r.choices[0].message.content == " banana" * 3


def test_penalties_change_a_repetitive_output(stack, sdk):
    c = sdk("proxy")
    rep = [{"role": "user", "content": "Say 'yes' twenty times: yes yes yes yes yes"}]
    plain = chat(c, messages=rep, max_tokens=16, logprobs=True).choices[0]
    tokens = [e.token for e in plain.logprobs.content]
    assert max(tokens.count(t) for t in set(tokens)) >= 5  # repetitive without penalties
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 1.8}}):
        pen = chat(c, messages=rep, max_tokens=16, logprobs=True, **kw).choices[0]
        ptoks = [e.token for e in pen.logprobs.content]
        assert pen.message.content != plain.message.content, kw
        assert max(ptoks.count(t) for t in set(ptoks)) < max(tokens.count(t) for t in set(tokens)), kw


# The replica computes with int16 activation codes and keeps its KV cache in fp16 (CPU step):
# 3e-3 nats from the fp32 reference measured; a wrong normalization or temperature is off by far more.
TOL_LOGPROB = 1e-2


def test_top_logprobs_match_the_reference_forward(stack, sdk, tok, ref):
    cfg, w = ref
    ids = tok.encode_chat(FRANCE)
    for where in ("proxy", "replica"):
        r = chat(sdk(where), max_tokens=3, logprobs=True, top_logprobs=5)
        seq = list(ids)
        for entry in r.choices[0].logprobs.content:
            lp = torch.log_softmax(reference_logits(cfg, w, seq)[-1].double(), -1)
            top = lp.topk(5)
            assert [t.token for t in entry.top_logprobs] == [tok.piece(i)[0] for i in top.indices.tolist()]
            assert all(abs(t.logprob - v) < TOL_LOGPROB for t, v in zip(entry.top_logprobs, top.values.tolist()))
            assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-6
            assert abs(entry.logprob - top.values[0].item()) < TOL_LOGPROB and entry.token == entry.top_logprobs[0].token
            seq.append(top.indices[0].item())  # greedy: the argmax is the token generated
    # completions: echo with logprobs gives the prompt's too (the first token has none)
    prompt = "The capital of France is"
    pids = tok.encode(prompt)
    cr = sdk("proxy").completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                                logprobs=2)
    lp = cr.choices[0].logprobs
    assert cr.choices[0].text.startswith(prompt) and lp.token_logprobs[0] is None
    full = torch.log_softmax(reference_logits(cfg, w, pids).double(), -1)
    for j in range(1, len(pids)):
        assert abs(lp.token_logprobs[j] - full[j - 1, pids[j]].item()) < TOL_LOGPROB
    assert len(lp.tokens) == len(pids) + 1 and lp.text_offset[len(pids)] == len(prompt)


def _prefix_hits(url: str) -> float:
    text = httpx.get(url + "/metrics", headers=auth("replica")).text
    m = re.search(r"^edgechat_replica_prefix_hit_tokens_total (\S+)$", text, re.M)
    return float(m.group(1))


@BOTH
def test_n_samples_with_a_seed_share_one_prefill(stack, sdk, where, tok):
    c = sdk(where)
    msgs = [{"role": "user", "content": f"Invent a name for a pet {where} dragon and say why."}]
    before = _prefix_hits(stack["replica"])
    r = chat(c, messages=msgs, n=3, seed=7, temperature=1.0, max_tokens=8)
    texts = [ch.message.content for ch in r.choices]
    assert [ch.index for ch in r.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert r.usage.completion_tokens == sum(len(tok.encode(t)) for t in texts) or r.usage.completion_tokens == 24
    n_prompt = len(tok.encode_chat(msgs))
    shared = (n_prompt - 1) // 16 * 16
    assert r.usage.prompt_tokens == n_prompt and _prefix_hits(stack["replica"]) - before >= 2 * shared
    again = chat(c, messages=msgs, n=3, seed=7, temperature=1.0, max_tokens=8)
    assert [ch.message.content for ch in again.choices] == texts  # a pure function of the seed


def test_the_other_sampling_parameters(stack, sdk, tok):
    c = sdk("proxy")
    greedy = chat(c, max_tokens=20)
    assert chat(c, max_tokens=20, extra_body={"ignore_eos": True}).usage.completion_tokens == 20
    assert chat(c, max_tokens=20, extra_body={"min_tokens": 12}).usage.completion_tokens >= 12
    assert chat(c, max_tokens=openai.NOT_GIVEN, max_completion_tokens=3).usage.completion_tokens == 3
    text = greedy.choices[0].message.content
    cut = chat(c, max_tokens=20, stop=["Paris"], extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].message.content == text[: text.index("Paris") + 5]
    second = tok.encode_chat(FRANCE + [{"role": "assistant", "content": text}])[len(tok.encode_chat(FRANCE)) + 1]
    stopped = chat(c, max_tokens=20, extra_body={"stop_token_ids": [second]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 2
    assert chat(c, max_tokens=20, temperature=1.5, seed=3, extra_body={"min_p": 1.0}).choices[0].message.content \
        == text  # min_p = 1 keeps only the most likely token
    a, b = (chat(c, max_tokens=12, temperature=1.2, seed=s).choices[0].message.content for s in (1, 1))
    assert a == b != chat(c, max_tokens=12, temperature=1.2, seed=2).choices[0].message.content
    multi = c.completions.create(model=MODEL, prompt=["1, 2, 3,", "a, b, c,"], max_tokens=3, temperature=0)
    ids = c.completions.create(model=MODEL, prompt=[tok.encode("1, 2, 3,"), tok.encode("a, b, c,")], max_tokens=3,
                               temperature=0)
    assert [ch.text for ch in multi.choices] == [ch.text for ch in ids.choices] and len(multi.choices) == 2
    assert multi.choices[0].text.startswith(" 4") and multi.choices[1].text.startswith(" d")


@BOTH
@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"guided_regex": "("}}, "guided_regex"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "42", "tool_call_id": "c1"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "tool", "content": "18 C"}] * 3}, "messages[0].tool_call_id"),  # bare results
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "1", "tool_call_id": "c1"}]},
     "messages[1].role"),  # a result of no call
    ({"store": True}, "store"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"n": 99}, "n"),
    ({"presence_penalty": 9}, "presence_penalty"),
])
def test_unsupported_parameters_are_400_naming_the_param(stack, sdk, where, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(sdk(where), **kw)
    assert e.value.param == param and e.value.type == "invalid_request_error"


@BOTH
def test_tokenize_counts_what_the_chat_sends(stack, sdk, where, tok):
    """vLLM's /tokenize renders the model's own chat template: with its defaults, the ids the
    chat route sends (its usage counts them); /detokenize gives back the template's text."""
    c, post = sdk(where), lambda path, body: httpx.post(stack[where] + path, json=body, headers=auth(where)).json()
    max_len = c.models.list().data[0].model_extra["max_model_len"]
    assert max_len == c.models.retrieve(MODEL).model_extra["max_model_len"] > 0
    r = post("/tokenize", {"model": MODEL, "messages": FRANCE})
    assert r == {"count": len(r["tokens"]), "max_model_len": max_len, "tokens": tok.encode_chat(FRANCE)}
    assert r["count"] == chat(c, max_tokens=1).usage.prompt_tokens
    assert post("/detokenize", {"tokens": r["tokens"]}) == {"prompt": tok.apply_chat_template(FRANCE)}
    closed = post("/tokenize", {"messages": FRANCE, "add_generation_prompt": False})["tokens"]
    assert closed == tok.encode(tok.apply_chat_template(FRANCE, add_generation_prompt=False), add_special_tokens=False)
    text = post("/tokenize", {"prompt": "1, 2, 3, 4,"})
    usage = c.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=1, temperature=0).usage
    assert text["tokens"] == tok.encode("1, 2, 3, 4,") and text["count"] == usage.prompt_tokens


@BOTH
def test_props_gives_ide_plugins_the_context_and_template(stack, sdk, where, tok):
    props = httpx.get(stack[where] + "/props", headers=auth(where)).json()
    assert props["default_generation_settings"]["n_ctx"] == sdk(where).models.list().data[0].model_extra[
        "max_model_len"]
    assert props["model_alias"] == MODEL and props["chat_template"] == tok.chat_template
    assert props["eos_token"] == "<|im_end|>" and props["total_slots"] >= 1
    assert httpx.get(stack[where] + "/version", headers=auth(where)).json()["version"] in props["build_info"]


@BOTH
def test_json_errors_for_unknown_routes_and_methods(stack, sdk, where):
    r = httpx.get(stack[where] + "/v1/nope", headers=auth(where))
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.delete(stack[where] + "/v1/chat/completions", headers=auth(where))
    assert r.status_code == 405 and "message" in r.json()["error"]
    r = httpx.post(stack[where] + "/v1/completions", content=b"x" * (5 << 20), timeout=60, headers=auth(where))
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"


def test_fim_on_a_model_without_fim_tokens_is_a_400_naming_why(stack, sdk):
    for where in ("proxy", "replica"):
        with pytest.raises(openai.BadRequestError) as e:
            sdk(where).completions.create(model=MODEL, prompt="def f(", suffix="    return 1\n", max_tokens=4)
        assert e.value.param == "suffix" and "FIM tokens" in e.value.message
        r = httpx.post(stack[where] + "/infill", json={"input_prefix": "def f(", "input_suffix": "\n"},
                       headers=auth(where))
        assert r.status_code == 400 and "FIM" in r.json()["error"]["message"]


def test_fuzzed_bodies_at_the_replica(stack):
    """The fuzz of test_openai_fuzz.py, lighter, against the real replica's own API."""
    import random

    from tests.edge_proxy.openai_bodies import BASES, check_answer, mutate

    rng = random.Random(77)
    kinds: dict[str, int] = {}
    with httpx.Client(timeout=30, headers=auth("replica")) as h:
        for _ in range(200):
            path, base = rng.choice(BASES)
            r = h.post(stack["replica"] + path, content=mutate(rng, {k: v for k, v in base.items() if k != "model"}),
                       headers={"content-type": "application/json"})
            kind = check_answer(r.status_code, r.headers.get("content-type", ""), r.content)
            kinds[kind] = kinds.get(kind, 0) + 1
        assert h.get(stack["replica"] + "/healthz").json()["status"] == "ok"
    assert kinds.get("json", 0) + kinds.get("stream", 0) > 15 and kinds.get("400", 0) > 60
