"""The chat page at `/` in real headless Chromium against a real proxy over a stub replica
whose replies the test writes (tests/edge_proxy/page.py): on a server that needs API keys
the page says so and asks for one, and a message typed before the key goes out exactly once
after it (or not at all when stopped); replies are shown as markdown (code blocks, lists,
emphasis, tables, links), and a hostile reply (HTML, scripts, javascript: links) shows as
text and runs nothing. The renderer itself is checked in the page on crafted strings.

With EDGECHAT_PAGE_SHOTS=/tmp/page-shots the tests save the page in its states there."""

from __future__ import annotations

import json

import pytest

from tests.edge_proxy.live import start_proxy
from tests.edge_proxy.page import (chromium_browser, new_page, open_page, rendered, reply, say, scripted_stub, shot,
                                   shown, wait_state)
from tests.replica.server import free_port, stop_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
KEY = "sk-page"
MARKDOWN = """## Plan

Use **bold** words, *emphasis* and `inline code`:

1. first step
2. second step

- apples
- pears
  - nested

```python
def greet(name):
    return f"<b>{name}</b>"
```

| a | b |
|---|--:|
| 1 | 2 |

> quoted

See [the docs](https://example.com/docs) or https://example.org/x.
"""
HOSTILE = ("""<img src=x onerror="window.__pwned=1"> <script>window.__pwned=1</script>\n\n"""
           """<svg onload="window.__pwned=1"></svg> <iframe srcdoc="<script>parent.__pwned=1</script>"></iframe>\n\n"""
           """[click me](javascript:window.__pwned=1) [me too](JavaScript:window.__pwned=1) """
           """[data](data:text/html,<script>window.__pwned=1</script>) ![pic](x) """
           """<a href="javascript:window.__pwned=1">anchor</a> **<b onmouseover="window.__pwned=1">bold</b>**\n\n"""
           """```html\n<script>window.__pwned=1</script>\n```""")


@pytest.fixture(scope="module")
def chromium():
    with chromium_browser() as browser:
        yield browser


@pytest.fixture(scope="module")
def stub():
    with scripted_stub() as s:
        yield s


@pytest.fixture(scope="module")
def anonymous(stub):
    """A proxy that needs no key: its page URL."""
    port = free_port()
    proc = start_proxy(port, [f"http://127.0.0.1:{stub.port}"], "--tokenizer", "bytes", "--allow-anonymous",
                       env={"EDGECHAT_API_KEYS": ""})
    yield f"http://127.0.0.1:{port}/"
    stop_group(proc, timeout=10)


@pytest.fixture(scope="module")
def keyed(stub):
    """A proxy that needs an API key (KEY): its page URL."""
    port = free_port()
    proc = start_proxy(port, [f"http://127.0.0.1:{stub.port}"], "--tokenizer", "bytes",
                       env={"EDGECHAT_API_KEYS": f"{KEY}=web"})
    yield f"http://127.0.0.1:{port}/"
    stop_group(proc, timeout=10)


def generates(page) -> list[dict]:
    """The generate frames the page sent, in order."""
    frames = [json.loads(p) for p in page.sent if isinstance(p, str)]
    return [f for f in frames if f.get("type") == "generate"]


def test_anonymous_server_chats_without_asking_for_a_key(chromium, anonymous, stub):
    stub.reply = "Hi! I am the *stub*."
    page = new_page(chromium, anonymous)
    page.wait_for_selector("#status[data-status=open]", timeout=10_000)
    assert page.is_hidden("#notice") and page.get_attribute("#key", "aria-invalid") != "true"
    i = say(page, "Hello?", 64)
    wait_state(page, i, "done")
    assert page.evaluate(f"() => window.edgechat.replies[{i}].text") == stub.reply
    assert reply(page, i).locator(".text em").inner_text() == "stub"
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    shot(page, "anonymous-chat")
    assert not page.problems, page.problems
    page.context.close()


