"""The suite's layout: test helpers live in helper modules or conftest.py, never in a
`test_` module another module imports (pytest would collect the imported tests and
fixtures a second time, and a helper's users would depend on a test file's imports).
An AST walk over tests/**/*.py finds every import, at module level or inside a
function, that names a `test_` module of the suite or a `test_` function from it."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _dotted(path: Path) -> str:
    """tests/replica/engine/test_engine.py -> tests.replica.test_engine."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _test_modules() -> tuple[set[str], set[str]]:
    """The suite's test modules: by dotted name, and by file stem (the name they are
    imported by from a folder without __init__.py, which pytest puts on sys.path)."""
    files = list(TESTS.rglob("test_*.py"))
    return {_dotted(p) for p in files}, {p.stem for p in files}


def _is_test_module(name: str, dotted: set[str], stems: set[str]) -> bool:
    return name in dotted or name.split(".")[0] in stems


def imports_of_tests(path: Path, source: str, dotted: set[str], stems: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every import in `source` (the file at `path`) of a test module or a test function."""
    package = _dotted(path).rsplit(".", 1)[0].split(".")
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _is_test_module(a.name, dotted, stems)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .test_x import y / from . import test_x
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if _is_test_module(module, dotted, stems):
                found.append((node.lineno, module))
                continue
            ours = module == "tests" or module.startswith("tests.") or node.level > 0
            for a in node.names:
                if _is_test_module(f"{module}.{a.name}", dotted, stems) or (ours and a.name.startswith("test_")):
                    found.append((node.lineno, f"{module}.{a.name}"))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__") and _is_test_module(node.args[0].value, dotted, stems):
                found.append((node.lineno, node.args[0].value))
    return found


def test_no_module_imports_from_a_test_module():
    """Invariant: no file under tests/ imports a `test_` module (or a test from one);
    shared helpers live in helper modules or conftest.py."""
    dotted, stems = _test_modules()
    bad = [f"{path.relative_to(ROOT)}:{line}: imports {what}"
           for path in sorted(TESTS.rglob("*.py"))
           for line, what in imports_of_tests(path, path.read_text(), dotted, stems)]
    assert not bad, "helpers imported from test modules (move them to a helper module or conftest.py):\n" + \
        "\n".join(bad)


def test_the_walk_finds_every_form_of_import():
    """Invariant: the check above is not vacuous: each way of importing from a test
    module is found, and helper-module imports are not."""
    dotted = {"tests.replica.test_engine", "tests.edge_proxy.test_server"}
    stems = {"test_engine", "test_server"}
    here = TESTS / "replica" / "test_overlap.py"
    cases = {
        "from tests.replica.test_engine import make_engine": True,
        "import tests.replica.test_engine": True,
        "from tests.replica import test_engine as e": True,
        "from .test_engine import make_engine": True,
        "from . import test_engine": True,
        "from test_server import free_port": True,  # a folder without __init__.py, on sys.path
        "def f():\n    from tests.replica.test_engine import run": True,  # imported inside a function
        "import importlib\nimportlib.import_module('tests.replica.test_engine')": True,
        "from tests.replica.engines import test_helper": True,  # a test function, wherever it lives
        "from tests.replica.engines import make_engine, prompts": False,
        "from tests.replica.server import free_port": False,
        "from conftest import proxy_for, stubs": False,
        "import pytest\nfrom torch.testing import assert_close": False,
    }
    for source, offends in cases.items():
        assert bool(imports_of_tests(here, source, dotted, stems)) == offends, source
