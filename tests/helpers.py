"""Plain helpers the tests share: the model folder, the exact Tail-Replay flags, servers started and stopped by PID
(per module, or once per session for the flag sets several modules share: ServerRegistry), greedy `/generate`, the
multi-turn / concurrent-hit / forked-program checks, a tensor error, and bench scripts loaded by path. Fixtures live
in conftest.py; test modules import these with `from helpers import ...` (pytest puts tests/ on the import path, as
it does for conftest.py)."""

import ast
import base64
import concurrent.futures
import importlib.util
import io
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import requests
import torch
from PIL import Image

from tailreplay_eval.exactness import (EXACT_MEAN_TOL, EXACT_TOL, assert_exact, exact_errors,  # noqa: F401
                                      generate, generate_response, no_cache, scored, scored_from)
from tailreplay_eval.reference import greedy_generate
from soak import wait_idle
from tailreplay_eval.mooncake_store import SEGMENT_BYTES, server_flags
from tailreplay_eval.server import ServerProcess, _group_alive, flush_cache

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = Path(os.environ.get("TAILREPLAY_MODELS_DIR", ROOT / "models"))

# The paper's mode (no anchors: --tail-replay-exact-budget 0) replaying the whole prefix (ratio 1): exact. One
# server for the session (conftest's `exact_tail_replay_server`), shared by test_python_api.py, test_router.py and
# test_tail_replay.py (anchored replay: its own file).
EXACT_FLAGS = ("--enable-tail-replay", "--tail-replay-exact-budget", "0", "--tail-replay-ratio", "1",
               "--tail-replay-hidden-dtype", "float32",
               "--enable-metrics", "--enable-cache-report", "--chunked-prefill-size", "128")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, computed in float64."""
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def load_bench(name: str):
    """bench/<name>.py as a module, loaded by path (bench/ is a folder of scripts, not a package; they import only
    installed packages and tailreplay_eval, so nothing goes on sys.path). Loaded once per session, like an import."""
    module_name = f"bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before running it: dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


FAULT_PLUGIN_DIR = Path(__file__).resolve().parent / "plugins"  # the test-only SGLang plugin (fault injection)


def plugin_pythonpath() -> str:
    """PYTHONPATH of a server that loads the test plugin (its dist-info's entry point is found there)."""
    return os.pathsep.join(p for p in (str(FAULT_PLUGIN_DIR), os.environ.get("PYTHONPATH")) if p)


def faults_env(replay_delay_s: float = 0.0, events: Path | None = None, cut_prefixes: bool = False,
               raise_on_rid: bool = False, watch_pool_writes: Path | None = None,
               dump_states: Path | None = None, neighbour_share: float | None = None) -> dict:
    """Server environment that loads the fault-injection plugin (`tests/plugins/tailreplay_test_faults.py`): every
    replay pass that ran is held for `replay_delay_s`, and logged to `events` (read with `FaultEvents`) first; with
    `cut_prefixes`, a request with rid `cut<N>-...` extends from at most N tokens, whatever its match planned; with
    `raise_on_rid`, the replay pass that served a request with rid `raise-...` raises once it ran; with
    `watch_pool_writes`, every mamba-pool slot write outside a forward is logged there (`pool_writes`); with
    `dump_states`, the states a replay rebuilt for a request with rid `dump-...` are saved there (`dumped_states`);
    with `neighbour_share`, a neighbour process holds that share of the available RAM while the server loads."""
    env = {"PYTHONPATH": plugin_pythonpath(), "TAILREPLAY_FAULT_REPLAY_DELAY_S": str(replay_delay_s)}  # its DELAY_ENV
    if cut_prefixes:
        env["TAILREPLAY_FAULT_CUT_PREFIX"] = "1"  # its CUT_ENV
    if raise_on_rid:
        env["TAILREPLAY_FAULT_RAISE"] = "1"  # its RAISE_ENV
    if watch_pool_writes is not None:
        env["TAILREPLAY_WATCH_POOL_WRITES"] = str(watch_pool_writes)  # its WATCH_ENV
    if dump_states is not None:
        env["TAILREPLAY_DUMP_REPLAYED_STATES"] = str(dump_states)  # its DUMP_ENV
    if neighbour_share is not None:
        env["TAILREPLAY_FAULT_NEIGHBOUR_SHARE"] = str(neighbour_share)  # its NEIGHBOUR_ENV
    return {**env, "TAILREPLAY_FAULT_EVENTS": str(events)} if events else env  # its EVENTS_ENV


def pool_writes(path: Path) -> dict[str, list[str]]:
    """The watch's log (`faults_env(watch_pool_writes=...)`): the methods of the mamba-pool writes made outside a
    forward, and the first made inside one."""
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {where: [r[where] for r in records if where in r] for where in ("outside_forward", "inside_forward")}


def dumped_states(folder: Path, rid: str) -> dict:
    """The states a replay rebuilt for request `rid` (`faults_env(dump_states=...)`), in SGLang's pool layout:
    {"temporal": {layer id: [HV, V, K]}, "conv": {layer id: [dim, K - 1]}}, float32."""
    return torch.load(folder / f"{rid}.pt")


class FaultEvents:
    """The fault plugin's log of held replay passes: which requests each held, so a test waits for the hold it needs
    instead of sleeping, and shows that the fault it names happened."""

    def __init__(self, path: Path):
        self.path = path

    def held(self) -> list[list[str]]:
        """The request ids of every held pass so far, oldest first."""
        if not self.path.exists():
            return []
        return [json.loads(line)["held"] for line in self.path.read_text().splitlines()]

    def passes_holding(self, rid: str) -> list[list[str]]:
        return [rids for rids in self.held() if rid in rids]

    def wait_held(self, rid: str, timeout: float = 120.0) -> list[str]:
        """Block until a pass holding `rid` has started (the plugin logs before it holds); its request ids."""
        deadline = time.monotonic() + timeout
        while not self.passes_holding(rid):
            assert time.monotonic() < deadline, f"no replay pass held {rid} within {timeout} s"
            time.sleep(0.005)
        return self.passes_holding(rid)[0]


def start_server(model_path, tmp_path_factory, *extra_args, env=None, **kwargs):
    """Generator body for server fixtures: start, yield the running server, always stop it by PID."""
    servers = start_servers(tmp_path_factory, {"server": Spec(model_path, extra_args, env, kwargs)})
    try:
        yield next(servers)["server"]
    finally:
        servers.close()


@dataclass(frozen=True)
class Spec:
    """One server of `start_servers`: model, extra flags, extra environment, ServerProcess keywords."""

    model_path: object
    args: tuple = ()
    env: dict | None = None
    kwargs: dict = field(default_factory=dict)


def start_servers(tmp_path_factory, specs: dict[str, Spec]):
    """Generator body for fixtures that need several servers: start them all at once, yield {name: running server},
    always stop them all by PID. A start is mostly Python imports in one process at a time, so on two cores
    overlapping several starts costs less wall time than running them one after the other."""
    servers = {}
    try:
        launch(tmp_path_factory, specs, servers)
        yield servers
    finally:
        stop_all(servers)


def start_gpu_scheduled(tmp_path_factory, model_path, flag_sets: dict[str, tuple]):
    """`start_servers` of one checkpoint under several flag sets, all on SGLang's GPU-default scheduling
    (extra_buffer with the overlap scheduler): the frontier models' modules, whose pages need it."""
    yield from start_servers(tmp_path_factory, {name: Spec(model_path, flags, kwargs={"gpu_scheduling": True})
                                                for name, flags in flag_sets.items()})


class RunningTest:
    """The test pytest is running (conftest.py's `pytest_runtest_protocol`): a server start checks that it carries
    the `server` mark, so that `make test-fast` (-m "not server") provably starts none."""

    item = None

    @classmethod
    def check_marked(cls) -> None:
        item = cls.item
        assert item is None or item.get_closest_marker("server"), \
            f"{item.nodeid} starts a server (or a fixture it uses does) without the `server` mark"


def launch(tmp_path_factory, specs: dict[str, Spec], servers: dict | None = None) -> dict[str, ServerProcess]:
    """Start the servers of `specs` at once and wait until all are healthy: {name: running server}, filled into
    `servers` as they start (so a caller's `finally` can stop them); a start that fails stops them all."""
    RunningTest.check_marked()
    servers = {} if servers is None else servers
    try:
        for name, spec in specs.items():
            servers[name] = _started(tmp_path_factory, name, spec)
        for name, spec in specs.items():
            try:
                servers[name].wait_healthy()
            except RuntimeError as error:
                if PORT_RACE not in str(error):
                    raise
                servers[name].stop()  # once more, on ports of its own
                servers[name] = _started(tmp_path_factory, name, spec).wait_healthy()
    except BaseException:
        stop_all(servers, check_holds=False)
        raise
    return servers


# SGLang picks its internal ports (the scheduler's torch.distributed store among them) at random below the ephemeral
# range, checks them free, and binds them later in a child process: a server starting beside it can take one in
# between (seen in CI: a PD decode server's TCPStore, "EADDRINUSE"). Such a start is tried once more.
PORT_RACE = "address already in use"


def _started(tmp_path_factory, name: str, spec) -> ServerProcess:
    log = tmp_path_factory.mktemp(f"server-{name}") / "server.log"
    # SGLang's idle invariant check (every KV slot, mamba slot and request row accounted for) raises
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", **(spec.env or {})}
    return ServerProcess(str(spec.model_path), tuple(spec.args), log_path=log, env=env, **spec.kwargs).start()


HOLD_KEYS = ("host_anchor_pins", "staged_anchors")


def holds_left(server: ServerProcess) -> dict:
    """What a Tail-Replay server still holds once idle of what must not outlive a scheduling step (host anchor pins,
    staged anchors: `anchor_copy`); {} for a stock server, a decode server or one a test killed."""
    try:
        report = wait_idle(server.base_url, timeout=20)
    except (requests.RequestException, KeyError, IndexError, TypeError, ValueError):
        return {}
    return {key: report[key] for key in HOLD_KEYS if report.get(key)}


def stop_all(servers: dict[str, ServerProcess], check_holds: bool = True) -> None:
    """Stop the servers together, each by its process group, and check that none survived and, after its module's
    last test, that no Tail-Replay server was left holding an anchor."""
    held = {name: h for name, server in servers.items() if check_holds and (h := holds_left(server))}
    with concurrent.futures.ThreadPoolExecutor(max(1, len(servers))) as pool:
        list(pool.map(ServerProcess.stop, servers.values()))
    alive = [name for name, server in servers.items() if _group_alive(server.proc.pid)]
    assert not alive, f"server process groups survived stop(): {alive}"
    assert not held, f"anchors still held on idle servers: {held}"


def spec_key(spec: Spec) -> tuple:
    """What makes two servers the same server: model folder, flags, environment, ServerProcess keywords."""
    return (str(spec.model_path), tuple(spec.args), tuple(sorted((spec.env or {}).items())),
            tuple(sorted(spec.kwargs.items())))


class ServerRegistry:
    """The servers several modules share (conftest.py's SHARED_SERVERS), one per `spec_key` for the whole session.

    A server starts on its first use (`serve`, the body of a module-scoped fixture) and is stopped by PID when the
    last test that needs it is done (`release`, called by conftest's teardown hook), at the end of the session
    (`close`), or, should a start find `max_alive` up already, when it is the least recently used one that no module
    is using (a later `serve` starts it again). One fixture name per flag set: the last test that needs a server is
    found by its fixture name."""

    def __init__(self, tmp_path_factory, max_alive: int = 3):
        self._tmp = tmp_path_factory
        self.max_alive = max_alive
        self._alive: dict[tuple, ServerProcess] = {}  # insertion order = least recently used first
        self._held: dict[tuple, int] = {}  # modules using the server now
        self._keys: dict[str, tuple] = {}  # fixture name -> spec_key

    def serve(self, name: str, spec: Spec):
        """Generator body for a module-scoped fixture: yield the running server for `spec`, started if needed."""
        key = self._keys.setdefault(name, spec_key(spec))
        assert key == spec_key(spec), f"{name}: one name, one flag set"
        twins = [other for other, k in self._keys.items() if k == key and other != name]
        assert not twins, f"{name} has the flags of {twins}: use that fixture"
        self._held[key] = self._held.get(key, 0) + 1
        try:
            yield self._get(name, key, spec)
        finally:
            self._held[key] -= 1

    def _get(self, name: str, key: tuple, spec: Spec) -> ServerProcess:
        server = self._alive.pop(key, None)
        if server is not None and server.proc.poll() is not None:  # it died (and the test that saw it failed)
            stop_all({name: server})
            server = None
        if server is None:
            idle = [k for k in self._alive if not self._held.get(k)]
            while len(self._alive) >= self.max_alive and idle:
                self._stop(idle.pop(0))
            server = launch(self._tmp, {name: spec})[name]
        self._alive[key] = server  # now the most recently used
        return server

    def release(self, name: str) -> None:
        """No later test needs this server: stop it now rather than at the end of the session."""
        key = self._keys.get(name)
        if key in self._alive:
            self._stop(key)

    def _stop(self, key: tuple) -> None:
        name = next(n for n, k in self._keys.items() if k == key)
        stop_all({name: self._alive.pop(key)})

    def close(self) -> None:
        for key in list(self._alive):
            self._stop(key)


TINY_VOCAB = 512  # tiny-qwen35
def random_ids(n, seed, vocab=TINY_VOCAB):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def max_error(a: dict, b: dict) -> float:
    """Largest log-prob difference between two `scored` results of the same prompt."""
    assert len(a["logprobs"]) == len(b["logprobs"]) > 0
    return max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"]))


FOLD = 64  # --tail-replay-fold-tokens' default


def assert_anchored_hit(meta: dict, matched: int, fold: int = FOLD) -> None:
    """An exact hit of `matched` tokens from its anchor c: replayed over [c, matched) when more than `fold` tokens;
    within `fold`, folded into the extend: the match stops at c (cached tokens = c) and nothing is replayed (with
    c = 0 there is no hit at all, so no anchor is reported)."""
    anchor, cached, replayed = meta["tail_replay_anchor"], meta["cached_tokens"], meta["tail_replay_tokens"]
    assert meta["tail_replay_exact"] is True, meta
    if cached == 0:
        assert matched <= fold and replayed == 0, meta
    elif matched - anchor <= fold:
        assert cached == anchor and replayed == 0, meta
    else:
        assert cached == matched and replayed == matched - anchor, meta


def run_forked_program(backend, system: str, question: str) -> list[dict]:
    """An SGLang frontend program (`sgl.function`) that forks 3 branches after `system + question`, run twice (the
    first run's branches race in one prefill batch, so some miss); per branch of the second run, its `meta` info,
    the `prompt` text the branch sent and its `answer`."""
    import sglang as sgl

    @sgl.function
    def branches(s, question):
        s += system + " " + question
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" branch {i} says"
            f += sgl.gen("answer", max_tokens=FORK_ANSWER_TOKENS, temperature=0)
        return [{"meta": f.get_meta_info("answer"), "prompt": f.text()[:-len(f["answer"]) or None],
                 "answer": f["answer"]} for f in forks]

    branches.run(question=question, backend=backend)
    return branches.run(question=question, backend=backend).ret_value


FORK_ANSWER_TOKENS = 4


def check_forked_program(server, branches: list[dict], prefix_len: int) -> None:
    """Every branch of `run_forked_program` hit the shared prefix and answered as the server does with no cache."""
    assert len(branches) == 3
    for branch in branches:
        assert branch["meta"]["cached_tokens"] >= prefix_len - 1, (branch["meta"], prefix_len)
    for branch in branches:
        flush_cache(server.base_url)
        body = {"text": branch["prompt"], "sampling_params": {"max_new_tokens": FORK_ANSWER_TOKENS, "temperature": 0}}
        r = requests.post(f"{server.base_url}/generate", json=body, timeout=120)
        r.raise_for_status()
        assert r.json()["meta_info"]["cached_tokens"] == 0
        assert r.json()["text"] == branch["answer"], branch


def check_multi_turn(server, model, tok, turn1_text, new_tokens) -> None:
    """Decode-time capture: a second turn containing turn one's generated tokens matches through them (all but the
    last generated token, which has no KV when the request finishes) and equals HF greedy."""
    turn1 = tok(turn1_text).input_ids
    answer = generate(server, turn1, new_tokens)["output_ids"]
    turn2 = turn1 + answer + tok(" and a follow-up question?").input_ids
    out = generate(server, turn2, new_tokens)
    assert out["meta_info"]["cached_tokens"] >= len(turn1) + len(answer) - 1
    assert out["output_ids"] == greedy_generate(model, turn2, new_tokens)


def check_concurrent_hits(server, model, tok, system_ids, new_tokens) -> None:
    """8 requests sharing `system_ids` (already cached), sent at once: each hits it and equals HF greedy."""
    prompts = [system_ids + tok(" question" * (i + 1)).input_ids for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: generate(server, p, new_tokens), prompts))
    for ids, out in zip(prompts, outs):
        assert out["meta_info"]["cached_tokens"] >= len(system_ids)
        assert out["output_ids"] == greedy_generate(model, ids, new_tokens)


