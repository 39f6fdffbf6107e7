"""The package's shape: no import circles between toolkit's modules (at module level or inside functions), and
toolkit/model reaches the backends only through their facades (toolkit/cpu/api.py, toolkit/gpu/api.py)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports() -> dict[str, set[str]]:
    """module -> the toolkit modules it imports anywhere in its file (a parent package and its own children aside)."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "toolkit").rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            out |= {n for n in names if n in files and n != mod}
        graph[mod] = {t for t in out if not (t.startswith(mod + ".") or mod.startswith(t + "."))}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert _cycles(_imports()) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_model_reaches_the_backends_through_their_facades():
    allowed = {"toolkit.cpu", "toolkit.gpu", "toolkit.cpu.api", "toolkit.gpu.api"}
    bad = {m: sorted(t for t in ts if t.startswith(("toolkit.cpu", "toolkit.gpu")) and t not in allowed)
           for m, ts in _imports().items() if m.startswith("toolkit.model")}
    assert {m: ts for m, ts in bad.items() if ts} == {}
