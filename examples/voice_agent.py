"""A turn-taking voice agent over the public WebSocket (`/v1/stream`).

    python examples/voice_agent.py --url ws://127.0.0.1:8000/v1/stream [--api-key KEY] [--words-per-s 3]

Each user turn starts a generate; the reply is spoken sentence by sentence (a sentence
is flushed to the speaker as soon as it ends, while the rest is still being
generated). When the user speaks while the agent is talking (barge-in), the running
turn is replaced in one step (`generate` with `replaces`): the proxy aborts it and
starts the new one on the same replica, whose prefix cache holds the conversation,
including the words of the reply that were actually spoken, which is all the
history keeps of it.

Speech is a text stand-in: `Speaker` "says" a sentence word by word at
`words_per_s`, printing it; `--espeak` also plays it with Debian's espeak-ng. The
user's turns come from `--script` (one per line; a line starting with `!` barges in
after the agent spoke `--barge-after-words` words) or from the built-in script.

Measured per turn: time to first sentence (the user's turn ends -> the first
sentence is ready to speak) and, after a barge-in, barge-in -> the new reply's
first token.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from time import perf_counter

from edge_proxy.client import EdgeClient, Request

SENTENCE_END = re.compile(r"[.!?](?=\s)|\n")


def split_sentences(buffer: str) -> tuple[list[str], str]:
    """Complete sentences at the front of `buffer` (ending at . ! ? before whitespace, or a
    newline), and what is left. Sentences keep their surrounding whitespace, so they
    concatenate back to the text."""
    out, start = [], 0
    for m in SENTENCE_END.finditer(buffer):
        out.append(buffer[start:m.end()])
        start = m.end()
    return out, buffer[start:]


class Speaker:
    """Text-to-speech stand-in: says sentences one after another, word by word, and knows
    how much of the reply it said (`spoken`, a prefix of the reply's text)."""

    def __init__(self, words_per_s: float = 3.0, out=None, espeak: bool = False):
        self.word_s = 1.0 / words_per_s
        self.out = out
        self.espeak = espeak and shutil.which("espeak-ng") is not None
        self.spoken = ""  # the reply's text up to the end of the last word said
        self.words = 0
        self.progress = asyncio.Event()  # set after every word

    async def say(self, sentence: str) -> None:
        if self.espeak:  # real audio, played while the words below keep time
            asyncio.get_running_loop().run_in_executor(None, lambda: subprocess.run(
                ["espeak-ng", sentence], capture_output=True, check=False))
        for m in re.finditer(r"\s*\S+", sentence):
            await asyncio.sleep(self.word_s)
            self.spoken += m.group()
            self.words += 1
            if self.out is not None:
                print(m.group(), end="", file=self.out, flush=True)
            self.progress.set()
            self.progress.clear()
        self.spoken += sentence[len(sentence.rstrip()):]  # the whitespace after the last word

    async def until_words(self, n: int) -> None:
        while self.words < n:
            await self.progress.wait()


@dataclass
class Turn:
    utterance: str
    request: Request
    speaker: Speaker
    t_start: float  # the user's turn ended (or the barge-in happened)
    barge_in: bool = False
    t_first_token: float = 0.0
    t_first_sentence: float = 0.0
    task: asyncio.Task | None = None
    sentences: list[str] = field(default_factory=list)
    first_token: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def time_to_first_sentence_ms(self) -> float | None:
        return (self.t_first_sentence - self.t_start) * 1e3 if self.t_first_sentence else None

    @property
    def barge_in_to_first_token_ms(self) -> float | None:
        return (self.t_first_token - self.t_start) * 1e3 if self.barge_in and self.t_first_token else None


class VoiceAgent:
    def __init__(self, client: EdgeClient, system: str = "You are a friendly voice assistant.", *,
                 words_per_s: float = 3.0, max_tokens: int = 200, temperature: float = 0.7,
                 session: str | None = None, out=None, espeak: bool = False):
        self.client = client
        self.history: list[dict] = [{"role": "system", "content": system}]
        self.words_per_s, self.max_tokens, self.temperature = words_per_s, max_tokens, temperature
        self.session, self.out, self.espeak = session, out, espeak
        self.turn: Turn | None = None  # the running one
        self.turns: list[Turn] = []

    async def say(self, utterance: str) -> Turn:
        """The user finished a turn while the agent is quiet: answer it."""
        return await self._start(utterance, barge_in=False)

    async def barge_in(self, utterance: str) -> Turn:
        """The user spoke over the agent: what was said of the reply stays in the history, the
        running turn is replaced by an answer to `utterance`."""
        return await self._start(utterance, barge_in=True)

    async def _start(self, utterance: str, barge_in: bool) -> Turn:
        t0 = perf_counter()
        old = self.turn
        if old is not None and not old.task.done():
            old.task.cancel()  # the speaker stops at the word it was on
            await asyncio.gather(old.task, return_exceptions=True)
            self._keep(old)
        self.history.append({"role": "user", "content": utterance})
        replaces = old.request if old is not None and not old.request.finished else None
        req = await self.client.generate(messages=list(self.history), session=self.session, replaces=replaces,
                                         max_tokens=self.max_tokens, temperature=self.temperature)
        turn = self.turn = Turn(utterance, req, Speaker(self.words_per_s, self.out, self.espeak), t0, barge_in)
        turn.task = asyncio.get_running_loop().create_task(self._speak(turn))
        self.turns.append(turn)
        return turn

    def _keep(self, turn: Turn) -> None:
        """The reply as far as it was spoken goes into the history (nothing if nothing was said)."""
        if turn.speaker.spoken.strip():
            self.history.append({"role": "assistant", "content": turn.speaker.spoken.rstrip()})

    async def _speak(self, turn: Turn) -> None:
        """Stream the reply; speak each sentence as soon as it is complete."""
        queue: asyncio.Queue = asyncio.Queue()
        voice = asyncio.get_running_loop().create_task(self._voice(turn, queue))
        try:
            buffer = ""
            async for text in turn.request:
                if not turn.t_first_token:
                    turn.t_first_token = perf_counter()
                    turn.first_token.set()
                ready, buffer = split_sentences(buffer + text)
                for s in ready:
                    queue.put_nowait(s)
            if buffer:
                queue.put_nowait(buffer)
            queue.put_nowait(None)
            await voice
            self._keep(turn)
        finally:
            voice.cancel()

    async def _voice(self, turn: Turn, queue: asyncio.Queue) -> None:
        while (s := await queue.get()) is not None:
            if not turn.t_first_sentence:
                turn.t_first_sentence = perf_counter()
            turn.sentences.append(s)
            await turn.speaker.say(s)

    async def wait(self) -> Turn:
        """Until the running turn was spoken to its end."""
        turn = self.turn
        await turn.task
        return turn


DEFAULT_SCRIPT = ["Hi! Can you tell me a story about a lighthouse keeper?",
                  "!Wait, make it about a dragon instead.",
                  "Thanks. What should I cook tonight?"]


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8000/v1/stream")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--script", default="", help="file of user turns, one per line; '!' first: a barge-in")
    ap.add_argument("--words-per-s", type=float, default=3.0, help="speaking rate of the stand-in voice")
    ap.add_argument("--barge-after-words", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--espeak", action="store_true", help="also speak through espeak-ng (Debian package)")
    a = ap.parse_args(argv)
    script = [x.rstrip("\n") for x in open(a.script)] if a.script else DEFAULT_SCRIPT
    async with await EdgeClient.connect(a.url, api_key=a.api_key) as client:
        agent = VoiceAgent(client, words_per_s=a.words_per_s, max_tokens=a.max_tokens, out=sys.stdout,
                           espeak=a.espeak)
        for line in filter(None, script):
            if line.startswith("!") and agent.turn is not None:
                await agent.turn.speaker.until_words(a.barge_after_words)
                print(f"\n[user, barging in] {line[1:]}\n[agent] ", end="", flush=True)
                await agent.barge_in(line[1:])
                continue
            if agent.turn is not None:
                await agent.wait()
            print(f"\n[user] {line.lstrip('!')}\n[agent] ", end="", flush=True)
            await agent.say(line.lstrip("!"))
        await agent.wait()
        print()
        for t in agent.turns:
            extra = f", barge-in to first token {t.barge_in_to_first_token_ms:.0f} ms" if t.barge_in else ""
            first = t.time_to_first_sentence_ms
            print(f"turn {t.utterance[:40]!r}: first sentence {first:.0f} ms{extra}" if first is not None
                  else f"turn {t.utterance[:40]!r}: no sentence{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