def test_keys_required_says_why_and_a_waiting_message_goes_out_once_with_the_key(chromium, keyed, stub):
    stub.reply = "The key works."
    page = new_page(chromium, keyed)

    # No key: the reason is shown, and the key field is asked for (focused, marked).
    page.wait_for_selector("#status[data-status=failed][data-reason=unauthorized]", timeout=20_000)
    assert "needs an API key" in page.inner_text("#notice") and page.is_visible("#notice")
    assert page.inner_text("#status") == "needs a key"
    assert page.evaluate("() => document.activeElement.id") == "key"
    assert page.get_attribute("#key", "aria-invalid") == "true" and "wanted" in page.get_attribute("#key", "class")
    shot(page, "keys-required-without-a-key")

    # A message typed now waits in its bubble, saying why; Send is disabled until it ends, Stop can end it.
    i = say(page, "Are you there?", 64)
    assert reply(page, i).get_attribute("data-state") == "queued"
    assert "needs an API key" in reply(page, i).locator(".note").inner_text()
    assert page.is_disabled("#send") and page.is_enabled("#stop")
    shot(page, "keys-required-message-waiting")

    # A wrong key: refused, said so; the message still waits.
    page.fill("#key", "sk-wrong")
    page.press("#key", "Enter")
    page.wait_for_function("() => document.querySelector('#notice').textContent.includes('does not know that API key')",
                           timeout=20_000)
    assert page.is_visible("#notice") and reply(page, i).get_attribute("data-state") == "queued"

    # The right key: connected; the waiting message goes out once and its reply arrives.
    page.fill("#key", KEY)
    t_connect = page.evaluate("() => performance.now()")
    page.click("#connect")
    page.wait_for_selector("#status[data-status=open]", timeout=10_000)
    wait_state(page, i, "done")
    since_connect = page.evaluate("() => performance.now()") - t_connect
    assert page.evaluate(f"() => window.edgechat.replies[{i}].text") == stub.reply
    # Its TTFT counts from when it went out, not from when it began waiting for the key.
    assert 0 < page.evaluate(f"() => window.edgechat.replies[{i}].ttft_ms") <= since_connect
    assert reply(page, i).locator(".note").count() == 0
    assert page.is_hidden("#notice") and page.get_attribute("#key", "aria-invalid") == "false"
    sent = generates(page)
    assert len(sent) == 1 and sent[0]["messages"] == [{"role": "user", "content": "Are you there?"}], sent

    # And the next message goes at once (Send and Stop are not stuck).
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    j = say(page, "And now?", 64)
    wait_state(page, j, "done")
    assert len(generates(page)) == 2 and page.evaluate("() => window.edgechat.history.length") == 4
    shot(page, "keys-required-with-the-key")
    assert not page.problems, page.problems
    page.context.close()


def test_a_waiting_message_stopped_is_never_sent(chromium, keyed, stub):
    stub.reply = "Only this one."
    page = new_page(chromium, keyed)
    page.wait_for_selector("#status[data-status=failed]", timeout=20_000)
    i = say(page, "Forget me.", 64)
    page.click("#stop")
    wait_state(page, i, "unsent")
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    assert page.evaluate("() => window.edgechat.history") == []
    page.fill("#key", KEY)
    page.click("#connect")
    page.wait_for_selector("#status[data-status=open]", timeout=10_000)
    j = say(page, "Remember me.", 64)
    wait_state(page, j, "done")
    sent = generates(page)
    assert [f["messages"] for f in sent] == [[{"role": "user", "content": "Remember me."}]], sent
    assert not page.problems, page.problems
    page.context.close()


def test_a_markdown_reply_is_rendered(chromium, anonymous, stub):
    stub.reply = MARKDOWN
    page = new_page(chromium, anonymous)
    page.wait_for_selector("#status[data-status=open]", timeout=10_000)
    i = say(page, "Show me some markdown.", 1024)
    wait_state(page, i, "done")
    assert page.evaluate(f"() => window.edgechat.replies[{i}].text") == MARKDOWN
    body = reply(page, i).locator(".text")
    assert body.locator("h2").inner_text() == "Plan"
    assert body.locator("strong").first.inner_text() == "bold" and body.locator("em").first.inner_text() == "emphasis"
    assert body.locator("p > code").inner_text() == "inline code"
    assert body.locator("ol > li").all_inner_texts() == ["first step", "second step"]
    assert body.locator("ul > li").count() == 3 and body.locator("ul ul > li").inner_text() == "nested"
    code = body.locator("pre > code.language-python")
    assert code.text_content() == 'def greet(name):\n    return f"<b>{name}</b>"'
    assert body.locator("table td").all_inner_texts() == ["1", "2"] and body.locator("blockquote").count() == 1
    assert [a.get_attribute("href") for a in body.locator("a").all()] == ["https://example.com/docs",
                                                                        "https://example.org/x"]
    assert body.locator("b").count() == 0  # the code's <b> is text
    assert shown(page, i) == rendered(page, MARKDOWN)
    shot(page, "markdown-reply")
    assert not page.problems, page.problems
    page.context.close()


