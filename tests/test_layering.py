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
    ("model", ["replica.config", "replica.presets", "replica.hf_checkpoint", "replica.gguf_file", "replica.fim",
               "replica.tokenizer", "replica.loader", "replica.model", "replica.quant", "replica.tp",
               "replica.cpu_model", "replica.plan", "replica.sampling", "replica.graphs", "replica.runner",
               "replica.worker", "replica"]),
    ("engine", ["replica.sequence", "replica.block_manager", "replica.scheduler", "replica.forks", "replica.grammar",
                "replica.validation", "replica.speculation", "replica.engine", "replica.offline", "speculative"]),
    ("replica processes", ["replica.containment", "replica.engine_process", "replica.engine_supervisor",
                           "replica.engine_client", "replica.frame_split", "replica.auth", "replica.openai_http",
                           "replica.api", "replica.__main__", "stub_replica"]),
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
