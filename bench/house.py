"""The house in figures: lines per package, the largest files, C++ held in Python
strings, function-level imports, imports pointing up the layering, import circles
and `duplicates` pairs, for this tree or another checkout (before/after a redesign).

    python bench/house.py                          # this checkout
    python bench/house.py --tree /tmp/before --layering /tmp/layering_flat.py

--layering: a Python file defining LAYERS and PACKAGES as tests/test_layering.py does
(default: the measured tree's own tests/test_layering.py); an older tree without one
is measured with a layering written for its file names. Modules no layer places are
counted, not guessed. Prints Markdown tables; reads files only, runs nothing of the tree.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["wire", "kernels", "replica", "speculative", "stub_replica", "edge_proxy", "regions", "loadtest",
            "examples", "bench", "tests"]
CPP = re.compile(r"#include|torch::|at::Tensor|\bvoid\s+\w+\(")


def py_files(tree: Path, pkg: str) -> list[Path]:
    return sorted(p for p in (tree / pkg).rglob("*.py") if ".venv" not in p.parts)


def lines(p: Path) -> int:
    return len(p.read_text(errors="replace").splitlines())


def cpp_in_strings(p: Path) -> int:
    """Lines of C++ source held in the file's string constants."""
    n = 0
    for node in ast.walk(ast.parse(p.read_text(), str(p))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and CPP.search(node.value):
            n += node.value.count("\n") + 1
    return n


def function_level_imports(p: Path, ours: tuple[str, ...]) -> int:
    tree = ast.parse(p.read_text(), str(p))
    n = 0
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    n += any(a.name.split(".")[0] in ours for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    n += bool(node.level) or (node.module or "").split(".")[0] in ours
    return n


def layering(tree: Path, path: Path):
    spec = importlib.util.spec_from_file_location("layering_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.ROOT = tree  # its walk reads the tree it is pointed at
    return mod


def upward(tree: Path, lay) -> tuple[list[str], int]:
    mods = lay.modules()
    unplaced = 0

    def rank(m: str):
        nonlocal unplaced
        try:
            return lay.layer_of(m)
        except AssertionError:
            unplaced += 1
            return None

    ranks = {m: rank(m) for m in mods}
    up = sorted({f"{a} -> {b}" for a, b, _ in lay.imports(mods)
                 if ranks[a] is not None and ranks[b] is not None and ranks[b] > ranks[a]})
    return up, unplaced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=ROOT)
    ap.add_argument("--layering", type=Path, default=None)
    ap.add_argument("--largest", type=int, default=8)
    args = ap.parse_args()
    tree = args.tree.resolve()
    rev = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h %ad", "--date=short"],
                         capture_output=True, text=True).stdout.strip()
    print(f"tree: {tree} ({rev})\n")
    ours = tuple(PACKAGES)
    print("| package | files | lines | C++ lines in strings | function-level imports of ours |")
    print("|---|---:|---:|---:|---:|")
    every = []
    for pkg in PACKAGES:
        files = [f for f in py_files(tree, pkg) if f.resolve() != Path(__file__).resolve()]
        every += files
        print(f"| {pkg}/ | {len(files)} | {sum(map(lines, files))} | {sum(map(cpp_in_strings, files))} "
              f"| {sum(function_level_imports(f, ours) for f in files)} |")
    native = sorted(p for p in (tree / "kernels").rglob("*") if p.suffix in (".cpp", ".h", ".cc", ".hpp"))
    print(f"| native (.cpp/.h files) | {len(native)} | {sum(map(lines, native))} | | |")
    code = [p for p in every if "tests" not in p.relative_to(tree).parts[:1]]
    print(f"\nlargest files (tests left out): " + ", ".join(
        f"{p.relative_to(tree)} {n}" for n, p in sorted(((lines(p), p) for p in code), reverse=True)[:args.largest]))
    lay_path = args.layering or tree / "tests" / "test_layering.py"
    if lay_path.is_file():
        up, unplaced = upward(tree, layering(tree, lay_path))
        print(f"\nupward imports ({lay_path.name}): {len(up)}" + (f", {unplaced} modules placed in no layer"
                                                                  if unplaced else ""))
        for u in up:
            print(f"  {u}")
    cycles = subprocess.run([sys.executable, str(ROOT.parent / "shared" / "tools" / "import_cycles.py"), str(tree)],
                            capture_output=True, text=True).stdout.strip()
    print(f"import circles (shared/tools/import_cycles.py): {len(cycles.splitlines()) if cycles else 0}")
    dup = subprocess.run(["duplicates", "--repo", str(tree), "--seconds", "120"], capture_output=True, text=True)
    print(f"duplicates: {dup.stdout.splitlines()[0] if dup.stdout else dup.stderr.strip()}")


if __name__ == "__main__":
    main()