def test_a_hostile_reply_shows_as_text_and_runs_nothing(chromium, anonymous, stub):
    stub.reply = HOSTILE
    page = new_page(chromium, anonymous)
    page.on("dialog", lambda d: page.problems.append(f"dialog: {d.message}"))
    page.wait_for_selector("#status[data-status=open]", timeout=10_000)
    i = say(page, "Be nasty.", 1024)
    wait_state(page, i, "done")
    assert page.evaluate(f"() => window.edgechat.replies[{i}].text") == HOSTILE
    body = reply(page, i).locator(".text")
    assert body.locator("img, script, svg, iframe, b, a").count() == 0  # no element from the reply, no link
    text = body.text_content()
    for literal in ('<img src=x onerror="window.__pwned=1">', "<script>window.__pwned=1</script>",
                    "[click me](javascript:window.__pwned=1)", '<a href="javascript:window.__pwned=1">anchor</a>'):
        assert literal in text
    body.locator("strong").hover()  # the would-be onmouseover (no element carries it: nothing to wait for)
    assert page.evaluate("() => window.__pwned") is None
    assert not [u for u in page.seen if u.endswith("/x")]  # the "image" was not fetched
    shot(page, "hostile-reply")
    # The page's Content-Security-Policy would block an inline handler that got into the DOM,
    # but not silently: the refusal is a console error, so this also says none was attempted.
    assert not page.problems, page.problems
    page.context.close()


CASES = [  # markdown -> the renderer's HTML
    ("plain <b>x</b> & y", "<p>plain &lt;b&gt;x&lt;/b&gt; &amp; y</p>"),
    ("**s** *e* _e_ snake_case ~~d~~", "<p><strong>s</strong> <em>e</em> <em>e</em> snake_case <del>d</del></p>"),
    ("*a **b** c* ***both***", "<p><em>a <strong>b</strong> c</em> <strong><em>both</em></strong></p>"),
    ("line one\nline two\n\nnext", "<p>line one<br>line two</p><p>next</p>"),
    ("# H1\n### H3 ###", "<h1>H1</h1><h3>H3</h3>"),
    ("`a<b>` and ``x ` y``", "<p><code>a&lt;b&gt;</code> and <code>x ` y</code></p>"),
    ("```js\nlet a = '<i>';\n```", '<pre><code class="language-js" data-lang="js">let a = \'&lt;i&gt;\';</code></pre>'),
    ("```\nstill streaming", '<pre data-open=""><code>still streaming</code></pre>'),
    ("```\"><img src=x onerror=alert(1)>\nx\n```", "<pre><code>x</code></pre>"),
    ("Steps:\n1. a\n2. b", "<p>Steps:</p><ol><li>a</li><li>b</li></ol>"),
    ("3. c\n4. d", '<ol start="3"><li>c</li><li>d</li></ol>'),
    ("- a\n  - b\n- c", "<ul><li>a<ul><li>b</li></ul></li><li>c</li></ul>"),
    ("- a\n\n- b", "<ul><li><p>a</p></li><li><p>b</p></li></ul>"),
    ("1. run\n   ```sh\n   ls\n   ```",
     '<ol><li>run<pre><code class="language-sh" data-lang="sh">ls</code></pre></li></ol>'),
    ("> q *e*", "<blockquote><p>q <em>e</em></p></blockquote>"),
    ("---", "<hr>"),
    ("|a|b|\n|:-|-:|\n|1|2|",
     '<div><table><thead><tr><th style="text-align: left;">a</th><th style="text-align: right;">b</th></tr></thead>'
     '<tbody><tr><td style="text-align: left;">1</td><td style="text-align: right;">2</td></tr></tbody></table></div>'),
    ("[t](https://e.com/a_(b) \"T\")",
     '<p><a href="https://e.com/a_(b)" rel="noopener noreferrer nofollow" target="_blank" title="T">t</a></p>'),
    ("<https://e.com> and http://e.org/p.",
     '<p><a href="https://e.com/" rel="noopener noreferrer nofollow" target="_blank">https://e.com</a> and '
     '<a href="http://e.org/p" rel="noopener noreferrer nofollow" target="_blank">http://e.org/p</a>.</p>'),
    ("\\*not em\\* \\`x\\`", "<p>*not em* `x`</p>"),
]
UNSAFE_LINKS = ["javascript:alert(1)", "JaVaScRiPt:alert(1)", " javascript:alert(1)", "java\tscript:alert(1)",
                "&#106;avascript:alert(1)", "data:text/html,<script>alert(1)</script>", "vbscript:x",
                "file:///etc/passwd", "//evil.example/x", "/relative", "mailto:a@b.c"]