def check_cold_prompts(server, model, new_tokens: int, tol: float) -> None:
    """SGLang's own forward (cache flushed before each prompt; the plugin only reads it) on fresh prompts of 5, 70
    and 300 tokens: HF's greedy tokens, and every prompt log-prob within `tol` of HF's."""
    from tailreplay_eval.reference import prompt_logprobs

    for n, seed in ((5, 1), (70, 2), (300, 3)):
        flush_cache(server.base_url)
        ids = random_ids(n, seed)
        out = generate(server, ids, new_tokens, return_logprob=True, logprob_start_len=0)
        assert out["meta_info"]["cached_tokens"] == 0
        assert out["output_ids"] == greedy_generate(model, ids, new_tokens)
        served = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
        assert max(abs(a - b) for a, b in zip(served, prompt_logprobs(model, ids))) < tol


def check_window_hits(server, tok, new_tokens: int, reference) -> None:
    """A window family's (LFM2, ZAYA1) chat turn and burst: a second turn hits the first turn's prompt and answer
    (captured at decode); eight requests sharing a system prompt hit it at once, each replaying its window in one
    pass. Every hit is labelled exact, the pools stay whole, and each output equals `reference(ids)` (taken last: a
    server's own no-cache run flushes its cache)."""
    from soak import pool_leaks, wait_idle

    flush_cache(server.base_url)
    turn1 = tok("the old sailor carried the wooden boxes near the harbour").input_ids
    question = tok(" and a follow-up question?").input_ids
    turn2 = turn1 + generate(server, turn1, new_tokens)["output_ids"] + question
    out = generate(server, turn2, new_tokens)
    assert out["meta_info"]["cached_tokens"] >= len(turn2) - len(question) - 1
    assert out["meta_info"]["tail_replay_exact"] is True
    hits = [(turn2, out)]
    system = tok("you are a careful assistant. the young engineer repaired a broken window in the library").input_ids
    generate(server, system, 1)
    prompts = [system + tok(" question" * (i + 1)).input_ids for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: generate(server, p, new_tokens), prompts))
    for out in outs:
        meta = out["meta_info"]
        assert meta["cached_tokens"] >= len(system) - 1 and meta["tail_replay_exact"] is True, meta
    hits += list(zip(prompts, outs))
    assert pool_leaks(wait_idle(server.base_url)) == []
    for ids, out in hits:
        assert out["output_ids"] == reference(ids)


