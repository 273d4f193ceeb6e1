"""The clients the service is for, timed end to end on the default model (issue 16):

    python bench/clients.py [--replica http://HOST:PORT] [--rounds 20] [--skip browser]

- browser: the chat page at / in headless Chromium (Playwright, Debian's chromium): time to
  first token and inter-token gaps as the page measures them (performance.now() per frame),
  and beside them the gaps the proxy saw on the same streams (its ITL histogram over the
  browser's rounds, interpolated within its buckets): what the browser adds on top;
- voice: examples/voice_agent.py, a reply interrupted after a few spoken words: barge-in ->
  the new reply's first token, and the user's turn -> first sentence ready to speak;
- autocomplete: examples/autocomplete.py typing bursts of keystrokes 50 ms apart (each
  request replacing the last): keystroke -> suggestion (done) for the suggestions shown.

Starts a replica (unless --replica) and a proxy on free ports; prints one Markdown table
with p50/p99 per figure, the machine and the date.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_proxy.client import EdgeClient  # noqa: E402
from examples.autocomplete import SAMPLE, Autocomplete, percentile, type_text  # noqa: E402
from examples.voice_agent import VoiceAgent  # noqa: E402
from tests.edge_proxy.live import proxy  # noqa: E402
from tests.replica.server import replica_server  # noqa: E402

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
QUESTIONS = ["What is the capital of France?", "Give me three tips for sleeping better.",
             "Explain what a hash table is.", "Write a haiku about the sea.", "How do vaccines work?"]


def browser(port: int, rounds: int, temperature: str = "") -> dict[str, list[float]]:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, headless=True, args=FLAGS)
        page = b.new_page()
        page.goto(f"http://127.0.0.1:{port}/")
        page.wait_for_selector("#status[data-status=open]")
        page.fill("#max-tokens", "64")
        if temperature:
            page.fill("#temperature", temperature)  # the page's own default otherwise (0.7)
        for i in range(rounds):
            page.fill("#message", QUESTIONS[i % len(QUESTIONS)])
            page.press("#message", "Enter")
            page.wait_for_function(f"() => window.edgechat.replies.length > {i}", timeout=120_000)
        replies = page.evaluate("() => window.edgechat.replies")
        b.close()
    return {"browser TTFT": [r["ttft_ms"] for r in replies if r["ttft_ms"] is not None],
            "browser inter-token gap": [g for r in replies for g in r["gaps_ms"]]}


async def voice(url: str, rounds: int) -> dict[str, list[float]]:
    barge, first_sentence = [], []
    async with await EdgeClient.connect(url) as c:
        for i in range(rounds):
            agent = VoiceAgent(c, "You are a storyteller.", words_per_s=12.0, max_tokens=200, temperature=0.7,
                               session=f"voice-{i}")
            turn = await agent.say("Tell me a story about a lighthouse keeper and a storm.")
            await asyncio.wait_for(turn.speaker.until_words(6), 60)
            second = await agent.barge_in("Wait, make it about a dragon instead.")
            await asyncio.wait_for(second.first_token.wait(), 60)
            await second.request.cancel()  # the next round starts from a quiet replica
            second.task.cancel()
            await asyncio.gather(second.task, return_exceptions=True)
            barge.append(second.barge_in_to_first_token_ms)
            first_sentence.append(turn.time_to_first_sentence_ms)
    return {"voice barge-in -> first token": barge, "voice turn -> first sentence": first_sentence}


async def autocomplete(url: str, rounds: int) -> dict[str, list[float]]:
    async with await EdgeClient.connect(url) as c:
        ac = Autocomplete(c, debounce_ms=20, max_tokens=16)
        cursor = len(SAMPLE) // 5
        for _ in range(rounds):
            if cursor >= len(SAMPLE) - 8:
                cursor = len(SAMPLE) // 5
            cursor = await type_text(ac, SAMPLE, cursor, 6, 0.05)
            await ac.settle()
    return {"autocomplete keystroke -> suggestion": [s.latency_ms for s in ac.suggestions]}


def itl_buckets(port: int) -> list[tuple[float, int]]:
    """The proxy's cumulative ITL histogram: (upper bound in ms, count) per bucket."""
    import httpx

    out = []
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False).text.splitlines():
        if line.startswith("edgechat_proxy_itl_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out.append((float("inf") if le == "+Inf" else float(le) * 1e3, int(float(line.rsplit(" ", 1)[1]))))
    return out


def bucket_quantiles(before, after, qs=(0.5, 0.99)) -> list[float]:
    """Quantiles of what was observed between two scrapes, linear within a bucket."""
    counts = [(le, a - b) for (le, a), (_, b) in zip(after, before)]
    total = counts[-1][1]
    out = []
    for q in qs:
        want, lo = q * total, 0.0
        prev = 0
        for le, c in counts:
            if c >= want and c > prev:
                out.append(lo + (le - lo) * (want - prev) / (c - prev) if le != float("inf") else lo)
                break
            lo, prev = le, c
    return out


async def run(args, replica: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    with proxy([replica], "--allow-anonymous", "--region", "bench") as (port, _):
        url = f"ws://127.0.0.1:{port}/v1/stream"
        if "browser" not in args.skip:
            before = itl_buckets(port)
            out.update(await asyncio.to_thread(browser, port, args.rounds, args.temperature))
            p50, p99 = bucket_quantiles(before, itl_buckets(port))
            print(f"the proxy's inter-token gaps on the browser's streams (from its histogram): "
                  f"p50 {p50:.1f} ms, p99 {p99:.1f} ms", flush=True)
        if "voice" not in args.skip:
            out.update(await voice(url, args.rounds))
        if "autocomplete" not in args.skip:
            out.update(await autocomplete(url, args.rounds))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replica", default="", help="a running replica's http URL (default: start one)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--skip", default="", help="comma-separated: browser, voice, autocomplete")
    ap.add_argument("--temperature", default="", help="the chat page's temperature (default: the page's, 0.7)")
    args = ap.parse_args(argv)
    if args.replica:
        figures = asyncio.run(run(args, args.replica))
    else:
        with replica_server("--replica-id", "bench", "--kv-memory-gb", "0.25") as (replica, _):
            figures = asyncio.run(run(args, replica))
    print(f"\n{platform.node()} ({os.cpu_count()} cores, {platform.machine()}), "
          f"{datetime.date.today()}, default model on CPU, `python bench/clients.py --rounds {args.rounds}`\n")
    print("| figure | n | p50 ms | p99 ms |\n|---|---:|---:|---:|")
    for name, xs in figures.items():
        print(f"| {name} | {len(xs)} | {percentile(xs, 0.5):.1f} | {percentile(xs, 0.99):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
