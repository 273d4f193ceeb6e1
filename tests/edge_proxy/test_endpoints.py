"""The endpoints people reach for, at a real proxy (uvicorn) over replica stubs with the byte
tokenizer: /health, /version, /tokenize and /detokenize in vLLM's shapes (and llama.cpp's
/tokenize body), `max_model_len` in /v1/models through the official `openai` SDK, and what
IDE plugins read of llama.cpp's /props. The answers that depend on the model's own
tokenizer and template are checked on a real replica in test_openai_sdk.py."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
import openai
import pytest

from edge_proxy import protocol as pp
from edge_proxy.limits import Limits
from edge_proxy.prompt import ByteTokenizer
from wire.openai_routes import VERSION

from conftest import proxy_for, stubs

pytestmark = pytest.mark.anyio
AUTH = {"Authorization": "Bearer sk-alice"}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hé"}]


def chatml(messages, generation_prompt: bool) -> str:
    """What ByteTokenizer's template renders (ChatML)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


async def test_health_and_version():
    async with stubs("a") as reps, proxy_for(reps) as p, httpx.AsyncClient(trust_env=False) as h:
        health, healthz = (await h.get(p.http + "/health")), (await h.get(p.http + "/healthz"))
        assert health.status_code == healthz.status_code == 200  # no key needed: probes carry none
        assert health.json()["status"] == "ok" and health.json().keys() == healthz.json().keys()
        assert (await h.get(p.http + "/version")).status_code == 401  # an API route: the key, as the others
        r = await h.get(p.http + "/version", headers=AUTH)
        assert r.status_code == 200 and r.json() == {"version": VERSION} and VERSION != "unknown"
    nobody = SimpleNamespace(url="ws://127.0.0.1:9/v1/replica")  # nothing listens there
    async with proxy_for([nobody], wait_ready=0) as p, httpx.AsyncClient(trust_env=False) as h:
        r = await h.get(p.http + "/health")
        assert r.status_code == 503 and r.json()["status"] == "no_replica"


async def test_models_carry_the_smallest_context_of_their_replicas():
    async with stubs("a", max_model_len=4096) as a, stubs("b", max_model_len=2048) as b, \
            stubs("c", model="other", max_model_len=8192) as c, proxy_for(a + b + c) as p:
        client = openai.AsyncOpenAI(base_url=p.http + "/v1", api_key="sk-alice", max_retries=0)
        async with client:
            models = (await client.models.list()).data
            assert [(m.id, m.model_extra["max_model_len"]) for m in models] == [("other", 8192), ("stub", 2048)]
            assert models[1].model_extra["edgechat"] == {"fim": False}
            one = await client.models.retrieve("stub")
            assert one.model_extra["max_model_len"] == 2048
        async with httpx.AsyncClient(trust_env=False, headers=AUTH) as h:
            r = await h.post(p.http + "/tokenize", json={"model": "other", "prompt": "abc"})
            assert r.json() == {"count": 3, "max_model_len": 8192, "tokens": [97, 98, 99]}


async def test_tokenize_and_detokenize_in_vllms_shapes():
    async with stubs("a") as reps, proxy_for(reps) as p, \
            httpx.AsyncClient(trust_env=False, headers=AUTH, base_url=p.http) as h:
        r = await h.post("/tokenize", json={"prompt": "hé"})
        assert r.status_code == 200 and r.json() == {"count": 3, "max_model_len": 4096, "tokens": [104, 195, 169]}
        r = await h.post("/tokenize", json={"model": "stub", "messages": CHAT})
        want = list(chatml(CHAT, True).encode())
        assert r.json() == {"count": len(want), "max_model_len": 4096, "tokens": want}
        r = await h.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False})
        assert r.json()["tokens"] == list(chatml(CHAT, False).encode())
        r = await h.post("/tokenize", json={"content": "ab", "add_special": False, "parse_special": True})
        assert r.json()["tokens"] == [97, 98]  # llama.cpp's body, as llama.vscode counts tokens
        r = await h.post("/detokenize", json={"tokens": want})
        assert r.status_code == 200 and r.json() == {"prompt": chatml(CHAT, True)}
        # The chat route sends exactly these ids: its usage counts them.
        r = await h.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        # Refused like the other API routes: a key, the body's fields, the proxy's limits.
        assert (await h.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer nope"})
                ).status_code == 401
        r = await h.post("/tokenize", json={"prompt": "a", "messages": CHAT})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = await h.post("/tokenize", json={"prompt": "x" * (p.proxy.cfg.limits.max_prompt_bytes + 1)})
        assert r.status_code == 400 and r.json()["error"]["code"] == pp.PROMPT_TOO_LONG
        r = await h.post("/detokenize", json={"tokens": [1, 1 << 31]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"


async def test_props_is_what_ide_plugins_read():
    async with stubs("a", "b", max_running=4, max_model_len=2048) as reps, proxy_for(reps) as p, \
            httpx.AsyncClient(trust_env=False, headers=AUTH, base_url=p.http) as h:
        for c in p.proxy.pool.conns:  # each stub's Load names its slots
            while c.load is None or c.load.max_running != 4:
                c.load_event.clear()
                await asyncio.wait_for(c.load_event.wait(), 5)
        r = await h.get("/props")
        props = r.json()
        assert r.status_code == 200 and props["default_generation_settings"]["n_ctx"] == 2048  # llama.vscode's
        assert props["total_slots"] == 8 and props["model_alias"] == props["model_path"] == "stub"
        assert props["modalities"] == {"vision": False, "audio": False}
        assert props["build_info"] == f"edgechat {VERSION}" and props["chat_template"] == ""
        # llama.vscode names the model when /v1/models lists several.
        assert (await h.get("/props", params={"model": "stub", "autoload": "false"})).json() == props
        assert (await h.get("/props", params={"model": "gpt-9"})).status_code == 404
        assert (await h.get("/props", headers={"Authorization": "Bearer nope"})).status_code == 401


class BlockingTokenizer(ByteTokenizer):
    """Bytes, but encoding waits until the test lets it go: a tokenizer busy for as long as it likes."""

    def __init__(self):
        self.started, self.go = threading.Event(), threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.started.set()
        assert self.go.wait(30)
        return super().encode(text)


async def test_tokenize_runs_in_the_tokenizer_threads_never_on_the_event_loop():
    tok = BlockingTokenizer()
    limits = Limits(tokenizer_threads=1, max_tokenizing=1)
    async with stubs("a") as reps, proxy_for(reps, tokenizer=tok, limits=limits) as p, \
            httpx.AsyncClient(trust_env=False, headers=AUTH, base_url=p.http, timeout=30) as h:
        busy = asyncio.create_task(h.post("/tokenize", json={"prompt": "slow"}))
        assert await asyncio.to_thread(tok.started.wait, 30)
        # The loop answers while a thread tokenizes; a full pool refuses at once, as for a chat.
        assert (await h.get("/health")).status_code == 200
        r = await h.post("/tokenize", json={"prompt": "next"})
        assert r.status_code == 503 and r.json()["error"]["code"] == pp.OVERLOADED and "retry-after" in r.headers
        tok.go.set()
        r = await busy
        assert r.json()["tokens"] == list(b"slow")