def hook_registry_callers(package) -> list[str]:
    """Modules of a package folder that call `HookRegistry.register` themselves, relative to it."""
    callers = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "register" and getattr(node.value, "id", "") == \
                    "HookRegistry":
                callers.append(path.relative_to(package).as_posix())
    return callers


# ---- HiCache servers (test_hicache.py, test_hicache_tail_replay.py) ----

CONTEXT, QUESTION, HICACHE_DEVICE_TOKENS = 700, 24, 1200  # three 700-token contexts push an earlier one to the host
# no --hicache-io-backend: SGLang's default (`kernel`, CUDA-only) becomes `direct` on the CPU engine (the CPU port)
# Host pools of 16 x the device pools (19,200 tokens, 1,024 mamba slots: tens of MB), not a --hicache-size in whole
# GB: SGLang refuses a host pool larger than the free RAM less 10 GiB, and with the other worker's servers up it
# refused 1 GB ones ("Requesting 0.76 GB but only have 0.41 GB free", clean-clone CI of 8e50938), then pools of tens
# of MB (e2fee35): every HiCache test server keeps HOST_RESERVE_GIB free instead (the test plugin's RESERVE_ENV).
HICACHE = ("--enable-hierarchical-cache", "--hicache-ratio", "16",
           "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete",
           "--dtype", "float32", "--enable-cache-report",
           # three servers start at once: SGLang's check that the memory left after loading is within the fraction
           # failed once at 0.1 (the pool itself is set by max_total_tokens)
           "--mem-fraction-static", "0.5")


