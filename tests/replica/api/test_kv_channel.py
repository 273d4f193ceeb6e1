"""KV export and import between real replicas (default model, CPU): a prompt prefilled on A,
its blocks pulled by B (POST /v1/kv/pull -> A's /v1/kv/export), then the same prompt on B is a
cache hit that decodes what A decodes; a finished conversation listed as a hot chain (POST
/v1/kv/hot) once to a hold and pulled by its seed; a layout mismatch and a wrong secret are refused
with a message; a source killed half-way leaves the receiver with whole blocks only and none leaked."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from wire.hashing import salt_seed
from tests.replica.kv_relay import CountingRelay, CuttingRelay
from tests.replica.server import AUTH, engine_pid, idle_within, replica_server

SMALL = ("--kv-memory-gb", "0.1")
TEXT = ("The lighthouse keeper counted the ships that passed each night and wrote their names in a "
        "ledger bound in green leather. Some nights there were none, and he wrote the weather instead: "
        "wind from the west, a low moon, rain that came sideways off the sea and rattled the glass. When "
        "his daughter visited in summer she read the ledger aloud to him, and he corrected the names of the "
        "ships she could not pronounce, though he had never seen most of them by daylight.")


@pytest.fixture(scope="module")
def replicas():
    with replica_server(*SMALL) as a, replica_server(*SMALL) as b:
        yield a, b  # (url, API process) each


@pytest.fixture(scope="module")
def pair(replicas):
    return replicas[0][0], replicas[1][0]


def prompt_ids(url: str) -> list[int]:
    ids = httpx.post(url + "/tokenize", json={"prompt": TEXT}, headers=AUTH, timeout=30).json()["tokens"]
    assert 64 < len(ids) < 128, len(ids)  # over 4 blocks; under 128 every prompt row stays int16
    return ids


def complete(url: str, ids: list[int], **extra) -> tuple[str, int]:
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120,
                   json={"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def pull(receiver: str, source: str, ids: list[int], headers=AUTH, **kw) -> httpx.Response:
    return httpx.post(receiver + "/v1/kv/pull", headers=headers, timeout=120,
                      json={"source": source, "token_ids": ids, **kw})


def test_blocks_moved_from_a_to_b_are_hit_and_decode_the_same(pair):
    a, b = pair
    ids = prompt_ids(a)
    full = (len(ids) - 1) // 16 * 16  # the full blocks a request reuses (one token is always computed)
    first, _ = complete(a, ids)
    again, cached = complete(a, ids)  # A's own hit: the path B takes over the moved blocks
    assert cached == full and again == first
    r = pull(b, a, ids, frame_blocks=2)
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["complete"] and res["imported"] == res["blocks"] == len(ids) // 16 and res["cached"] == 0
    idle_within(b, 10)  # imported blocks are cached free blocks: nothing in use
    text, cached = complete(b, ids)
    assert cached == full and text == again
    res = pull(b, a, ids).json()  # B has them all now: nothing moves
    assert res["complete"] and res["imported"] == 0 and res["cached"] == res["blocks"]


def test_pulls_from_one_source_share_a_kept_alive_connection(pair):
    """A drain pulls each stream again and again (edge_proxy.handoff): every pull after the first
    starts on the receiver's open connection to the source, not a new client and connection."""
    a, b = pair
    ids = prompt_ids(a)
    relay = CountingRelay(int(a.rsplit(":", 1)[1]))
    try:
        for salt in ("kept-alive-1", "kept-alive-2"):  # new hashes to B each time: blocks move
            complete(a, ids, cache_salt=salt)
            res = pull(b, f"http://127.0.0.1:{relay.port}", ids, cache_salt=salt).json()
            assert res["complete"] and res["imported"] == len(ids) // 16, res
        assert relay.accepted == 1
    finally:
        relay.close()


def hot(url: str, headers=AUTH, **body) -> httpx.Response:
    return httpx.post(url + "/v1/kv/hot", headers=headers, json=body, timeout=30)


def test_a_finished_conversation_is_a_hot_chain_listed_once_to_a_hold_and_pulled_by_its_seed(pair):
    a, b = pair
    ids, salt = prompt_ids(a), "hot-chain"
    complete(a, ids, cache_salt=salt)  # finished: no stream holds it, the most recently used chain on A
    listing = hot(a, max_blocks=64, hold_s=30).json()
    chain = listing["chains"][0]
    # from its first block: the prompt's full blocks and the reply's, under its salt's seed (never the salt)
    full = len(ids) // 16 * 16
    assert chain["seed"] == salt_seed(salt) and chain["token_ids"][:full] == ids[:full]
    assert len(chain["token_ids"]) == (len(ids) + 7) // 16 * 16  # the 8th generated token was sampled, not computed
    assert chain not in hot(a, max_blocks=64, hold_s=30).json()["chains"]  # another proxy's hold: not again
    assert chain in hot(a, max_blocks=64).json()["chains"]  # no hold: only listed
    res = pull(b, a, chain["token_ids"], seed=chain["seed"]).json()
    assert res["complete"] and res["imported"] == len(chain["token_ids"]) // 16, res
    _, cached = complete(b, ids, cache_salt=salt)  # the next request of that tenant finds it on B
    assert cached == (len(ids) - 1) // 16 * 16
    assert httpx.delete(f"{a}/v1/kv/hot/{listing['hold']}", headers=AUTH).status_code == 204
    assert httpx.delete(f"{a}/v1/kv/hot/{listing['hold']}", headers=AUTH).status_code == 404
    assert hot(a, headers={}, max_blocks=1).status_code == 401
    assert hot(a, max_blocks=-1).status_code == 400


