"""Start and stop a real `python -m sglang.launch_server` process (tests, benchmarks, the main job).

The server runs in its own session so that stopping it kills the whole process group it spawned (tokenizer
manager, scheduler, detokenizer) by PID, even when the caller fails half-way.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from tailreplay_eval.preforked import ForkedProcess, Preforker  # noqa: F401 (annotations)
from tailreplay_sglang.layout import text_config_of

# What serves a hybrid GDN model on a CPU without sgl-kernel's CPU build (docs/cpu.md explains each flag).
BASE_FLAGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--mem-fraction-static", "0.1",
    "--max-mamba-cache-size", "64",
    # An idle scheduler busy-polls its sockets and keeps a whole core busy; with this it blocks in zmq poll and a
    # new request wakes it at once. On two cores an idle test or benchmark server would slow down everything else.
    "--sleep-on-idle",
)
# What every server here runs unless it asks for SGLang's GPU default (`ServerProcess(gpu_scheduling=True)`: no
# strategy flag, so SGLang resolves `auto` to extra_buffer with the overlap scheduler, as on a GPU; docs/cpu.md).
NO_BUFFER_FLAGS = ("--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule")
CPU_FLAGS = BASE_FLAGS + NO_BUFFER_FLAGS


def _text_config(model_path) -> dict:
    config_file = Path(model_path) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return text_config_of(config)


def cpu_serving_dtype(model_path) -> str:
    """The dtype the CPU route serves a checkpoint in: float32 (these CPUs have no fast bfloat16 matmul, and SGLang's
    `--dtype auto` would serve a float32 build in float16), except where SGLang builds parts of the model in bfloat16
    whatever the dtype: the hyper-connection weights (`hc_count`, Qwen3.8-Flash-Next), which fail in float32."""
    return "bfloat16" if _text_config(model_path).get("hc_count", 1) > 1 else "float32"


def ships_remote_code(model_path) -> bool:
    """Whether the checkpoint's processor is its own code (`auto_map` in processor_config.json, as Kimi K3's:
    `tailreplay_eval.kimi_k3_vl`), which SGLang loads only under --trust-remote-code."""
    config_file = Path(model_path) / "processor_config.json"
    return config_file.is_file() and "auto_map" in json.loads(config_file.read_text())


def pages_required(model_path) -> bool:
    """Whether SGLang forces pages larger than one token on this checkpoint, which only its GPU default (extra_buffer)
    allows: Qwen3.8-Flash-Next's QSA indexer (64-token pages, `arg_groups/model_overrides/qwen4_exp.py`) and
    GLM-5.3-Flash's DSA one (64 x index_kpool tokens, `arg_groups/model_overrides/deepseek_v2.py`)."""
    text = _text_config(model_path)
    return text.get("indexer_compress_ratio") is not None or text.get("index_topk") is not None
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
# On a GPU (`ServerProcess(on_gpu=True)`, scripts/gpu_check.sh): SGLang's own defaults, two servers side by side.
GPU_FLAGS = ("--skip-server-warmup", "--mem-fraction-static", "0.35")


def flags_to_keywords(flags: tuple[str, ...]) -> dict:
    """`("--device", "cpu", "--disable-cuda-graph", ...)` -> `{"device": "cpu", "disable_cuda_graph": True, ...}`:
    the same server flags as `sglang.Engine` keywords (numbers as numbers)."""
    keywords, i = {}, 0
    while i < len(flags):
        name = flags[i].removeprefix("--").replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            keywords[name], i = _number_or_text(flags[i + 1]), i + 2
        else:
            keywords[name], i = True, i + 1
    return keywords