HOST_RESERVE_GIB = 2  # host memory SGLang keeps free of HiCache host pools in test servers (SGLang's own: 10 GiB)


def host_reserve_env() -> dict:
    """Environment of a HiCache test server: the test plugin keeps HOST_RESERVE_GIB free of its host pools."""
    return {"PYTHONPATH": plugin_pythonpath(), "TAILREPLAY_TEST_HOST_RESERVE_GIB": str(HOST_RESERVE_GIB)}  # RESERVE_ENV


def hicache_spec(model, l3_folder: Path | None, gpu_scheduling: bool, *extra: str) -> Spec:
    """A HiCache server with 1,200-token device pools and its L3 (`file`) in `l3_folder` (None: the host tier
    alone). Three at a time (the host-memory unit in tests/parallel.py), each keeping HOST_RESERVE_GIB free."""
    flags, env = HICACHE, host_reserve_env()
    if l3_folder is None:
        flags = tuple(f for i, f in enumerate(HICACHE) if "storage" not in f and "storage" not in HICACHE[i - 1])
    else:
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(l3_folder)
    return Spec(model, flags + extra, env=env,
                kwargs={"max_total_tokens": HICACHE_DEVICE_TOKENS, "gpu_scheduling": gpu_scheduling})


def mooncake_spec(model, master_address: str, gpu_scheduling: bool, *extra: str,
                  segment_bytes: int = SEGMENT_BYTES) -> Spec:
    """A HiCache server with 1,200-token device pools whose L3 is the Mooncake store of the master at
    `master_address`, over TCP on loopback, contributing a segment of `segment_bytes` (test_mooncake_store.py)."""
    flags = server_flags(master_address, segment_bytes)
    return Spec(model, flags + ("--dtype", "float32", "--enable-cache-report", "--mem-fraction-static", "0.5") + extra,
                env=host_reserve_env(),
                kwargs={"max_total_tokens": HICACHE_DEVICE_TOKENS, "gpu_scheduling": gpu_scheduling})


