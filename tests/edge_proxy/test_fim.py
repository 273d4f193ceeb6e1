"""Fill-in-the-middle end to end on a small random-weights Llama whose tokenizer has
StarCoder's FIM tokens (built here with the `tokenizers` library): `/v1/completions`
with `suffix` and llama.cpp's `/infill` (streaming and not, repo-level
`input_extra`, `n_predict: 0` warm-up, `response_fields`) at the proxy and at the
replica. The model is random, so each answer is checked against the same model
fed the FIM prompt's token ids directly: equal text proves the layout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from replica.tokenizer import Tokenizer
from tests.replica.server import AUTH, SECRET, free_port, replica_server, wait_healthy

pytestmark = pytest.mark.timeout(300)
SPECIAL = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<repo_name>", "<file_sep>"]
PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"


def fim_model(folder) -> None:
    """A byte-level BPE tokenizer (no merges) with FIM tokens, and a tiny Llama config."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = BackendTokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=256 + len(SPECIAL), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
        eos_token_id=256)))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fim") / "tiny-coder"
    fim_model(folder)
    with replica_server("--model", str(folder), "--random-weights", "--kv-memory-gb", "0.05") as (rep, _):
        port = free_port()
        proxy = subprocess.Popen([sys.executable, "-m", "edge_proxy", "--port", str(port), "--allow-anonymous",
                                  "--tokenizer", str(folder), "--replica",
                                  rep.replace("http://", "ws://") + "/v1/replica"],
                                 env={**os.environ, "EDGECHAT_REPLICA_SECRET": SECRET}, start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proxy)
            yield {"proxy": f"http://127.0.0.1:{port}", "replica": rep, "tok": Tokenizer.from_hf_dir(folder)}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proxy.pid, signal.SIGTERM)
            proxy.wait(30)


def by_ids(url: str, ids: list[int], n: int) -> str:
    r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": n, "temperature": 0}, timeout=60,
                   headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("where", ["proxy", "replica"])
def test_suffix_and_infill_build_the_fim_prompt(stack, where):
    url, tok = stack[where], stack["tok"]
    assert tok.fim is not None and tok.fim.name == "starcoder"
    ids = tok.fim.encode(tok, PREFIX, SUFFIX)
    assert ids[0] == tok.token_to_id("<repo_name>") and tok.token_to_id("<fim_middle>") in ids
    r = httpx.post(url + "/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8,
                                                  "temperature": 0}, timeout=60, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == by_ids(url, ids, 8)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)

    extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n", "time": 1.5}]
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra, "prompt": "a", "n_predict": 8,
            "temperature": 0, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "id_slot": 0}
    expected = by_ids(url, tok.fim.encode(tok, PREFIX, SUFFIX, [("util.py", extra[0]["text"])], "a"), 8)
    assert expected and expected != r.json()["choices"][0]["text"]  # the extra file and the middle count
    r = httpx.post(url + "/infill", json=body, timeout=60, headers=AUTH)
    assert r.status_code == 200, r.text
    ans = r.json()
    assert ans["content"] == expected and ans["stop"] is True and ans["stop_type"] in ("eos", "limit")
    assert ans["tokens_predicted"] <= 8 and ans["timings"]["predicted_n"] == ans["tokens_predicted"]

    events = []
    with httpx.stream("POST", url + "/infill", json={**body, "stream": True}, timeout=60, headers=AUTH) as s:
        for line in s.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append(json.loads(line[6:]))
    assert "".join(e["content"] for e in events) == expected
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True

    warm = httpx.post(url + "/infill", json={**body, "n_predict": 0, "response_fields": [
        "content", "tokens_predicted", "timings/prompt_n"]}, timeout=60, headers=AUTH).json()
    assert warm == {"content": "", "tokens_predicted": 0, "timings/prompt_n": warm["timings/prompt_n"]}

    bad = httpx.post(url + "/infill", json={**body, "grammar": "root ::= x"}, timeout=60, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "grammar"


@pytest.mark.anyio
async def test_prefix_and_suffix_over_the_websocket(stack):
    """The public protocol's FIM (`prefix` + `suffix`) builds the same prompt; `replaces` and
    `resumable` work on it like on any prompt."""
    from edge_proxy.client import EdgeClient

    tok = stack["tok"]
    expected = by_ids(stack["proxy"], tok.fim.encode(tok, PREFIX, SUFFIX), 8)
    url = stack["proxy"].replace("http://", "ws://") + "/v1/stream"
    async with await EdgeClient.connect(url) as c:
        first = await c.generate(prefix=PREFIX[:-3], suffix=SUFFIX, max_tokens=200, temperature=0)
        req = await c.generate(prefix=PREFIX, suffix=SUFFIX, replaces=first, max_tokens=8, temperature=0)
        text, done = await req.result()
        assert (await first.result())[1].finish_reason in ("abort", "stop", "length")
        assert text == expected and done.usage.prompt_tokens == len(tok.fim.encode(tok, PREFIX, SUFFIX))
        assert req.ids and tok.decode(req.ids) == text  # a reconnecting client asks for the ids