def _number_or_text(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


CPU_KEYWORDS = flags_to_keywords(CPU_FLAGS)  # for sglang.Engine / sgl.Runtime


_HANDED_OUT: set[int] = set()
# Where free_port draws. Below both the kernel's ephemeral range (32768+: any concurrently starting process may take
# such a port for an outgoing connection before our server binds it) and SGLang's own pick for internal ports
# (22000-29999, `get_free_port_below_ephemeral`). Parallel test workers each narrow it to a slice of their own.
PORT_RANGE = (12000, 21999)


def free_port() -> int:
    """A free port in PORT_RANGE for a server or router to bind later; never the same twice in a process, so
    servers started together do not collide."""
    low, high = PORT_RANGE
    for port in random.sample(range(low, high + 1), 200):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in [{low}, {high}]")


@dataclass
class ServerProcess:
    """A launched server. `base_url` answers once `wait_healthy` returns."""

    model_path: str
    extra_args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    max_total_tokens: int | None = 4096
    context_length: int | None = None
    max_running_requests: int = 8
    env: dict[str, str] = field(default_factory=dict)
    # SGLang's GPU default (extra_buffer + overlap scheduler) instead of no_buffer; taken anyway where the checkpoint
    # needs pages (`pages_required`)
    gpu_scheduling: bool = False
    on_gpu: bool = False  # a CUDA server with SGLang's defaults (GPU_FLAGS) instead of the CPU route
    # forked from a process that imported SGLang already (preforked.py; default: `Preforker.default`, which the
    # tests set) instead of a new interpreter; `spawn` always starts a new one, as `launch_server` runs for a user
    preforker: "Preforker | None" = None
    spawn: bool = False
    proc: "subprocess.Popen | ForkedProcess | None" = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model_path),
               "--host", "127.0.0.1", "--port", str(self.port),
               *(GPU_FLAGS if self.on_gpu else BASE_FLAGS if self.gpu_scheduling or pages_required(self.model_path)
                 else CPU_FLAGS),
               "--max-running-requests", str(self.max_running_requests)]
        if self.max_total_tokens is not None:  # None: SGLang sizes the pool from --mem-fraction-static
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.context_length:
            cmd += ["--context-length", str(self.context_length)]
        return cmd + list(self.extra_args)

    def start(self) -> "ServerProcess":
        env = {**os.environ, **({} if self.on_gpu else CPU_ENV), **self.env}
        preforker = None if self.spawn or self.on_gpu else self.preforker or Preforker.default
        if preforker is not None:
            self.proc = preforker.launch(self.command()[3:], env, self.log_path)  # argv after `-m module`
            return self
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command(), env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = 300.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} during start-up"
                                   f"{self._log_tail()}")
            try:
                if self._ready():
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout:.0f} s{self._log_tail()}")

    def _ready(self) -> bool:
        return requests.get(f"{self.base_url}/health", timeout=5).status_code == 200

    def stop(self, grace: float = 0.0) -> None:
        """SIGKILL the server's process group (with `grace` > 0: SIGTERM first, SIGKILL what is left after `grace`
        seconds). The servers started here hold nothing worth a graceful exit: SGLang's own takes about 7 s (once
        SIGTERM has ended its scheduler, the launcher sleeps 5 s for crash diagnostics) where SIGKILL takes about
        1 s, and on two cores the tests and benchmarks start and stop dozens of them."""
        if self.proc is None or self.proc.poll() is not None and not _group_alive(self.proc.pid):
            return
        steps = [(signal.SIGTERM, grace)] if grace > 0 else []
        for sig, wait in steps + [(signal.SIGKILL, 10.0)]:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.proc.pid):
                self.proc.poll()
                time.sleep(0.05)
            if not _group_alive(self.proc.pid):
                return

    def _log_tail(self, chars: int = 4000) -> str:
        """The log's error lines (a multi-process start-up interleaves them anywhere) and its tail."""
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        text = Path(self.log_path).read_text(errors="replace")
        errors = [line for line in text.splitlines()
                  if ("Error" in line or "Traceback" in line or "exception" in line) and "Ignore import" not in line]
        return ("\n--- server log, error lines ---\n" + "\n".join(errors[:30]) +
                "\n--- server log tail ---\n" + text[-chars:])

    def __enter__(self):
        return self.start().wait_healthy()

    def __exit__(self, *exc):
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def flush_cache(base_url: str, timeout: float = 30.0) -> None:
    """POST /flush_cache, retried while the server is busy.

    SGLang refuses a flush (HTTP 400) while any request is in its running batch, and a finished request leaves that
    batch only on the scheduler's next step, after its response went out: a client that flushes right after its
    last answer can land in that window.
    """
    deadline = time.monotonic() + timeout
    while True:
        r = requests.post(f"{base_url}/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url}/flush_cache still refused after {timeout:.0f} s: {r.status_code} {r.text}")
        time.sleep(0.1)