def wait_for_keys(master, before: float, keys: int, timeout: float = 60.0) -> None:
    """`wait_for_pages` for the Mooncake store: until the master holds at least `keys` more objects and their
    number has stopped changing (a node's other pools' pages land beside its KV)."""
    deadline, last, since = time.monotonic() + timeout, None, time.monotonic()
    while True:
        now = master.metric("master_key_count")
        if now != last:
            last, since = now, time.monotonic()
        if now >= before + keys and time.monotonic() - since > 0.5:
            return
        assert time.monotonic() < deadline, f"{now - before:.0f} of {keys} keys written"
        time.sleep(0.1)


def wait_for_pages(folder: Path, before: int, pages: int, timeout: float = 60.0) -> None:
    """SGLang writes host pages to L3 from a background thread after the request: wait until `pages` more files
    are there (one per token page and pool at page size 1, plus the states)."""
    deadline = time.monotonic() + timeout
    while len(list(folder.iterdir())) < before + pages:
        assert time.monotonic() < deadline, f"{len(list(folder.iterdir())) - before} of {pages} pages written"
        time.sleep(0.1)


HOST_READS = ("tolist", "item", "__int__", "__index__")  # a tensor's values read on the host: a sync on a GPU


def count_tensor_calls(monkeypatch, names=HOST_READS) -> list[str]:
    """Record the name of every call of these `torch.Tensor` methods until `monkeypatch` is undone: the GPU path's
    contract tests count host reads (and copies) on the CPU route, where they cost nothing but still happen."""
    calls = []
    for name in names:
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=original, _n=name, **k: (calls.append(_n), _o(self, *a, **k))[1])
    return calls


