"""The layers of docs/architecture.md: no module of teamrl imports a layer above its own.

Order, low to high: core, losses, policies, rollout, sandbox, tasks, workflows, algorithms, trainer,
cli (``cli.py``; ``api.py``, the public extension API, sits beside it). Imports inside functions count
too: a lazy import is still a dependency.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "teamrl"
ORDER = ("core", "losses", "policies", "rollout", "sandbox", "tasks", "workflows", "algorithms", "trainer", "cli")
TOP = {"cli": len(ORDER) - 1, "api": len(ORDER) - 1}  # the two top-level modules


def rank(module: str) -> int | None:
    """The layer of a ``teamrl.x...`` module name (None outside teamrl, or for the package itself)."""
    parts = module.split(".")
    if parts[0] != "teamrl" or len(parts) < 2:
        return None
    return ORDER.index(parts[1]) if parts[1] in ORDER else TOP.get(parts[1])


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_every_module_has_a_layer():
    for path in ROOT.rglob("*.py"):
        module = ".".join(("teamrl", *path.relative_to(ROOT).with_suffix("").parts))
        assert rank(module) is not None or module == "teamrl.__init__", module


def test_no_module_imports_a_higher_layer():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        own = rank(".".join(("teamrl", *path.relative_to(ROOT).with_suffix("").parts)))
        for line, module in imports(path):
            other = rank(module)
            if own is not None and other is not None and other > own:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """Not vacuous: an import of a workflow from rollout/ is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from teamrl.workflows.context import EpisodeContext\n")
    assert [m for _, m in imports(bad)] == ["teamrl.workflows.context"]
    assert rank("teamrl.workflows.context") > rank("teamrl.rollout.gateway")
