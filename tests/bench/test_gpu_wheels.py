"""bench/gpu_wheels.txt carries everything the GPU machine's image lacks.

The GPU machine cannot fetch anything: each third-party distribution that `wire`,
`kernels`, `replica` (API and engine processes), `speculative`, `edge_proxy` and
bench/gpu_service.py (the official `openai` SDK client) import, anywhere in a module
(function-level imports too), and each requirement of the pyproject's dependencies and
`replica` extra, must be in the image (bench/gpu_image.py) or in the wheel list; and the
wheel list's own packages bring their non-extra Requires-Dist, followed recursively
through the list. First-party imports (edge_proxy.select from edge_proxy/client.py,
bench.peers and tests.replica.server from bench/gpu_service.py) are followed into
their modules. Imports are mapped to distributions through the files .venv's
distributions installed, so a namespace package (opentelemetry.*) names the one
distribution that holds the imported module.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from importlib.metadata import distribution, distributions, packages_distributions
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from bench.gpu_image import IMAGE_PACKAGES, IMAGE_VERSIONS, PYTHON
from tests.lockfile import LOCK, read

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "bench" / "gpu_wheels.txt"
SCANNED = ["wire", "kernels", "replica", "speculative", "edge_proxy"]
ENTRY_POINTS = ["bench/gpu_service.py"]  # the GPU run's client: the official openai SDK

# Guarded imports (inside `try: ... except ImportError`) that the GPU run may go without,
# by module prefix. Only a guarded import can be excused here; an unguarded one always counts.
OPTIONAL = {
    # edge_proxy/tracing.py: spans to an OTLP collector only when OTEL_EXPORTER_OTLP_ENDPOINT is
    # set (the `otlp` extra); the GPU run exports no traces
    "opentelemetry.exporter",
}

# Requires-Dist markers are evaluated for the GPU machine's interpreter and platform.
TARGET_ENV = {**default_environment(), "python_version": ".".join(PYTHON.split(".")[:2]),
              "python_full_version": PYTHON, "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def read_wheel_list(text: str) -> list[str]:
    """The listed names, in order; '#' comments and blank lines skipped. Versions are the lock's."""
    names = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", line), \
            f"bench/gpu_wheels.txt: {line!r} is not a name (its version is the lock's)"
        name = canonicalize_name(line)
        assert name not in names, f"bench/gpu_wheels.txt lists {name} twice"
        names.append(name)
    return names


# -- imports -------------------------------------------------------------------------------


def _first_party(top: str) -> bool:
    return top not in (".venv", ".git") and ((ROOT / top).is_dir() or (ROOT / f"{top}.py").is_file())


def _module_files(module: str) -> list[Path]:
    """The first-party files an import of `module` executes (its packages' __init__ too)."""
    parts, out = module.split("."), []
    for i in range(1, len(parts) + 1):
        base = ROOT.joinpath(*parts[:i])
        for f in (base / "__init__.py", base.with_suffix(".py")):
            if f.is_file():
                out.append(f)
    return out


def _guarded(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside a `try` that catches ImportError."""
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = set()
        for h in node.handlers:
            types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
            caught |= {getattr(t, "id", getattr(t, "attr", None)) for t in types}
        if caught & {"ImportError", "ModuleNotFoundError"}:
            out |= {id(sub) for stmt in node.body for sub in ast.walk(stmt)
                    if isinstance(sub, (ast.Import, ast.ImportFrom))}
    return out


@functools.cache
def third_party_imports() -> dict[str, list[str]]:
    """Every third-party module imported by the scanned code (and the first-party modules it
    imports): module -> the places ("path:line", "(guarded)" appended) that import it."""
    queue = [f for pkg in SCANNED for f in sorted((ROOT / pkg).rglob("*.py"))] + [ROOT / e for e in ENTRY_POINTS]
    seen: set[Path] = set()
    found: dict[str, list[str]] = {}
    stdlib = sys.stdlib_module_names
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        guarded = _guarded(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from pkg import sub` may import the submodule pkg.sub: resolve the longest
                modules = [f"{node.module}.{a.name}" for a in node.names if a.name != "*"] or [node.module]
            else:
                continue  # relative imports stay inside their (scanned) package
            where = f"{path.relative_to(ROOT)}:{node.lineno}" + (" (guarded)" if id(node) in guarded else "")
            for module in modules:
                top = module.split(".")[0]
                if top in stdlib or top == "__future__":
                    continue
                if _first_party(top):
                    queue += _module_files(module)
                else:
                    found.setdefault(module, []).append(where)
    return found


@functools.cache
def _module_owners() -> dict[str, set[str]]:
    """Module name -> the .venv distributions whose files define it (package __init__ or module file)."""
    owners: dict[str, set[str]] = {}
    for dist in distributions():
        name = canonicalize_name(dist.metadata["Name"])
        for f in dist.files or ():
            parts = f.parts
            if not parts or parts[0].endswith((".dist-info", ".data")) or ".." in parts:
                continue
            if parts[-1] == "__init__.py":
                mod = ".".join(parts[:-1])
            elif parts[-1].endswith((".py", ".so", ".pyd")):
                mod = ".".join((*parts[:-1], parts[-1].split(".")[0]))
            else:
                continue
            owners.setdefault(mod, set()).add(name)
    return owners


def owners(module: str) -> set[str]:
    """The distributions that provide `module`: the longest prefix with a defining file,
    else (a namespace package alone) every distribution under that top-level name."""
    parts = module.split(".")
    table = _module_owners()
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in table:
            return table[".".join(parts[:i])]
    return {canonicalize_name(d) for d in packages_distributions().get(parts[0], [])}


# -- requirements ----------------------------------------------------------------------------


def pyproject_requirements() -> list[tuple[Requirement, str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [(r, "pyproject dependencies") for r in project["dependencies"]]
    reqs += [(r, "pyproject extra 'replica'") for r in project["optional-dependencies"]["replica"]]
    return [(Requirement(r), why) for r, why in reqs]


def problems(pins: dict[str, str]) -> list[str]:
    """What the GPU machine would lack with the image plus `pins` (name -> version)."""
    out = []
    needed: list[tuple[Requirement | None, str, str]] = []  # (requirement or None, distribution, why)
    for module, places in sorted(third_party_imports().items()):
        dists = owners(module)
        if not dists:
            if not all(p.endswith("(guarded)") for p in places):
                out.append(f"import {module} ({places[0]}): no installed distribution provides it")
            continue
        unguarded = [p for p in places if not p.endswith("(guarded)")]
        if not unguarded and any(module == o or module.startswith(o + ".") for o in OPTIONAL):
            continue
        for d in sorted(dists):
            needed.append((None, d, f"import {module} ({(unguarded or places)[0]})"))
    for req, why in pyproject_requirements():
        if req.marker is None or req.marker.evaluate(TARGET_ENV):
            needed.append((req, canonicalize_name(req.name), why))
    seen = set()
    while needed:
        req, name, why = needed.pop()
        if name in pins:
            if req is not None and not req.specifier.contains(pins[name], prereleases=True):
                out.append(f"{why} needs {req}, the wheel list pins {name}=={pins[name]}")
            if name in seen:
                continue
            seen.add(name)
            for r in distribution(name).requires or ():  # .venv holds the pinned version (test_pins_match_venv)
                r = Requirement(r)
                if r.marker is None or r.marker.evaluate(TARGET_ENV):  # extras evaluate to False: skipped
                    needed.append((r, canonicalize_name(r.name), f"{name}=={pins[name]} (Requires-Dist)"))
        elif name in IMAGE_PACKAGES:
            known = IMAGE_VERSIONS.get(name)
            if req is not None and known and not req.specifier.contains(Version(known), prereleases=True):
                out.append(f"{why} needs {req}, the image has {name} {known}: carry a wheel")
        else:
            out.append(f"{why} needs {name}: neither in the image (bench/gpu_image.py) nor in bench/gpu_wheels.txt")
    return sorted(set(out))


# -- tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pins() -> dict[str, str]:
    """name -> the lock's version, for each listed name (bash bench/gpu_wheels.sh fetches these)."""
    locked = read(LOCK / "all.txt")
    names = read_wheel_list(WHEELS.read_text())
    missing = [n for n in names if n not in locked]
    assert not missing, f"bench/gpu_wheels.txt names packages the lock does not pin: {missing}"
    return {n: locked[n].version for n in names}


def test_the_scan_sees_the_imports_that_matter():
    """The walk reaches function-level and first-party-followed imports (else the check below is vacuous)."""
    found = third_party_imports()
    assert "llguidance" in found and "msgspec" in found and "torch" in found
    assert any(m.startswith("openai") for m in found)  # bench/gpu_service.py, inside a function
    assert "dns.resolver" in found or any(m.startswith("dns.") for m in found)  # edge_proxy/discovery.py
    assert any("edge_proxy/select.py" in p for places in found.values() for p in places)  # via edge_proxy/client.py
    assert owners("opentelemetry.sdk.trace") == {"opentelemetry-sdk"}
    assert owners("dns.asyncresolver") == {"dnspython"}


def test_pins_match_venv(pins):
    """The lock's versions of the listed wheels are what .venv runs (the Requires-Dist followed
    are that version's; tests/test_lock.py compares the whole lock with .venv)."""
    for name, version in pins.items():
        assert distribution(name).version == version, f"{name}: .venv has {distribution(name).version}, lock {version}"


def test_the_list_holds_names_not_versions():
    """A version written in the list would be a second pin beside the lock's."""
    with pytest.raises(AssertionError, match="is not a name"):
        read_wheel_list("msgspec==0.22.0\n")


def test_image_plus_wheels_cover_every_import_and_requirement(pins):
    assert problems(pins) == []


def test_each_carried_wheel_is_needed(pins):
    """Dropping any wheel of a package the image lacks is noticed, llguidance first
    (wire/structured.py and replica/engine/grammar.py import it)."""
    assert "llguidance" in pins
    missing = [n for n in pins if n not in IMAGE_PACKAGES]
    for name in ["llguidance"] + missing:
        found = problems({k: v for k, v in pins.items() if k != name})
        assert any(f"needs {name}:" in p or f" {name} " in p for p in found), f"without {name}: {found}"


def test_a_version_carry_is_of_an_image_package(pins):
    """Packages the image has are listed only to carry another version (bench/gpu_wheels.txt says why)."""
    lines = WHEELS.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() and not line.startswith("#") and canonicalize_name(line.strip()) in IMAGE_PACKAGES:
            assert i > 0 and lines[i - 1].startswith("#"), f"{line}: in the image already; say why it is carried"


def test_unguarded_imports_are_never_excused(pins):
    """A required import cannot hide behind OPTIONAL: only guarded ones are skipped."""
    found = third_party_imports()
    for module, places in found.items():
        if any(module == o or module.startswith(o + ".") for o in OPTIONAL):
            assert all(p.endswith("(guarded)") for p in places), (module, places)
