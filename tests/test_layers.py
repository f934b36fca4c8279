"""The package's shape: imports run one way, down. The ground floor (config, rng, device, measure, rundir)
imports nothing of fastddpm above it; no two packages import each other, directly or around a cycle; no source
file grows past 600 lines. Read from the source with ast, every import counted (inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fastddpm"
GROUND = {"config", "rng", "device", "measure", "rundir"}
MAX_LINES = 600


def _package(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports() -> dict[str, set[str]]:
    """{package: the fastddpm packages its files import} (the front door, fastddpm/__init__.py, left out)."""
    packages = {_package(p) for p in SRC.rglob("*.py")} - {"__init__", "__main__"}
    edges: dict[str, set[str]] = {p: set() for p in packages}
    for path in SRC.rglob("*.py"):
        me = _package(path)
        if me in ("__init__", "__main__"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if isinstance(node, ast.ImportFrom) and node.module == "fastddpm":
                names = [f"fastddpm.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "fastddpm" and len(parts) > 1 and parts[1] in packages and parts[1] != me:
                    edges[me].add(parts[1])
    return edges


def test_no_package_imports_one_that_imports_it_back():
    edges = _imports()

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            for nxt in edges[todo.pop()]:
                if nxt == b:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    cycles = sorted(f"{a} -> {b} -> ... -> {a}" for a in edges for b in edges[a] if reaches(b, a))
    assert not cycles, "import cycles between packages:\n" + "\n".join(cycles)


def test_the_ground_floor_imports_only_the_ground_floor():
    edges = _imports()
    assert {"trainer", "sampling", "eval", "bench", "doctor", "api", "cli"} <= set(edges)  # the graph was read
    upward = {p: sorted(edges[p] - GROUND) for p in GROUND if edges[p] - GROUND}
    assert not upward, f"ground-floor packages import packages above them: {upward}"
    assert edges["config"] == set(), "the config imports no other part of fastddpm"


def test_no_source_file_is_over_600_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concern: {long}"
