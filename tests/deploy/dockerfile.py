"""A small reader for deploy/Dockerfile: stages and their instructions, enough for the tests."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


@dataclass
class Stage:
    name: str
    parent: str
    steps: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest of the line)

    def all(self, instruction: str) -> list[str]:
        return [rest for ins, rest in self.steps if ins == instruction]

    def exec_form(self, instruction: str) -> list[str]:
        """The JSON (exec) form of the stage's last `instruction` (ENTRYPOINT, CMD)."""
        return json.loads(self.all(instruction)[-1])


def stages(path: Path = DOCKERFILE) -> dict[str, Stage]:
    lines, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        lines.append(buf + line)
        buf = ""
    out: dict[str, Stage] = {}
    cur: Stage | None = None
    for line in lines:
        ins, _, rest = line.partition(" ")
        ins = ins.upper()
        if ins == "FROM":
            words = shlex.split(rest)
            cur = Stage(words[2] if len(words) > 2 else words[0], words[0])
            out[cur.name] = cur
        elif cur is not None:
            cur.steps.append((ins, rest.strip()))
    return out


def inherited(all_stages: dict[str, Stage], name: str, instruction: str) -> str:
    """The last `instruction` that applies to stage `name` (its own or one it builds on)."""
    return next(s.all(instruction)[-1] for s in lineage(all_stages, name) if s.all(instruction))


def lineage(all_stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it builds on, nearest first."""
    chain = []
    while name in all_stages:
        chain.append(all_stages[name])
        name = all_stages[name].parent
    return chain
