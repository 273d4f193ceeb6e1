"""The launches running on this machine, so `python -m loadtest --topology` finds them.

`python -m regions up` (and so `make run`) holds `<run dir>/<port>.lock`, named after
its first region's proxy port, for as long as it lives: an flock taken before
anything starts (a second launch on the same port is refused at once, naming the
first). Beside it `<port>.json`, replaced whole (write, then rename) as the launch
moves on: its pid, topology file and state, and once ready the topology's URLs (the
same JSON `--targets FILE` writes). The kernel drops the lock when the launcher
exits, however it exits, so a `.json` whose lock nobody holds is stale and is
removed by whoever finds it; the empty `.lock` files stay.

Run dir: $EDGECHAT_RUN_DIR, else $XDG_CACHE_HOME/edgechat/running, else
~/.cache/edgechat/running.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path


def run_dir() -> Path:
    if os.environ.get("EDGECHAT_RUN_DIR"):
        return Path(os.environ["EDGECHAT_RUN_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgechat" / "running"


class Held(RuntimeError):
    """Another live launch holds this port's file; `info` is what it wrote."""

    def __init__(self, path: Path, info: dict):
        self.path, self.info = path, info
        super().__init__(f"{path} is held by pid {info.get('pid', '?')}")


class Registration:
    """This launch's files: `claim()` before starting, `ready(targets)` once serving, `release()` at the end."""

    def __init__(self, port: int, source: str, folder: Path | None = None):
        folder = folder or run_dir()
        self.path, self.lock_path = folder / f"{port}.json", folder / f"{port}.lock"
        self.port, self.source = port, source
        self._lock = None

    def claim(self) -> Registration:
        """Raises `Held` when a live launch has this port."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.lock_path, "a")  # noqa: SIM115 - held open (and locked) until release()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise Held(self.path, _read(self.path)) from None
        self._lock = f
        self._write({"state": "starting"})
        return self

    def ready(self, targets: dict) -> None:
        self._write({"state": "ready", **targets})

    def release(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self._lock.close()
            self._lock = None

    def _write(self, fields: dict) -> None:
        doc = {"pid": os.getpid(), "port": self.port, "source": self.source, **fields}
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(self.path)  # readers see the old file or the new one, never half of one


def _read(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def held(lock_path: Path) -> bool:
    """Whether a live launcher holds this lock file."""
    try:
        f = open(lock_path)  # noqa: SIM115
    except FileNotFoundError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def live(folder: Path | None = None) -> list[dict]:
    """What every live launch wrote (one still starting has "state": "starting"), by
    port, each with "file": its path; stale files (no launcher holds their lock) are removed."""
    folder = folder or run_dir()
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        if held(path.with_suffix(".lock")):
            info = _read(path)
            if info:
                out.append({**info, "file": str(path)})
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return out
