"""SGLang servers forked from one process that has imported SGLang once: a test server is up in ~6 s instead of ~26.

A `python -m sglang.launch_server` start on this CPU costs ~26 s of wall time and ~36 s of CPU, nearly all of it the
same Python imports done three times (launcher, scheduler, detokenizer; transformers, torch._inductor, every SGLang
model). `Preforker` runs one process (`python -m tailreplay_eval.preforked SOCKET`) that imports SGLang, its models
and this plugin, and then only forks: each request on its Unix socket becomes a fresh child that takes the server's
environment, argv and log, starts its own session (stopped by process group, as a spawned server is) and runs
`sglang.launch_server` as `__main__`. That launcher starts its scheduler and detokenizer with multiprocessing's
`fork` instead of SGLang's `spawn`, and each of them loads SGLang's plugins itself, as a spawned process does.

What differs from a user's `launch_server`: the start method, and that modules are imported before the server's
environment is set (SGLang reads its `SGLANG_*` variables when used, and the one read at import,
SGLANG_USE_CPU_ENGINE, is the same for every CPU server: `CPU_ENV`). GPU servers, routers and `spawn=True` servers
keep the spawned launcher, as does everything outside the tests; `pytest --spawn-servers` spawns every test server.
"""

import itertools
import json
import os
import select
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

# What the three processes of a CPU server import; the model registry imports every SGLang model.
PRELOAD = ("sglang.srt.server_args", "sglang.srt.plugins", "sglang.srt.entrypoints.http_server",
           "sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager",
           "sglang.srt.managers.tokenizer_manager", "sglang.srt.model_executor.model_runner",
           "sglang.srt.models.registry", "tailreplay_sglang.plugin", "tailreplay_sglang.runtime")


class ForkedProcess:
    """A server forked by the preforker, with the part of `subprocess.Popen` that `ServerProcess` uses: `pid` (also
    its process group), `poll()`, `wait()`, `returncode`. The preforker reports the exit code on the connection the
    server was asked for."""

    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self._conn, self.returncode = pid, conn, None
        self._buffer = b""

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout)
            select.select([self._conn], [], [], 0.1)
        return self.returncode

    def _read(self) -> None:
        chunk = self._conn.recv(4096)
        self._buffer += chunk
        if b"\n" in self._buffer:
            self.returncode = json.loads(self._buffer.split(b"\n")[0])["returncode"]
        elif not chunk:  # the preforker is gone: it can no longer tell, so report what a lost process reports
            self.returncode = -9
        if self.returncode is not None:
            self._conn.close()


