"""Helpers for the chat page's tests in headless Chromium (Debian's, driven by Playwright):
the browser, a page with the problems it logged, sending a message and waiting for its
reply's state, screenshots on request, and a stub replica whose every reply is a text the
test chooses (markdown, hostile HTML) run on a thread of its own beside the sync Playwright
API.

Screenshots: with EDGECHAT_PAGE_SHOTS=/some/folder, `shot(page, name)` saves the page there
as name.png (for a person to look at; no test reads them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
from pathlib import Path

import pytest

from stub_replica.server import StubConfig, StubReplica
from tests.replica.server import SECRET
from wire import protocol as wp

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# What Chromium needs as root in a sandbox without a network (docs: env/machines/python.md).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
SHOTS_VAR = "EDGECHAT_PAGE_SHOTS"


@contextlib.contextmanager
def chromium_browser():
    """Headless Chromium (a fresh profile per context); skips where Playwright or Chromium is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: pip install -e '.[test]'")
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (`make install` installs it where apt-get can)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()


def _expected(message) -> bool:
    """Console errors the page causes on purpose: a WebSocket the server refused (or that
    could not connect), and the page's `GET /v1/models` asking why (401 without a good key,
    refused while the server is down)."""
    text, url = message.text, message.location.get("url", "")
    return text.startswith("WebSocket connection to") or (
        text.startswith("Failed to load resource") and url.endswith("/v1/models"))


def new_page(browser, url: str, **ctx):
    """A page at `url` in a fresh context, recording every URL it asks for (`page.seen`),
    the WebSocket frames it sends (`page.sent`: text payloads) and its problems
    (`page.problems`: script errors, console errors other than the expected ones)."""
    context = browser.new_context(**ctx)
    page = context.new_page()
    page.seen, page.sent, page.problems = [], [], []
    page.on("request", lambda r: page.seen.append(r.url))
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: page.sent.append(payload)))
    page.on("pageerror", lambda e: page.problems.append(str(e)))
    page.on("console", lambda m: page.problems.append(m.text) if m.type == "error" and not _expected(m) else None)
    page.goto(url)
    return page


def open_page(browser, url: str, key: str, **ctx):
    """A page at `url`, connected with `key` (entered in the key field, then Connect)."""
    page = new_page(browser, url, **ctx)
    page.fill("#key", key)
    page.click("#connect")
    page.wait_for_selector("#status[data-status=open]", timeout=10_000)
    return page


def say(page, text: str, max_tokens: int, temperature: float = 0.0) -> int:
    """Send a message; the index of its reply bubble."""
    n = page.locator(".msg.assistant").count()
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", str(temperature))
    page.fill("#message", text)
    page.press("#message", "Enter")
    page.wait_for_function(f"() => document.querySelectorAll('.msg.assistant').length > {n}")
    return n


def reply(page, i: int):
    return page.locator(".msg.assistant").nth(i)


def wait_state(page, i: int, state: str, timeout: float = 60_000) -> None:
    page.wait_for_function(f"() => document.querySelectorAll('.msg.assistant')[{i}]?.dataset.state === '{state}'",
                           timeout=timeout)


def wait_tokens(page, i: int, n: int) -> None:
    page.wait_for_function(f"() => Number(document.querySelectorAll('.msg.assistant')[{i}]?.dataset.tokens) >= {n}",
                           timeout=60_000)


def rendered(page, text: str) -> str:
    """The text content of `text` as the page's markdown renderer shows it."""
    return page.evaluate("async (t) => { const m = await import('/static/markdown.js'); "
                         "return m.render(t).textContent; }", text)


def shown(page, i: int) -> str:
    """The text content of reply bubble `i`'s body."""
    return page.evaluate(f"() => document.querySelectorAll('.msg.assistant .text')[{i}].textContent")


def shot(page, name: str) -> Path | None:
    """Save the page as `name`.png in $EDGECHAT_PAGE_SHOTS, when set."""
    folder = os.environ.get(SHOTS_VAR)
    if not folder:
        return None
    path = Path(folder) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    return path


class ScriptedStub(StubReplica):
    """A stub replica whose every reply is `self.reply`, one character per token, then
    `stop` (a reply longer than max_tokens ends at it, `length`): a text the test chose,
    sent over the real internal protocol, so the proxy relays it as it would a model's.
    Token ids stay the stub's own (resume checks them)."""

    reply = "Hello."

    def _emit(self, r, now: float) -> None:
        pos, out = r.pos, r.conn.out
        super()._emit(r, now)
        tokens = next(m for m in reversed(out) if type(m) is wp.Tokens and m.id == r.gen.id)
        tokens.text = self.reply[pos] if pos < len(self.reply) else ""
        if pos + 1 >= len(self.reply) and r.conn.reqs.get(r.rid) is r:  # the reply is over: finish it here
            out.append(wp.Finished(r.gen.id, wp.FINISH_STOP, wp.Usage(len(r.gen.prompt_ids), r.pos, r.cached),
                                   r.ttft_ms, index=r.index))
            del r.conn.reqs[r.rid]
            self._free(r)


@contextlib.contextmanager
def scripted_stub(step_s: float = 0.004):
    """A ScriptedStub (sharing tests.replica.server's SECRET, which start_proxy presents) on
    its own event loop thread: yields it; its http:// URL is f"http://127.0.0.1:{stub.port}"."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="scripted-stub", daemon=True)
    thread.start()

    async def start():
        return await ScriptedStub(StubConfig(replica_id="page-stub", secret=SECRET, step_s=step_s)).start()

    stub = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield stub
    finally:
        asyncio.run_coroutine_threadsafe(stub.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
