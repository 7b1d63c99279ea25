"""The package's layout holds: no import cycles among its modules, and the server runtime never imports the
evaluation tooling (`tailreplay_sglang.eval`), so what runs inside SGLang is what the tree says it is."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tailreplay_sglang"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """Every tailreplay_sglang module this file imports, at any depth (lazy imports count as edges too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m.startswith("tailreplay_sglang")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path, name) if m in modules and m != name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):  # a package importing its own submodules is not a cycle
                continue
            if state.get(nxt) == 1 and not node.startswith(nxt + "."):
                return path + [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [])
            if found:
                return found
    return None


def test_no_import_cycles():
    assert _cycle(_graph()) is None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None


def test_the_server_runtime_does_not_import_evaluation_tooling():
    graph = _graph()
    runtime = [m for m in graph if not m.startswith("tailreplay_sglang.eval")]
    assert len(runtime) > 10
    for module in runtime:
        assert not {m for m in graph[module] if m.startswith("tailreplay_sglang.eval")}, module