class Preforker:
    """The client: starts the preforker process on first use and asks it for servers. `default`: the one every
    `ServerProcess` that names none and is not `spawn` uses (the test session's; None elsewhere)."""

    default: "Preforker | None" = None

    def __init__(self, folder: Path, env: dict[str, str]):
        self.socket_path = Path(folder) / "preforker.sock"
        self.log_path = Path(folder) / "preforker.log"
        self._env = env
        self._proc: subprocess.Popen | None = None

    def launch(self, argv: list[str], env: dict[str, str], log_path: Path | None) -> ForkedProcess:
        """Fork `python -m sglang.launch_server *argv` with exactly `env`, its output in `log_path`."""
        self._ensure_running()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(self.socket_path))
        request = {"argv": argv, "env": env, "log": str(log_path) if log_path else os.devnull}
        conn.sendall(json.dumps(request).encode() + b"\n")
        try:
            return ForkedProcess(_read_message(conn)["pid"], conn)
        except ConnectionError as lost:
            raise RuntimeError(f"{lost}{self._log_tail()}") from None

    def _ensure_running(self, timeout: float = 180.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self.socket_path.unlink(missing_ok=True)
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self._proc = subprocess.Popen([sys.executable, "-m", "tailreplay_eval.preforked", str(self.socket_path)],
                                          env={**os.environ, **self._env}, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.socket_path.exists():  # bound after the imports
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the preforker did not start{self._log_tail()}")
            time.sleep(0.1)

    def _log_tail(self) -> str:
        return f"\n--- {self.log_path} ---\n" + self.log_path.read_text(errors="replace")[-3000:] \
            if self.log_path.exists() else ""

    def close(self) -> None:
        """Stop the preforker (the servers it forked live in their own sessions and are stopped by their owners)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


# ---- the preforker process ----

def serve(socket_path: str) -> None:
    """Import SGLang, then fork a server per request until the parent (the test session) is gone."""
    import importlib

    parent = os.getppid()
    for module in PRELOAD:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        if select.select([listener], [], [], 0.2)[0]:
            conn, _ = listener.accept()
            try:
                request = _read_message(conn)
            except ConnectionError:  # the client went away before asking
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in (*children.values(), conn):
                    other.close()
                _run_launcher(request)  # never returns
            children[pid] = conn
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _reap(children)


def _read_message(conn: socket.socket) -> dict:
    """One JSON line from `conn` (a request, or the preforker's reply with the pid)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the preforker's connection closed mid-message")
        data += chunk
    return json.loads(data)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:  # its owner is gone
                pass
            conn.close()


def _run_launcher(request: dict) -> None:
    """In the forked child: become the server's launcher, as `python -m sglang.launch_server` would be."""
    code = 1
    try:
        os.setsid()  # its own process group, stopped as a whole by PID like a spawned server
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        # The command line a spawned launcher shows (ps, pkill -f); set before the environment changes, since
        # setproctitle takes over the memory of argv and environ on its first call and cannot once environ moved
        # (SGLang names its scheduler processes with it: `sglang::scheduler...`).
        import setproctitle

        setproctitle.setproctitle(" ".join([sys.executable, "-m", "sglang.launch_server", *request["argv"]]))
        os.environ.clear()
        os.environ.update(request["env"])
        # A spawned interpreter would read PYTHONPATH (e.g. the tests' fault plugin) into sys.path at start-up.
        for entry in reversed([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        _fork_children_as_spawned()
        sys.argv = ["sglang.launch_server", *request["argv"]]
        import runpy

        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork_children_as_spawned() -> None:
    """SGLang sets the `spawn` start method for its scheduler and detokenizer: make it `fork` (the imports are done),
    and give each forked child what a spawned one starts from: SGLang's modules as imported, none of the launcher's
    plugin patches applied (`PluginEffects`), plugins not loaded; each then loads the plugins itself."""
    import multiprocessing
    import multiprocessing.util

    set_start_method = multiprocessing.set_start_method
    multiprocessing.set_start_method = lambda method, force=False: set_start_method("fork", force=True)
    PluginEffects.installed = PluginEffects()
    multiprocessing.util.register_after_fork(PluginEffects.installed, _start_as_spawned)


def _start_as_spawned(effects: "PluginEffects") -> None:
    """In each forked child, before it runs: what loading the plugins did in its parent taken back, and what a
    library decided at import from an environment variable SGLang sets later decided again: prometheus_client's
    multiprocess mode (the launcher sets PROMETHEUS_MULTIPROC_DIR after the preforker imported it; without it a
    scheduler's metrics never reach /metrics)."""
    effects.undo()
    from prometheus_client import values

    values.ValueClass = values.get_value_class()


def propagate_patch(original: object, wrapped: object, source_module: object) -> int:
    """SGLang's `hook_registry._propagate_patch` (every module global bound to `original`, the source module's aside,
    rebound to `wrapped`; returns how many), with the scan of each module's globals in C: `map(operator.is_, ...)`
    finds the modules that hold `original` by identity, as SGLang's loop does, and only those are walked in Python.
    SGLang walks every module in sys.modules once per hooked target, and a process that imported the model registry
    (every forked test server's: the preforker imports it) holds about 8,200: measured, 100 targets took about 7 s of
    each scheduler's and detokenizer's start, half of a forked start."""
    import operator
    import types

    patched = 0
    for mod in list(sys.modules.values()):
        if mod is source_module or not isinstance(mod, types.ModuleType):
            continue
        try:
            mod_vars = vars(mod)
        except TypeError:
            continue
        if not any(map(operator.is_, mod_vars.values(), itertools.repeat(original))):
            continue
        for attr_name, attr_value in list(mod_vars.items()):
            if attr_value is original:
                try:
                    setattr(mod, attr_name, wrapped)
                    patched += 1
                except (AttributeError, TypeError):
                    pass
    return patched


class PluginEffects:
    """What loading SGLang's plugins does to a process, recorded so that a forked child can take it back and load
    them itself: every patch SGLang's HookRegistry applies, in order (a child that kept its parent's patches would
    skip its own hooks on the same targets, since HookRegistry patches a target once: e.g. Tail-Replay's scheduler
    hooks where the CPU port patched the launcher), and the registries the plugins' `call` rows fill (a DP
    controller registers the radix-cache backend before it forks its schedulers, and a second registration fails)."""

    REGISTRIES = ("sglang.srt.mem_cache.registry._RADIX_CACHE_REGISTRY",
                  "sglang.srt.configs.linear_attn_model_registry._LINEAR_ATTN_MODEL_REGISTRY",
                  "sglang.srt.utils.hf_transformers.common._CONFIG_REGISTRY")
    installed: "PluginEffects | None" = None

    def __init__(self):
        import copy
        import pkgutil

        from sglang.srt.plugins import hook_registry

        self._registries = [(registry, copy.copy(registry)) for registry in map(pkgutil.resolve_name,
                                                                                  self.REGISTRIES)]
        self._registry_module = hook_registry
        self._propagate = propagate_patch  # SGLang's, scanning in C (it is what every later patch goes through)
        self._apply_target = hook_registry.HookRegistry._apply_target.__func__
        self._log: list[tuple] = []
        hook_registry._propagate_patch = self._logged_propagate
        hook_registry.HookRegistry._apply_target = classmethod(self._logged_apply_target)

    def _logged_apply_target(self, registry, target: str, hooks: list) -> None:
        import pkgutil

        owner_path, attr = target.rsplit(".", 1)
        owner = pkgutil.resolve_name(owner_path)
        own = vars(owner)
        before = ("set", owner, attr, attr in own, own.get(attr, getattr(owner, attr, None)))
        self._apply_target(registry, target, hooks)
        self._log.append(before)

    def _logged_propagate(self, original, wrapped, source_module) -> int:
        self._log.append(("propagate", original, wrapped, source_module))
        return self._propagate(original, wrapped, source_module)

    def undo(self) -> None:
        """In a forked child: every patch taken back, newest first; the HookRegistry and plugins as never loaded."""
        for entry in reversed(self._log):
            if entry[0] == "propagate":
                _, original, wrapped, source_module = entry
                self._propagate(wrapped, original, source_module)
            else:
                _, owner, attr, owned, value = entry
                if owned:
                    setattr(owner, attr, value)
                else:
                    delattr(owner, attr)
        self._log.clear()
        for registry, before in self._registries:
            registry.clear()
            registry.update(before) if isinstance(registry, dict) else registry.extend(before)
        self._registry_module.HookRegistry.reset()
        import sglang.srt.plugins

        sglang.srt.plugins._plugins_loaded = False


if __name__ == "__main__":
    serve(sys.argv[1])