def test_the_renderer_in_the_page(chromium, anonymous):
    """markdown.js on crafted strings, in the page: the HTML it builds, links only to http(s),
    and hostile inputs of 50-80 KB rendered in linear time (generous bound: a busy 2-core machine)."""
    page = new_page(chromium, anonymous)
    html = page.evaluate("""async (cases) => { const m = await import('/static/markdown.js');
        return cases.map((t) => { const d = document.createElement('div'); d.append(m.render(t));
                                  return d.innerHTML; }); }""", [md for md, _ in CASES])
    for (md, want), got in zip(CASES, html):
        assert got == want, md
    links = page.evaluate("""async (urls) => { const m = await import('/static/markdown.js');
        return urls.map((u) => { const f = m.render(`[x](${u}) ![y](${u}) <${u}>`);
                                 return [f.querySelectorAll('a, img').length, f.textContent]; }); }""", UNSAFE_LINKS)
    for url, (elements, text) in zip(UNSAFE_LINKS, links):
        assert elements == 0 and f"[x]({url})" in text, url
    # Streamed (re-rendered after every character, as a reply grows) ends exactly as rendered at once,
    # and every step equals a render of the text so far.
    texts = [MARKDOWN, HOSTILE, "\n\n".join(md for md, _ in CASES),
             "1. a\n2. b\n\n3. c\n\nafter\n| x | y |\n|---|---|\n| 1 | 2 |\nmore\n\n- p\n\n  cont\n"
             "```\ncode\n```\n> q\nlazy"]
    diverged = page.evaluate("""async (texts) => { const m = await import('/static/markdown.js'); const bad = [];
        for (const t of texts) {
            const d = document.createElement('div'); const v = new m.MarkdownView(d);
            for (let n = 1; n <= t.length; n++) {
                v.update(t.slice(0, n));
                const w = document.createElement('div'); w.append(m.render(t.slice(0, n)));
                if (d.innerHTML !== w.innerHTML) { bad.push([t.slice(0, n), d.innerHTML, w.innerHTML]); break; }
            }
        }
        return bad; }""", texts)
    assert diverged == [], diverged
    took = page.evaluate("""async () => { const m = await import('/static/markdown.js'); const out = {};
        const inputs = {stars: '*a '.repeat(20000), brackets: '['.repeat(50000), ticks: '`a ``b '.repeat(10000),
                        nested: '- '.repeat(3000) + 'x', quotes: '>'.repeat(5000) + ' x',
                        mixed: '*_~`[<h!'.repeat(8000), urls: '-http://['.repeat(8000),
                        closes: 'https://a.b/' + ')'.repeat(60000),
                        lists: '- item **b**\\n  - sub `c`\\n'.repeat(3000)};
        for (const [k, t] of Object.entries(inputs)) {
            const t0 = performance.now(); m.render(t); out[k] = performance.now() - t0; }
        return out; }""")
    assert max(took.values()) < 3000, took
    assert not page.problems, page.problems
    page.context.close()