@dataclass
class RouterProcess(ServerProcess):
    """`python -m sglang_router.launch_router` (sglang-router, pinned in requirements/) in front of running workers.
    Started, health-checked and stopped like a server."""

    model_path: str = ""
    worker_urls: tuple[str, ...] = ()
    policy: str = "cache_aware"
    spawn: bool = True  # not an SGLang server: never forked from the preforker

    prometheus_port: int = field(default_factory=free_port)  # the router's default (29000) would clash between two

    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
                "--worker-urls", *self.worker_urls, "--policy", self.policy, *self.extra_args]

    def _ready(self) -> bool:
        # /health answers before the workers are registered (a request then gets 503): wait until all are healthy
        r = requests.get(f"{self.base_url}/readiness", timeout=5)
        return r.status_code == 200 and r.json().get("healthy_workers") == len(self.worker_urls)


# ---- PD disaggregation (docs/tail-replay.md, "PD disaggregation") ----
# Mooncake's transfer engine over TCP (the wheel mooncake-transfer-engine-non-cuda, setup_cpu.sh) on loopback: the
# KV manager and the engine advertise SGLANG_HOST_IP, which would otherwise be the machine's first interface.
PD_ENV = {"SGLANG_HOST_IP": "127.0.0.1"}
PD_TRANSFER = ("--disaggregation-transfer-backend", "mooncake_tcp")


def pd_prefill_args(bootstrap_port: int) -> tuple[str, ...]:
    """A PD prefill server's flags: its bootstrap server (where decode servers learn its transfer addresses)."""
    return ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port), *PD_TRANSFER)


def pd_decode_args(radix_cache: bool = False) -> tuple[str, ...]:
    return ("--disaggregation-mode", "decode", *PD_TRANSFER,
            *(("--disaggregation-decode-enable-radix-cache",) if radix_cache else ()))


@dataclass
class PDRouterProcess(ServerProcess):
    """`smg.launch_router --pd-disaggregation` in front of running prefill and decode servers.

    smg (Shepherd Model Gateway) is sglang-router under its new name. The last sglang-router (0.3.2) never seeds the
    trees of its PD `cache_aware` policies (worker registration initialises only the per-model policy), so it logs
    "No tree found for model ..., using random worker selection" and places every prefill at random; smg 1.13.0
    seeds them (smg-project/smg#1520). Its cache_aware placement routes on the request's text: requests that carry
    only input_ids are load-balanced."""

    model_path: str = ""
    spawn: bool = True  # not an SGLang server: never forked from the preforker
    prefills: tuple[tuple[str, int], ...] = ()  # (url, bootstrap port)
    decodes: tuple[str, ...] = ()
    prefill_policy: str = "cache_aware"
    decode_policy: str = "round_robin"
    prometheus_port: int = field(default_factory=free_port)

    def command(self) -> list[str]:
        prefill = [arg for url, port in self.prefills for arg in ("--prefill", url, str(port))]
        decode = [arg for url in self.decodes for arg in ("--decode", url)]
        return [sys.executable, "-m", "smg.launch_router", "--pd-disaggregation", *prefill, *decode,
                "--prefill-policy", self.prefill_policy, "--decode-policy", self.decode_policy,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port), *self.extra_args]

    def _ready(self) -> bool:
        r = requests.get(f"{self.base_url}/readiness", timeout=5)
        return r.status_code == 200 and r.json().get("healthy_workers") == len(self.prefills) + len(self.decodes)
