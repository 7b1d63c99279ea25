"""What the serving benchmarks in bench/ share (ttft, workloads, load, quality, survival, rollouts, router,
profile_load): several real SGLang servers up at once, prompts made of random token ids, what the server has seen
(for matchable tokens), timing summaries and the facts of the machine."""

import contextlib
import json
import os
import platform
import random
import shlex
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import requests

from tailreplay_eval.models import build_model
from tailreplay_eval.server import ServerProcess, flush_cache  # noqa: F401  (flush_cache: re-exported)
from tailreplay_sglang.layout import text_config_of

ROOT = Path(__file__).resolve().parents[1]

# CPU_FLAGS (tailreplay_eval/server.py) include --sleep-on-idle: an idle scheduler otherwise busy-polls a whole
# core (measured: 10 CPU-seconds in 10 s), which would slow down whichever of the servers is being measured.
# Token ids 0-2 are the chat special tokens (models.py); random prompts use the rest of the vocabulary.
FIRST_ID = 3

TTFT_METHOD = ("TTFT = wall time from sending a streaming /generate request (input_ids, greedy) to its first "
               "streamed chunk, measured by a client on the same machine")


def add_common_args(ap, out_name: str) -> None:
    """The options both benchmarks share: which model, which server flags, or which running servers."""
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model-path", help="serve this checkpoint instead of building --preset")
    # --mem-fraction-static 0.5: the servers start together and each sizes its KV pool from the memory left while
    # the others load; with the CPU default of 0.1 the last one got a 6.9K-token pool instead of 72K.
    ap.add_argument("--server-args", default="--dtype float32 --mem-fraction-static 0.5",
                    help="flags for every server (float32: these CPUs have no fast bf16 matmul)")
    ap.add_argument("--gpu-scheduling", action="store_true",
                    help="start the servers with SGLang's GPU default scheduling (no strategy flag: extra_buffer with "
                         "the overlap scheduler) instead of no_buffer")
    ap.add_argument("--url", action="append", default=[],
                    help="[LABEL=]URL of a running server (repeatable); then no server is started")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "runs" / out_name))


@dataclass
class Run:
    """What a benchmark run starts from: output path, clock, the machine's state, the servers' flags or URLs,
    and the model (--model-path, else what the first --url server serves, else --preset, built under models/)."""

    out: Path
    started: float
    machine_before: dict
    server_args: list[str]
    urls: dict[str, dict]
    model_path: Path

    @classmethod
    def begin(cls, args) -> "Run":
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        started, before = time.perf_counter(), machine()
        urls = parse_urls(args.url)
        if args.model_path:
            model = Path(args.model_path)
        elif urls:
            model = Path(server_model_path(next(iter(urls.values()))["url"]))
        else:
            model = build_model(args.preset, ROOT / "models" / args.preset)
        return cls(out, started, before, shlex.split(args.server_args), urls, model)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


@contextlib.contextmanager
def running_servers(model_path: Path, configs: dict[str, tuple], log_stem: Path, console,
                    envs: dict[str, dict] | None = None, **server_kwargs):
    """Start one server per config at once, wait until all are healthy, and stop all (by PID) however we leave.

    Start-up is mostly process spawning and imports (docs/cpu.md), so starting them together saves minutes; only
    one request (or one burst) is in flight afterwards, so the servers do not share the CPU while measured.
    """
    servers: dict[str, ServerProcess] = {}
    t0 = time.perf_counter()
    # SIGTERM (`timeout`, `kill`) would end Python without running `finally`, orphaning the servers: exit instead.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    common_env = server_kwargs.pop("env", {})  # every server's; `envs` adds each one's own (core pinning)
    try:
        for i, (label, flags) in enumerate(configs.items()):
            log = log_stem.with_suffix(f".server{i}.log")
            env = {**common_env, **(envs or {}).get(label, {})}
            servers[label] = ServerProcess(str(model_path), tuple(flags), log_path=log, env=env, **server_kwargs)
            servers[label].start()
        for label, server in servers.items():
            server.wait_healthy(timeout=900)
            console.print(f"  {label}: healthy after {time.perf_counter() - t0:.0f} s on {server.base_url} "
                          f"(log: {server.log_path})")
        yield servers
    finally:
        for server in servers.values():
            server.stop()
        signal.signal(signal.SIGTERM, previous)


def vocab_size(model_path: Path) -> int:
    raw = json.loads((Path(model_path) / "config.json").read_text())
    return text_config_of(raw)["vocab_size"]


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


class DistinctHeads:
    """Hands out first tokens never handed out before, so a new sequence shares no token with any earlier one at
    its start (a random prefix could otherwise match another prompt's first token or two by chance)."""

    def __init__(self, rng: random.Random, vocab: int):
        self._ids = list(range(FIRST_ID, vocab))
        rng.shuffle(self._ids)

    def next(self) -> int:
        if not self._ids:
            raise RuntimeError("ran out of distinct first tokens; use fewer sequences or a larger vocabulary")
        return self._ids.pop()

    def sequence(self, rng: random.Random, n: int, vocab: int) -> list[int]:
        return [self.next(), *random_ids(rng, n - 1, vocab)]


class Seen:
    """Token sequences a server has computed KV for, in order: each finished request's prompt plus its generated
    tokens but the last (which is never fed back, so has no KV). `matchable(ids)` is the longest common prefix with
    any of them, capped at len(ids) - 1 as SGLang caps a match (one token must be computed to get logits)."""

    def __init__(self):
        self._seqs: list[np.ndarray] = []
        self._lock = threading.Lock()

    def matchable(self, ids: list[int]) -> int:
        a = np.asarray(ids)
        best = 0
        with self._lock:
            seqs = list(self._seqs)
        for s in seqs:
            n = min(len(s), len(a))
            if n <= best:
                continue
            diff = np.flatnonzero(s[:n] != a[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        return min(best, len(ids) - 1)

    def add(self, ids: list[int], output_ids: list[int]) -> None:
        with self._lock:
            self._seqs.append(np.asarray(list(ids) + list(output_ids[:-1])))


def stats(values: list[float]) -> dict:
    return {"n": len(values), "mean": statistics.fmean(values), "p50": statistics.median(values),
            "min": min(values), "max": max(values)}


def machine() -> dict:
    """What the numbers were measured on; load averages show whether something else was running."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu, "cores": os.cpu_count(),
            "loadavg": os.getloadavg(), "platform": platform.platform()}


def server_model_path(base_url: str) -> str:
    return requests.get(f"{base_url}/model_info", timeout=30).json()["model_path"]


def server_info(base_url: str) -> dict:
    return requests.get(f"{base_url}/server_info", timeout=30).json()


def is_tail_replay(base_url: str) -> bool:
    return server_info(base_url).get("radix_cache_backend") == "tail_replay"


def kv_pool_tokens(base_url: str) -> int | None:
    """The KV pool the server really got: SGLang silently shrinks --max-total-tokens to what memory allows."""
    return server_info(base_url).get("max_total_num_tokens")


def parse_urls(urls: list[str]) -> dict[str, dict]:
    """`[LABEL=]URL` specs of running servers -> {label: {"url", "tail_replay", "flags": None (not known)}}."""
    servers = {}
    for i, spec in enumerate(urls):
        label, url = spec.rsplit("=", 1) if "=" in spec and not spec.startswith("http") else (f"server{i}", spec)
        url = url.rstrip("/")
        servers[label] = {"url": url, "tail_replay": is_tail_replay(url), "flags": None}
    return servers