def image(seed: int, px: int | tuple[int, int] = 128) -> Image.Image:
    """A random RGB image, `px` square or (height, width)."""
    h, w = (px, px) if isinstance(px, int) else px
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


def data_uri(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def with_images(*images) -> dict:
    """The /generate keywords that attach `images` (PIL) as data URIs, as a client sends them."""
    return {"image_data": [data_uri(i) for i in images]} if images else {}


def assert_greedy_agrees(model, ids, served, tie):
    """The served tokens are the reference model's greedy ones up to the first near-tie (its top two within `tie`
    nats, the served token one of them), where float rounding may pick either and the continuations part (seen on
    tiny-kimi-linear: a 1.6e-4-nat tie at the ninth token of a 300-token prompt)."""
    reference = greedy_generate(model, ids, len(served))
    for i, (a, b) in enumerate(zip(served, reference)):
        if a != b:
            logprobs = prompt_logprobs_at(model, ids + reference[:i])
            top = logprobs.topk(2)
            assert a in top.indices.tolist() and float(top.values[0] - top.values[1]) < tie, (i, a, b)
            return


def prompt_logprobs_at(model, ids):
    """The reference model's next-token log-probs after `ids`."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)


def assert_drafted_as_plain(plain, spec, ids, start, new) -> None:
    """A cold request under a NEXTN draft (`spec`): the draft runs (verify steps counted) and the outputs are the
    target's own, as the same target decodes them without a draft (`plain`), within the exactness bound."""
    for server in (plain, spec):
        flush_cache(server.base_url)
    reference, drafted = scored(plain, ids, start, new), scored(spec, ids, start, new)
    assert drafted["meta"]["spec_verify_ct"] > 0
    assert_exact(drafted, reference)


def paged_fork(server, base: list[int], cut: int, tail: list[int], new: int, page: int) -> dict:
    """`base` served, then a fork of it at `cut` continued by `tail`: the hit, checked to match whole `page`-token
    pages, labelled exact and equal to the server's own no-cache run."""
    flush_cache(server.base_url)
    scored(server, base, len(base) - 10, 2)
    ids = base[:cut] + tail
    hit = scored(server, ids, cut, new)
    assert hit["meta"]["cached_tokens"] == cut // page * page and hit["meta"]["tail_replay_exact"]
    assert_exact(hit, no_cache(server, ids, cut, new))
    return hit
