"""Reading the lock (lock/*.txt, pip-compile's requirements format with hashes).

A pin is one logical line: `name==version [; marker]` and its `--hash=sha256:...`
options, continued with backslashes; `#` lines (and pip-compile's `# via` notes) are
comments. Names are canonical (PEP 503), as pip-compile writes them.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "lock"


@dataclasses.dataclass(frozen=True)
class Pin:
    name: str
    version: str
    marker: str  # "" where none
    hashes: frozenset[str]

    def applies(self, env: dict[str, str] | None = None) -> bool:
        """Whether the marker holds here (or in `env`): a pin for another platform is skipped."""
        return not self.marker or Requirement(f"{self.name}; {self.marker}").marker.evaluate(env)


def read(path: Path) -> dict[str, Pin]:
    """name -> Pin of one lock file; every requirement must be `==` one version, with hashes."""
    pins: dict[str, Pin] = {}
    text = re.sub(r"\\\n", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        req_text, *hashes = line.split("--hash=")
        req = Requirement(req_text.strip())
        (spec,) = req.specifier  # exactly one
        assert spec.operator == "==", f"{path.name}: {req} is not pinned with =="
        assert hashes, f"{path.name}: {req} has no --hash"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{path.name}: {name} twice"
        pins[name] = Pin(name, spec.version, str(req.marker or ""), frozenset(h.strip() for h in hashes))
    return pins


def lock_files() -> dict[str, Path]:
    """'all', 'base' and each extra -> its file."""
    return {p.stem: p for p in sorted(LOCK.glob("*.txt"))}
