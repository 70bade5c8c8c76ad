"""The import house of ``teamrl/``, computed from every import statement (those inside functions and under
``TYPE_CHECKING`` too): no import circle between modules, no private name (``_x``) imported from another module,
and no lower layer importing a higher one (docs/architecture.md's order)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# docs/architecture.md, lowest first: a module may import its own layer and those below it
LAYERS = ("core", "losses", "policies", "rollout", "sandbox", "tasks", "workflows", "algorithms", "trainer", "api",
          "cli")


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "teamrl").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Module -> the teamrl modules it imports; and every (importer, module, name) of a private name."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package of this module
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                if not base.startswith("teamrl"):
                    continue
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    if target in modules and target != name:
                        edges[name].add(target)
                    if alias.name.startswith("_") and not alias.name.startswith("__") and target == base:
                        private.append((name, base, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.name != name:
                        edges[name].add(alias.name)
    return edges, private


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _layer(module: str) -> int | None:
    part = module.split(".")[1] if module.count(".") else ""
    return LAYERS.index(part) if part in LAYERS else None


def test_no_import_circle_and_no_private_name_imported_across_modules():
    edges, private = import_graph()
    # a package's __init__ that imports its own modules to register them, imported back by one of them, is not
    # a circle between concepts: only circles among plain modules count
    plain = {m: {t for t in ts if not (t == m.rsplit(".", 1)[0])} for m, ts in edges.items()}
    found = [c for c in circles(plain)]
    assert found == [], f"import circles: {found}"
    assert private == [], f"private names imported from another module: {private}"


def test_no_lower_layer_imports_a_higher_one():
    edges, _ = import_graph()
    up = sorted((m, t) for m, ts in edges.items() for t in ts
                if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m))
    assert up == [], f"imports that run up the layers ({' < '.join(LAYERS)}): {up}"


def test_the_graph_sees_a_circle_and_a_private_import():
    """The checks above can fail: a made-up pair of modules importing each other is a circle."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": set()}) == []
