"""Imports point down the layering of docs/structure.md (DESIGN.md's "Layering"): every
import between the project's own modules, function-level ones included, goes to a module
of the same layer or a lower one. Import circles between files are checked by the
same walk (a circle inside one layer is still a circle)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module takes the layer of the longest prefix listed.
LAYERS = [
    ("contracts", ["wire"]),
    ("kernels", ["kernels"]),
    # replica/*.py at the top: torch-free, shared by both processes and the proxy
    ("model", ["replica", "replica.model"]),
    ("engine", ["replica.engine", "replica.validation", "speculative"]),
    ("replica processes", ["replica.engine.containment", "replica.engine.process", "replica.api",
                           "replica.__main__", "stub_replica"]),
    ("proxy", ["edge_proxy"]),
    ("regions, load tests, examples", ["regions", "loadtest", "examples"]),
    ("tools", ["speculative.train", "bench"]),
]
PACKAGES = ["wire", "kernels", "replica", "speculative", "stub_replica", "edge_proxy", "regions", "loadtest",
            "examples", "bench"]


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{module} is in no layer: place it in LAYERS"
    return rank


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(mods: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(importer, imported module of ours, line) for every import statement."""
    edges = []
    for m, path in mods.items():
        pkg = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - n.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in n.names] + [base]
            for t in names:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m and not t.startswith(m + "."):
                    edges.append((m, t, n.lineno))
                    break
    return edges


def test_every_module_has_a_layer():
    for m in modules():
        layer_of(m)


def test_imports_point_down():
    mods = modules()
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]}) at {mods[a].relative_to(ROOT)}:{line}"
              for a, b, line in imports(mods) if layer_of(b) > layer_of(a)]
    assert not upward, "imports pointing up the layering:\n" + "\n".join(sorted(set(upward)))


# What runs outside the engine process never imports torch or triton, at module level or
# inside a function, directly or through a module of ours: the proxy, regions, load tests,
# the examples, the replica's API process (replica/api/, replica/__main__.py) and the
# torch-free files at the top of replica/ that both processes and the proxy share.
TORCH_FREE = ["wire", "replica.api", "replica.__main__", "edge_proxy", "regions", "loadtest", "examples",
              "stub_replica"]
HEAVY = ("torch", "triton")


def torch_free(module: str, mods: dict[str, Path]) -> bool:
    top_of_replica = module.startswith("replica.") and module.count(".") == 1 and mods[module].name != "__init__.py"
    return top_of_replica or any(module == p or module.startswith(p + ".") for p in TORCH_FREE)


def heavy_imports(path: Path) -> list[tuple[str, int]]:
    out = []
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
            [n.module or ""] if isinstance(n, ast.ImportFrom) and not n.level else []
        out += [(name, n.lineno) for name in names if name.split(".")[0] in HEAVY]
    return out


def test_what_runs_outside_the_engine_process_never_imports_torch():
    mods = modules()
    edges: dict[str, list[str]] = {}
    for a, b, _ in imports(mods):
        edges.setdefault(a, []).append(b)
    bad = []
    for m in sorted(x for x in mods if torch_free(x, mods)):
        seen, todo, via = {m}, [m], {m: [m]}
        while todo:
            cur = todo.pop()
            bad += [f"{' -> '.join(via[cur])} imports {name} ({mods[cur].relative_to(ROOT)}:{line})"
                    for name, line in heavy_imports(mods[cur])]
            for nxt in edges.get(cur, []):
                if nxt not in seen:
                    seen.add(nxt)
                    via[nxt] = via[cur] + [nxt]
                    todo.append(nxt)
    assert not bad, "torch or triton reached from a torch-free module:\n" + "\n".join(sorted(set(bad)))
