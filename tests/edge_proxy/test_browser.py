"""The chat page at `/` in real headless Chromium (Debian's, driven by Playwright) against a
proxy over a real default-model replica: the key rides in the subprotocol, the reply streams
in (several frames, shown as they come), per-message TTFT, tokens/s, region and replica are
shown, the stop button ends a stream, a reply cut by a proxy crash continues after the proxy
restarts (reconnect + exact resume: the text equals an uninterrupted run's), nothing is
fetched from another origin, and a screenshot is written. CORS from another origin's page
(`--allowed-origin`), and the page over https/wss with a certificate made by the test."""

from __future__ import annotations

import http.server
import os
import signal
import threading

import httpx
import pytest

from tests.edge_proxy.live import self_signed, start_proxy
from tests.edge_proxy.page import (chromium_browser, open_page, rendered, reply, say, shot, shown, wait_state,
                                   wait_tokens)
from tests.replica.server import engine_pid, free_port, stop_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
KEY = "sk-page"
ENV = {"EDGECHAT_API_KEYS": f"{KEY}=web"}
LONG = "Write a long story about a dragon who learns to bake bread."


@pytest.fixture(scope="module")
def chromium():
    with chromium_browser() as browser:
        yield browser


def uninterrupted(proxy_url: str, messages: list[dict], max_tokens: int) -> str:
    r = httpx.post(proxy_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_chat_page_streams_stops_and_resumes_after_a_proxy_restart(chromium, default_replica_server, tmp_path):
    default_replica, api = default_replica_server
    port = free_port()
    origin = f"http://127.0.0.1:{port}"
    proc = start_proxy(port, [default_replica], "--region", "browser", env=ENV)
    try:
        page = open_page(chromium, origin + "/", KEY)

        # A reply streams in, frame by frame, with its figures.
        i = say(page, "Count from one to twenty, separated by commas.", 40)
        page.wait_for_function("() => document.querySelector('.msg.assistant .text').textContent.length > 0 && "
                               "document.querySelector('.msg.assistant').dataset.state === 'streaming'")
        wait_state(page, i, "done")
        s = page.evaluate(f"() => window.edgechat.replies[{i}]")
        assert s["tokens"] > 3 and len(s["gaps_ms"]) >= 3  # several frames, not one at the end
        assert s["ttft_ms"] > 0 and s["tokens_per_s"] > 0 and s["finish_reason"] in ("stop", "length")
        assert s["region"] == "browser" and s["replica"] == "R0"
        figures = reply(page, i).locator(".meta").inner_text()
        assert "TTFT" in figures and "tok/s" in figures and "browser / R0" in figures
        text = page.evaluate("() => window.edgechat.history[1].content")
        assert s["text"] == text and shown(page, i) == rendered(page, text)  # the reply, as markdown

        # Stop ends the stream: done/abort, and the text stops growing.
        i = say(page, LONG, 400, temperature=0.7)
        wait_tokens(page, i, 5)
        page.click("#stop")
        wait_state(page, i, "stopped")
        text = reply(page, i).locator(".text").inner_text()
        page.wait_for_timeout(300)
        assert reply(page, i).locator(".text").inner_text() == text
        s = page.evaluate(f"() => window.edgechat.replies[{i}]")
        assert s["finish_reason"] == "abort" and 5 <= s["tokens"] < 400
        assert page.is_disabled("#stop")

        # The proxy crashes mid-reply and comes back on its port: the page reconnects and the reply
        # continues where it stopped, equal to an uninterrupted run. The replica's engine is frozen
        # from the moment the page has shown a few tokens until the new proxy is up, so the cut
        # lands mid-reply however loaded the machine is.
        i = say(page, LONG, 60)
        wait_tokens(page, i, 4)
        engine = engine_pid(api.pid)
        os.kill(engine, signal.SIGSTOP)
        try:
            assert page.evaluate(f"() => window.edgechat.replies[{i}]") is None  # still streaming
            history = page.evaluate("() => window.edgechat.history")  # what the reply was asked with
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            page.wait_for_selector("#status[data-status=reconnecting]")
            proc = start_proxy(port, [default_replica], "--region", "browser", env=ENV)
        finally:
            os.kill(engine, signal.SIGCONT)
        page.wait_for_selector("#status[data-status=open]", timeout=30_000)
        wait_state(page, i, "done")
        s = page.evaluate(f"() => window.edgechat.replies[{i}]")
        assert s["resumes"] == 1 and page.evaluate("() => window.edgechat.client.reconnects") == 1
        want = uninterrupted(origin, history, 60)
        assert s["text"] == want and shown(page, i) == rendered(page, want)

        png = tmp_path / "chat-page.png"
        page.screenshot(path=str(png), full_page=True)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
        shot(page, "real-model-after-a-proxy-restart")
        assert all(u.startswith(origin) or u.startswith("data:") for u in page.seen), page.seen
        assert {u.removeprefix(origin) for u in page.seen} >= {"/", "/static/chat.js", "/static/edgechat.js",
                                                               "/static/markdown.js"}
        assert not page.problems, page.problems
    finally:
        stop_group(proc, timeout=10)


def test_cors_from_another_origin(chromium, default_replica):
    """A page on another origin calls the OpenAI API with fetch (a preflighted request):
    allowed with `--allowed-origin`, refused by the browser otherwise."""
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Blank)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    other = f"http://127.0.0.1:{site.server_address[1]}"
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    proc = start_proxy(port, [default_replica], "--allowed-origin", other, env=ENV)
    try:
        pre = httpx.options(api + "/v1/chat/completions", headers={
            "Origin": other, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == other
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        denied = httpx.options(api + "/v1/chat/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert denied.status_code == 400 and "access-control-allow-origin" not in denied.headers

        page = chromium.new_page()
        page.goto(other + "/")
        call = """async (url) => {
            try {
                const r = await fetch(url + "/v1/chat/completions", {method: "POST",
                    headers: {"Authorization": "Bearer sk-page", "Content-Type": "application/json"},
                    body: JSON.stringify({messages: [{role: "user", content: "Hi"}], max_tokens: 4})});
                return {status: r.status, text: (await r.json()).choices[0].message.content};
            } catch (e) { return {error: String(e)}; }
        }"""
        got = page.evaluate(call, api)
        assert got.get("status") == 200 and got["text"], got
        stop_group(proc, timeout=10)
        proc = start_proxy(port, [default_replica], env=ENV)  # no --allowed-origin: the browser refuses
        got = page.evaluate(call, api)
        assert "error" in got and "Failed to fetch" in got["error"], got
        page.close()
    finally:
        stop_group(proc, timeout=10)
        site.shutdown()
        site.server_close()


def test_page_over_https_and_wss(chromium, default_replica, tmp_path):
    cert, key = self_signed(tmp_path)
    port = free_port()
    proc = start_proxy(port, [default_replica], "--ssl-certfile", cert, "--ssl-keyfile", key, env=ENV,
                       scheme="https")
    try:
        page = open_page(chromium, f"https://127.0.0.1:{port}/", KEY, ignore_https_errors=True)
        assert page.evaluate("() => window.edgechat.client.url") == f"wss://127.0.0.1:{port}/v1/stream"
        i = say(page, "Say hello.", 8)
        wait_state(page, i, "done")
        assert page.evaluate(f"() => window.edgechat.replies[{i}].tokens") > 0
        page.context.close()
    finally:
        stop_group(proc, timeout=10)


class _Blank(http.server.BaseHTTPRequestHandler):
    """Another origin's page (empty)."""

    def do_GET(self):
        body = b"<!doctype html><title>another site</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass
