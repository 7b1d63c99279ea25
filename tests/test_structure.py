"""The repository's layout holds: no import cycles among the modules of the plugin (`tailreplay_sglang`) and of the
evaluation and test tooling (`tailreplay_eval`), the server runtime never imports the tooling, and a wheel built from
the repository holds the runtime only, so what runs inside SGLang is what the tree says it is."""

import ast
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME, TOOLING = "tailreplay_sglang", "tailreplay_eval"
PACKAGES = (ROOT / RUNTIME, ROOT / TOOLING)
# What the wheel force-includes beside the package (pyproject.toml: [tool.hatch.build.targets.wheel.force-include])
PTH_FILES = {"tailreplay_sglang_cpu_fallback.pth", "tailreplay_sglang_python_api.pth"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_ours(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in (RUNTIME, TOOLING))


def _imports(path: Path, name: str) -> set[str]:
    """Every module of the two packages this file imports, at any depth (lazy imports count as edges too)."""
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
    return {m for m in found if _is_ours(m)}


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in package.rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
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
    graph = _graph()
    assert any(m.startswith(TOOLING + ".") for m in graph) and any(m.startswith(RUNTIME + ".") for m in graph)
    assert _cycle(graph) is None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None


def test_the_server_runtime_does_not_import_evaluation_tooling():
    runtime = {name: path for name, path in _modules().items() if name.split(".")[0] == RUNTIME}
    assert len(runtime) > 10
    for name, path in runtime.items():
        # Every import, whether or not the module exists (the tooling's old place, `eval` in the runtime, too).
        imports = _imports(path, name)
        assert not {m for m in imports if m.split(".")[0] == TOOLING or m.startswith(RUNTIME + ".eval")}, name
    assert not (ROOT / RUNTIME / "eval").exists()


def test_the_wheel_ships_the_runtime_only(tmp_path):
    """A wheel built from the repository (hatchling, the build backend of pyproject.toml, in-process: well under a
    second) holds `tailreplay_sglang/`, its .dist-info and the two .pth files, and nothing of the tooling."""
    from hatchling.builders.wheel import WheelBuilder

    (wheel,) = WheelBuilder(str(ROOT)).build(directory=str(tmp_path), versions=["standard"])
    names = zipfile.ZipFile(wheel).namelist()
    assert f"{RUNTIME}/__init__.py" in names and PTH_FILES <= set(names)
    stray = [n for n in names if not (n.startswith(f"{RUNTIME}/") or n in PTH_FILES
                                      or (n.split("/")[0].endswith(".dist-info") and "/" in n))]
    assert stray == []
    assert not [n for n in names if n.startswith((f"{TOOLING}/", f"{RUNTIME}/eval/", "bench/", "tests/"))]


def test_only_the_config_reads_the_environment():
    """Environment variables (the config hand-off, the CPU fallback's switches) are read in config.py alone."""
    import re

    readers = {p.relative_to(ROOT).as_posix() for p in (ROOT / RUNTIME).rglob("*.py")
               if re.search(r"\bos\.environ\b|\bgetenv\(", p.read_text())}
    assert readers == {"tailreplay_sglang/config.py"}