def test_a_layout_mismatch_is_refused_with_a_message(pair):
    a, _ = pair
    ids = prompt_ids(a)
    complete(a, ids)
    with replica_server(*SMALL, "--kv-cache-dtype", "int8") as (c, _):
        r = pull(c, a, ids)
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert "KV layout mismatch" in err and "dtype 'int8' here, 'float16' there" in err
        assert r.json()["imported"] == 0
        _, cached = complete(c, ids)
        assert cached == 0


def test_a_wrong_secret_is_refused(pair):
    a, b = pair
    ids = prompt_ids(a)
    wrong = {"Authorization": "Bearer not-the-secret"}
    assert httpx.post(a + "/v1/kv/export", headers=wrong, content=b"", timeout=30).status_code == 401
    assert pull(b, a, ids, headers=wrong).status_code == 401
    with replica_server(*SMALL, env={"EDGECHAT_REPLICA_SECRET": "another-deployment"}) as (d, _):
        r = pull(b, d, ids, cache_salt="wrong-secret")  # B presents its secret; D's is another: D refuses
        assert r.status_code == 502 and "HTTP 401" in r.json()["error"] and r.json()["imported"] == 0


def test_bad_bodies_are_refused_with_a_message(pair):
    a, b = pair
    r = pull(b, "file:///etc/passwd", [1, 2, 3])
    assert r.status_code == 400 and "http:// or https://" in r.json()["error"]["message"]
    r = httpx.post(b + "/v1/kv/pull", headers=AUTH, timeout=30, json={"source": a, "token_ids": [-1]})
    assert r.status_code == 400 and "bad KvPull body" in r.json()["error"]["message"]
    r = httpx.post(a + "/v1/kv/export", headers=AUTH, timeout=30, content=b"\xc1")
    assert r.status_code == 400 and "bad KvExport body" in r.json()["error"]["message"]


def test_a_source_killed_half_way_leaves_whole_blocks_and_no_leak(pair):
    _, b = pair
    salt = {"cache_salt": "killed-source"}  # other hashes than the first test's: new to B
    with replica_server(*SMALL) as (x, proc):
        ids = prompt_ids(x)
        blocks = len(ids) // 16
        assert blocks >= 5
        expected, _ = complete(x, ids, **salt)
        spec = httpx.get(x + "/v1/kv/spec", headers=AUTH, timeout=30).json()
        frame = 2 * spec["block_bytes"] + 200  # frame_blocks=2, with its hashes and digests
        # the HTTP head and the KvSpec, two whole frames, then half a block of the third: the source dies there
        relay = CuttingRelay(int(x.rsplit(":", 1)[1]), 1000 + 2 * frame + spec["block_bytes"] // 2,
                             cut=lambda: os.killpg(proc.pid, signal.SIGKILL))
        r = pull(b, f"http://127.0.0.1:{relay.port}", ids, frame_blocks=2, **salt)
        assert relay.done.wait(30) and proc.wait(30) == -signal.SIGKILL
    assert r.status_code == 502, r.text
    res = r.json()
    assert "broke" in res["error"] and not res["complete"] and res["imported"] == 4 < blocks
    idle_within(b, 10)  # no block held: the frame cut short reached no engine, none reserved leaked
    text, cached = complete(b, ids, **salt)
    assert cached == 4 * 16 and text == expected  # the 4 blocks cached are whole


# -- keep last: it restarts B's engine -----------------------------------------------------------------

def restarted(api_pid: int, old: int) -> bool:
    try:
        return engine_pid(api_pid) != old
    except LookupError:  # between the two engine processes
        return False


def test_after_an_engine_restart_blocks_move_through_the_same_kv_slots(replicas):
    """The restarted engine maps the segment its API process kept (replica.kv_slots): pulls in both
    directions move whole blocks again, none of the lost engine's slots stays lent."""
    (a, _), (b, b_proc) = replicas
    old = engine_pid(b_proc.pid)
    os.kill(old, signal.SIGKILL)
    t0 = time.perf_counter()
    while not (restarted(b_proc.pid, old) and httpx.get(b + "/healthz").status_code == 200):
        assert time.perf_counter() - t0 < 180, "B's engine did not come back"
        time.sleep(0.05)
    ids = prompt_ids(a)
    for source, receiver, salt in ((a, b, "after-restart"), (b, a, "after-restart, from B")):
        expected, _ = complete(source, ids, cache_salt=salt)
        res = pull(receiver, source, ids, frame_blocks=2, cache_salt=salt).json()
        assert res["complete"] and res["imported"] == len(ids) // 16, res
        text, cached = complete(receiver, ids, cache_salt=salt)
        assert cached == (len(ids) - 1) // 16 * 16 and text == expected
