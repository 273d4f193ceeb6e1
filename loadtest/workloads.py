"""Workloads: what one simulated user does in one session.

Each workload is a function `session(user, rng, corpus, scale)` that issues
requests through `user` (a `driver.User`: `request`, `think`, `stopped`). Prompts
come from the files in loadtest/data; every random choice comes from `rng`, which
the driver seeds per session from (run seed, session number), so a run is
repeatable.

    chat          2-5 turns, think time between turns, history grows with every reply
    shared-prefix many users under the same long system prompts (prefix cache reuse)
    voice         short turns with a first-token deadline; barge-in cancels a reply mid-stream
    autocomplete  keystroke bursts; each keystroke's request replaces the previous one (`replaces`:
                  one step, same replica), the prefix grows and hits the cache; stop at the line's end
    random        random input and output lengths (words from the corpus)

`scale` multiplies every think time and pause (0 for back-to-back tests).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).with_name("data")


@dataclass(frozen=True)
class Corpus:
    system_prompts: tuple[str, ...]
    openers: tuple[str, ...]
    followups: tuple[str, ...]
    shared_questions: tuple[str, ...]
    utterances: tuple[str, ...]
    snippets: tuple[str, ...]
    words: tuple[str, ...]


def _lines(path: Path) -> tuple[str, ...]:
    return tuple(x.strip() for x in path.read_text().splitlines() if x.strip() and not x.startswith("#"))


def _blocks(path: Path) -> tuple[str, ...]:
    text = "\n".join(x for x in path.read_text().splitlines() if not x.startswith("#"))
    return tuple(b.strip("\n") for b in text.split("\n---\n") if b.strip())


def load_corpus(data: Path = DATA) -> Corpus:
    c = Corpus(_blocks(data / "system_prompts.txt"), _lines(data / "chat_openers.txt"),
               _lines(data / "chat_followups.txt"), _lines(data / "shared_questions.txt"),
               _lines(data / "voice_utterances.txt"), _blocks(data / "code_snippets.txt"), ())
    words = " ".join(c.system_prompts + c.openers + c.utterances).split()
    c = Corpus(*[getattr(c, f) for f in ("system_prompts", "openers", "followups", "shared_questions",
                                          "utterances", "snippets")], tuple(words))
    for name in ("system_prompts", "openers", "followups", "shared_questions", "utterances", "snippets"):
        if not getattr(c, name):
            raise ValueError(f"prompt file for {name} in {data} is empty")
    return c


@dataclass
class Knobs:
    """Command-line shaped parameters of the workloads."""

    input_words: tuple[int, int] = (20, 200)  # random workload
    output_tokens: tuple[int, int] = (16, 128)
    chat_max_tokens: tuple[int, int] = (32, 96)
    voice_deadline_ms: float = 1500.0
    voice_barge_in: float = 0.3  # probability a reply is interrupted
    autocomplete_deadline_ms: float = 1000.0
    scale: float = 1.0  # think times and pauses
    nonce: str = ""  # leading line for every prompt (a fresh prefix-cache namespace per run)


def _sys(k: Knobs, text: str) -> str:
    return f"[{k.nonce}]\n{text}" if k.nonce else text


async def chat(user, rng: random.Random, c: Corpus, k: Knobs) -> None:
    history = [{"role": "system", "content": _sys(k, "You are a helpful, concise assistant.")},
               {"role": "user", "content": rng.choice(c.openers)}]
    for turn in range(rng.randint(2, 5)):
        if turn:
            if not await user.think(rng.expovariate(1 / 3.0) * k.scale):
                return
            history.append({"role": "user", "content": rng.choice(c.followups)})
        call = await user.request(messages=list(history), max_tokens=rng.randint(*k.chat_max_tokens),
                                  temperature=0.7, seed=rng.getrandbits(31))
        if call is None or call.error:
            return
        history.append({"role": "assistant", "content": call.text})


async def shared_prefix(user, rng: random.Random, c: Corpus, k: Knobs) -> None:
    system = _sys(k, rng.choice(c.system_prompts))
    history = [{"role": "system", "content": system}, {"role": "user", "content": rng.choice(c.shared_questions)}]
    for turn in range(rng.randint(1, 2)):
        if turn:
            if not await user.think(rng.expovariate(1 / 2.0) * k.scale):
                return
            history.append({"role": "user", "content": rng.choice(c.followups)})
        call = await user.request(messages=list(history), max_tokens=rng.randint(24, 64), temperature=0.7,
                                  seed=rng.getrandbits(31))
        if call is None or call.error:
            return
        history.append({"role": "assistant", "content": call.text})


async def voice(user, rng: random.Random, c: Corpus, k: Knobs) -> None:
    history = [{"role": "system", "content": _sys(k, "You are a voice assistant. Answer in one short sentence.")}]
    for turn in range(rng.randint(2, 4)):
        if turn and not await user.think(rng.expovariate(1 / 1.0) * k.scale):
            return
        history.append({"role": "user", "content": rng.choice(c.utterances)})
        barge = rng.random() < k.voice_barge_in
        after = rng.randint(2, 8)
        call = await user.request(messages=history[-7:], max_tokens=48, temperature=0.7, seed=rng.getrandbits(31),
                                  deadline_ms=k.voice_deadline_ms, cancel_after_tokens=after if barge else None)
        if call is None or (call.error and not call.t_cancel):
            return
        history.append({"role": "assistant", "content": call.text})


async def autocomplete(user, rng: random.Random, c: Corpus, k: Knobs) -> None:
    code = rng.choice(c.snippets)
    cursor = rng.randint(len(code) // 5, len(code) // 2)
    prev = None
    for _ in range(rng.randint(2, 4)):  # bursts
        for _ in range(rng.randint(3, 8)):  # keystrokes, ~8 per second
            cursor = min(cursor + rng.randint(1, 3), len(code))
            # The new keystroke's completion replaces the previous one (examples/autocomplete.py's pattern).
            prev = await user.start(prompt=(f"# {k.nonce}\n" if k.nonce else "") + code[:cursor], max_tokens=16,
                                    temperature=0.0, stop=["\n"], deadline_ms=k.autocomplete_deadline_ms,
                                    replaces=prev)
            if prev is None:
                return
            if not await user.think(rng.expovariate(1 / 0.12) * k.scale):
                break
        if prev is not None:
            await user.finish(prev)  # the burst's last completion runs to the end
            prev = None
        if not await user.think(rng.uniform(0.5, 2.0) * k.scale):
            return


async def random_lengths(user, rng: random.Random, c: Corpus, k: Knobs) -> None:
    n = rng.randint(*k.input_words)
    start = rng.randrange(len(c.words))
    words = [c.words[(start + i) % len(c.words)] for i in range(n)]
    await user.request(messages=[{"role": "user", "content": _sys(k, " ".join(words))}],
                       max_tokens=rng.randint(*k.output_tokens), temperature=1.0, seed=rng.getrandbits(31))


WORKLOADS = {"chat": chat, "shared-prefix": shared_prefix, "voice": voice, "autocomplete": autocomplete,
             "random": random_lengths}


def parse_mix(spec: str) -> dict[str, float]:
    """"chat,voice" (equal weights) or "chat=3,voice=1" -> normalized weights."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, w = part.partition("=")
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        try:
            out[name] = float(w) if w else 1.0
        except ValueError:
            raise ValueError(f"workload weight must be a number: {part!r}") from None
        if out[name] <= 0:
            raise ValueError(f"workload weight must be > 0: {part!r}")
    if not out:
        raise ValueError("no workload given")
    total = sum(out.values())
    return {n: w / total for n, w in out.items()}
