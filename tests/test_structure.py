"""The repository's layout holds: no import cycles among the modules of the plugin (`tailreplay_sglang`), of the
evaluation and test tooling (`tailreplay_eval`) and of the CPU port (`sglang_cpu_compat`, a project of its own in
`cpu_compat/`); the server runtime never imports the tooling or the port; a wheel built from the repository holds the
runtime only, and the port's wheel the port and its .pth, so what runs inside SGLang is what the tree says it is."""

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME, TOOLING, CPU_PORT = "tailreplay_sglang", "tailreplay_eval", "sglang_cpu_compat"
CPU_PORT_PROJECT = ROOT / "cpu_compat"  # its own pyproject.toml; scripts/setup_cpu.sh installs it beside the plugin
PACKAGES = (ROOT / RUNTIME, ROOT / TOOLING, CPU_PORT_PROJECT / CPU_PORT)
# What each wheel force-includes beside its package (pyproject.toml: [tool.hatch.build.targets.wheel.force-include])
PTH_FILES = {"tailreplay_sglang_python_api.pth"}
CPU_PORT_PTH = "sglang_cpu_compat.pth"


def _module_name(path: Path) -> str:
    package = next(p for p in PACKAGES if path.is_relative_to(p))
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_ours(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in (RUNTIME, TOOLING, CPU_PORT))


def _imports(path: Path, name: str) -> set[str]:
    """Every module of the three packages this file imports, at any depth (lazy imports count as edges too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
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
    assert all(any(m.startswith(p + ".") for m in graph) for p in (RUNTIME, TOOLING, CPU_PORT))
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


def test_the_plugin_never_imports_the_cpu_port():
    """The CPU port builds on the plugin (its torch ops, its hook table), never the other way round: a GPU install
    runs the plugin without it. Imports at any depth count, and so do module names written as strings (the hook
    tables resolve `module:function` strings)."""
    runtime = {name: path for name, path in _modules().items() if name.split(".")[0] == RUNTIME}
    named = re.compile(rf"{CPU_PORT}(\.\w+)*(:\w+)?")
    for name, path in runtime.items():
        assert not {m for m in _imports(path, name) if m.split(".")[0] == CPU_PORT}, name
        strings = [node.value for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Constant) and isinstance(node.value, str)]
        assert not [s for s in strings if named.fullmatch(s)], name
    assert not (ROOT / RUNTIME / "cpu").exists()


def test_the_wheel_ships_the_runtime_only(tmp_path):
    """A wheel built from the repository (hatchling, the build backend of pyproject.toml, in-process: well under a
    second) holds `tailreplay_sglang/`, its .dist-info and the python_api .pth, and nothing of the tooling or of the
    CPU port (no module, no fallback .pth, no entry point)."""
    from hatchling.builders.wheel import WheelBuilder

    (wheel,) = WheelBuilder(str(ROOT)).build(directory=str(tmp_path), versions=["standard"])
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert f"{RUNTIME}/__init__.py" in names and PTH_FILES <= set(names)
    stray = [n for n in names if not (n.startswith(f"{RUNTIME}/") or n in PTH_FILES
                                      or (n.split("/")[0].endswith(".dist-info") and "/" in n))]
    assert stray == []
    assert not [n for n in names if n.startswith((f"{TOOLING}/", f"{RUNTIME}/eval/", f"{RUNTIME}/cpu/",
                                                  f"{CPU_PORT}/", "cpu_compat/", "bench/", "tests/"))]
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "tailreplay = tailreplay_sglang.plugin:register" in archive.read(entry_points).decode()
    assert "cpu" not in archive.read(entry_points).decode()


def test_the_cpu_port_builds_its_own_wheel_with_its_pth(tmp_path):
    """cpu_compat/ builds (hatchling, in-process) into a wheel of `sglang_cpu_compat/`, its .dist-info with the SGLang
    plugin entry point, and the .pth that installs the import fallback at interpreter start."""
    from hatchling.builders.wheel import WheelBuilder

    (wheel,) = WheelBuilder(str(CPU_PORT_PROJECT)).build(directory=str(tmp_path), versions=["standard"])
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert {f"{CPU_PORT}/__init__.py", f"{CPU_PORT}/hooks.py", f"{CPU_PORT}/fallback.py", CPU_PORT_PTH} <= set(names)
    stray = [n for n in names if not (n.startswith(f"{CPU_PORT}/") or n == CPU_PORT_PTH
                                      or (n.split("/")[0].endswith(".dist-info") and "/" in n))]
    assert stray == []
    assert f"import {CPU_PORT}.fallback" in archive.read(CPU_PORT_PTH).decode()
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert f"{CPU_PORT} = {CPU_PORT}.hooks:register" in archive.read(entry_points).decode()


def test_only_the_config_reads_the_environment():
    """Environment variables (the config hand-off) are read in config.py alone."""
    readers = {p.relative_to(ROOT).as_posix() for p in (ROOT / RUNTIME).rglob("*.py")
               if re.search(r"\bos\.environ\b|\bgetenv\(", p.read_text())}
    assert readers == {"tailreplay_sglang/config.py"}


def test_only_env_reads_the_environment_in_the_cpu_port():
    """The port's environment variables (SGLang's CPU engine switch, the fallback's off switch, the conv-state dtype)
    are read and set in its env.py alone."""
    port = CPU_PORT_PROJECT / CPU_PORT
    readers = {p.relative_to(port).as_posix() for p in port.rglob("*.py")
               if re.search(r"\bos\.environ\b|\bgetenv\(", p.read_text())}
    assert readers == {"env.py"}


def test_bench_scripts_import_without_path_edits():
    """bench/ and scripts/ run as `python bench/X.py`: the editable install puts the repository root on sys.path, so
    none edits it, and each imports with a plain interpreter started elsewhere."""
    scripts = sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    editors = [p.relative_to(ROOT).as_posix() for p in scripts if "sys.path" in p.read_text()]
    assert editors == []
    # each run as a module (no main), in one interpreter started outside the repository
    load = ("import runpy, sys\n"
            "for path in sys.argv[1:]:\n    print(path, flush=True)\n    runpy.run_path(path, run_name='x')")
    run = subprocess.run([sys.executable, "-c", load, *map(str, scripts)], capture_output=True, text=True, cwd="/")
    assert run.returncode == 0, (run.stdout.splitlines()[-1:], run.stderr[-2000:])


def test_the_tree_passes_ruff():
    """The style pyproject.toml configures ([tool.ruff]) holds everywhere ruff looks."""
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                         text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_every_mutant_in_the_table_still_applies():
    """`tests/mutants.py` applies each mutant by its exact text and refuses one whose text is gone: a refactor of the
    code under a mutant must move the mutant with it (M1, M1b and M9 had silently stopped applying), so each text
    occurs exactly once in its file."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import mutants
    finally:
        sys.path.remove(str(ROOT / "tests"))
    counts = {m.name: (ROOT / m.path).read_text().count(m.old) for m in mutants.MUTANTS}
    assert {name: n for name, n in counts.items() if n != 1} == {}


def test_every_test_has_a_time_limit(request):
    """A hang (a collective that never pairs) fails its own test through pytest-timeout, pinned in the lock: every
    collected test carries a limit, server tests a longer one (conftest.py)."""
    from tests.conftest import TEST_TIMEOUT_S

    assert request.config.pluginmanager.hasplugin("timeout")
    assert "pytest-timeout==" in (ROOT / "requirements" / "cpu.lock").read_text()
    marker = request.node.get_closest_marker("timeout")
    assert marker is not None and marker.args == (TEST_TIMEOUT_S,)
