"""A replica's start-up stages, one line each on stderr, for a person and for the launcher.

    stage: building kernels ...           the stage has run for SLOW_S and is still running
    stage: building kernels 41.2 s        it ended after 41.2 s
    stage: loading weights 1.3 s
    stage: building engine 3.6 s
    stage: warming up 0.0 s
    stage: ready 48.9 s                   /healthz answers 200 from now on; seconds since the replica started

The engine process says kernels, weights, engine and warm-up (again after each engine
restart); the API process says ready, once, when it serves. A line is one write, so
lines of the two processes never interleave. `python -m regions up` reads them from
each replica's log (`parse`) and shows them per replica. Torch-free: the launcher
imports this file.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from time import perf_counter

PREFIX = "stage: "
SLOW_S = 2.0  # a stage running this long gets a "..." line, so a slow start is never silent
_LINE = re.compile(r"^stage: (?P<name>[a-z][a-z -]*?)(?: (?P<seconds>\d+(?:\.\d+)?) s| \.\.\.)(?P<note>.*)$")


def line(name: str, seconds: float | None = None, note: str = "") -> str:
    """The line for `name` ended after `seconds`, or still running (None)."""
    assert _LINE.match(PREFIX + name + " ..."), f"stage names are lowercase words: {name!r}"
    return f"{PREFIX}{name} {'...' if seconds is None else f'{seconds:.1f} s'}{note}"


def parse(text: str) -> tuple[str, float | None, str] | None:
    """(name, seconds or None while running, note) of a stage line, or None for any other line."""
    m = _LINE.match(text.rstrip("\r\n"))
    if m is None:
        return None
    return m["name"], None if m["seconds"] is None else float(m["seconds"]), m["note"]


def say(name: str, seconds: float | None = None, note: str = "", out=None) -> None:
    out = out if out is not None else sys.stderr
    out.write(line(name, seconds, note) + "\n")
    out.flush()


class Stages:
    """Times stages: `with stages.stage("loading weights"): ...` says the line when it ends
    (not when it raises), and a "..." line first if it outlasts `slow_s`."""

    def __init__(self, out=None, slow_s: float = SLOW_S):
        self.out, self.slow_s = out, slow_s

    @contextlib.contextmanager
    def stage(self, name: str, slow_note: str = ""):
        t0 = perf_counter()
        lock = threading.Lock()
        ended = False

        def slow() -> None:
            with lock:
                if not ended:
                    say(name, None, slow_note, self.out)

        timer = threading.Timer(self.slow_s, slow)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            with lock:  # the "..." line, if any, is out before the end line
                ended = True
            timer.cancel()
        say(name, perf_counter() - t0, out=self.out)
