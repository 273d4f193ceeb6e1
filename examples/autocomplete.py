"""IDE autocomplete over the public WebSocket (`/v1/stream`): a request per keystroke.

    python examples/autocomplete.py --url ws://127.0.0.1:8000/v1/stream [--file code.py] [--interval-ms 50]

Every keystroke (after a short debounce) sends a generate that replaces the previous
one (`replaces`: the proxy aborts the old request and admits the new one on the same
replica in one step, so at most one completion per editor runs there, and the growing
prefix is served from that replica's prefix cache). Completions are short
(`max_tokens`), end at the line's end (`stop: ["\\n"]`) and are greedy; with a model
whose tokenizer has FIM tokens the text after the cursor goes along (`prefix` +
`suffix`), otherwise the prefix alone is the prompt (`--fim auto` asks the proxy's
`/v1/models`).

Measured: keystroke -> suggestion (the keystroke whose request's completion arrives,
to its done), and the request's time to first token. `--file` types a file
character by character, in bursts of `--burst` keystrokes with a pause after each.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from time import perf_counter

import httpx

from edge_proxy.client import EdgeClient, EdgeError, Request


@dataclass
class Suggestion:
    prefix: str
    text: str
    t_key: float  # the keystroke it answers
    latency_ms: float  # keystroke -> done
    ttft_ms: float  # the proxy's: arrival -> first token
    cached_tokens: int
    prompt_tokens: int


class Autocomplete:
    def __init__(self, client: EdgeClient, *, debounce_ms: float = 20.0, max_tokens: int = 16, fim: bool = False,
                 stop: tuple[str, ...] = ("\n",), session: str | None = None):
        self.client = client
        self.debounce_s = debounce_ms / 1e3
        self.max_tokens, self.fim, self.stop, self.session = max_tokens, fim, list(stop), session
        self.current: Request | None = None  # the request of the latest keystroke sent
        self.requests: list[tuple[Request, float, str]] = []  # every request sent, its keystroke time, its prefix
        self.suggestions: list[Suggestion] = []
        self.shown = asyncio.Event()  # set whenever a suggestion arrives
        self._timer: asyncio.TimerHandle | None = None
        self._sending: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    def keystroke(self, prefix: str, suffix: str = "") -> None:
        """The buffer changed: text before and after the cursor. Sends after the debounce."""
        t = perf_counter()
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.debounce_s, lambda: self._spawn(self._send(prefix, suffix, t)))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, prefix: str, suffix: str, t_key: float) -> None:
        prompt = {"prefix": prefix, "suffix": suffix} if self.fim else {"prompt": prefix}
        req = await self.client.generate(**prompt, replaces=self.current, session=self.session,
                                         max_tokens=self.max_tokens, stop=self.stop, temperature=0.0)
        self.current = req
        self.requests.append((req, t_key, prefix))
        try:
            text, done = await req.result()
        except EdgeError as e:
            print(f"autocomplete: {e}", file=sys.stderr)
            return
        if done.finish_reason == "abort":
            return  # replaced by a later keystroke
        self.suggestions.append(Suggestion(prefix, text, t_key, (perf_counter() - t_key) * 1e3, done.timing.ttft_ms,
                                           done.usage.cached_tokens, done.usage.prompt_tokens))
        self.shown.set()

    async def settle(self) -> None:
        """Until the last keystroke's request was sent and has ended."""
        while self._timer is not None and self._timer.when() > asyncio.get_running_loop().time():
            await asyncio.sleep(self.debounce_s)
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def model_has_fim(http_url: str, api_key: str | None = None) -> bool:
    """What the proxy's `/v1/models` says of fill-in-the-middle (`edgechat.fim`)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(trust_env=False, timeout=10) as h:
        r = await h.get(http_url.rstrip("/") + "/v1/models", headers=headers)
        r.raise_for_status()
        return any(m.get("edgechat", {}).get("fim") for m in r.json()["data"])


async def type_text(ac: Autocomplete, text: str, start: int, keystrokes: int, interval_s: float) -> int:
    """Type `keystrokes` characters of `text` from `start`, one every `interval_s`; the new cursor."""
    cursor = start
    for _ in range(keystrokes):
        if cursor >= len(text):
            break
        cursor += 1
        ac.keystroke(text[:cursor], text[cursor:])
        await asyncio.sleep(interval_s)
    return cursor


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


SAMPLE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def main():
    for i in range(10):
        print(i, fibonacci(i))
'''


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8000/v1/stream")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--file", default="", help="the code to type (default: a small Python file)")
    ap.add_argument("--interval-ms", type=float, default=50.0, help="time between keystrokes")
    ap.add_argument("--debounce-ms", type=float, default=20.0)
    ap.add_argument("--burst", type=int, default=20, help="keystrokes per burst; a pause follows each")
    ap.add_argument("--pause-ms", type=float, default=600.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--fim", default="auto", choices=["auto", "on", "off"])
    a = ap.parse_args(argv)
    text = open(a.file).read() if a.file else SAMPLE
    http = a.url.replace("wss://", "https://").replace("ws://", "http://").rsplit("/v1/stream", 1)[0]
    fim = a.fim == "on" or (a.fim == "auto" and await model_has_fim(http, a.api_key))
    async with await EdgeClient.connect(a.url, api_key=a.api_key) as client:
        ac = Autocomplete(client, debounce_ms=a.debounce_ms, max_tokens=a.max_tokens, fim=fim)
        cursor = len(text) // 4
        while cursor < len(text):
            cursor = await type_text(ac, text, cursor, a.burst, a.interval_ms / 1e3)
            await ac.settle()
            if ac.suggestions:
                s = ac.suggestions[-1]
                print(f"...{s.prefix[-30:]!r} -> {s.text!r}  ({s.latency_ms:.0f} ms, {s.cached_tokens}/"
                      f"{s.prompt_tokens} prompt tokens cached)")
            await asyncio.sleep(a.pause_ms / 1e3)
        lat = [s.latency_ms for s in ac.suggestions]
        print(f"{len(ac.requests)} requests, {len(lat)} suggestions ({'FIM' if fim else 'prefix only'}); "
              f"keystroke -> suggestion p50 {percentile(lat, 0.5):.0f} ms, p99 {percentile(lat, 0.99):.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
