"""The GPU subset in one run, for whoever has a CUDA GPU (scripts/gpu_check.sh; under 10 minutes on one H100/H200):

1. `kernels`: natively on CUDA, no SGLang needed: tests/test_kernels.py (the Triton replay kernels against float64
   references, in float32 and bfloat16, and fla's chunk kernel on the replay's path), and the CUDA paths of the
   hidden store's tiers and transfers (tests/test_hidden_tier.py), of the host anchors' copies
   (tests/test_host_anchor_copies.py), the host tier's staging under a real CUDA graph (tests/test_graph_staging.py),
   and SGLang's lightning kernel `seg_la` against the torch scan where its file is
   carried (tests/test_kernels.py); the counts come from its junit report.
2. `kernel_bench`: bench/kernel_bench.py on CUDA: the replay kernel (and the dispatched replay) against fla's chunk
   kernel, by tails and tokens (the GPU note's table).
3. `serving` (needs sglang==0.5.23 with CUDA): stock SGLang and `--enable-tail-replay` side by side under SGLang's
   GPU defaults (extra_buffer with the overlap scheduler, CUDA graphs, its attention and linear-attention backends)
   on a bfloat16 model. Per prompt: a fork at an off-grid point and a resend, each hit's log-probs against the same
   server's no-cache run (`exactness.exact_errors`). Stock's own hits on the same prompts (on its track grid) give
   the bound: a Tail-Replay hit reported exact passes if it is as close as stock's own hit (its error at most
   max(stock's, EXACT_TOL)); bfloat16 anchors (docs/tail-replay.md, "What exact means") show up here.
4. `ttft`: bench/ttft_gpu.py (no SGLang) at 16K-128K, the paper's Table 2 layout, written row by row.

    python -m tailreplay_eval.gpu_check [--model DIR] [--out runs/gpu_check.json] [--skip PART ...]

Writes one JSON, after every part (a run cut short keeps the parts it finished; each part's own files lie beside
it), and prints a summary; exits 1 if any part that ran failed. A part that cannot run here (no CUDA, no SGLang) is
reported as skipped with the reason. `--device cpu` runs the serving part on the CPU route instead (how this script
itself is checked without a GPU).
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import random
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import torch

from tailreplay_eval.exactness import EXACT_TOL, exact_errors, no_cache, scored
from tailreplay_eval.server import ServerProcess, flush_cache

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("kernels", "kernel_bench", "serving", "ttft")
CUDA_TESTS = ("tests/test_kernels.py", "tests/test_hidden_tier.py", "tests/test_host_anchor_copies.py",
              "tests/test_graph_staging.py")
TTFT_LENGTHS = (16384, 32768, 65536, 131072)


def run_kernels(out_dir: Path) -> dict:
    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA device"}
    junit = out_dir / "kernels.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", *CUDA_TESTS, f"--junitxml={junit}",
                           "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=200)
    suite = ElementTree.parse(junit).getroot().find("testsuite") if junit.exists() else None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} if suite is not None else {}
    ok = done.returncode == 0 and counts.get("tests", 0) > counts.get("skipped", 0)
    return {"status": "passed" if ok else "failed", **counts, "tail": done.stdout[-2000:]}


def run_kernel_bench(out_dir: Path) -> dict:
    return _bench(out_dir / "kernels.json", ["bench/kernel_bench.py", "--device", "cuda"], timeout=150)


def run_ttft(out_dir: Path) -> dict:
    lengths = [str(n) for n in TTFT_LENGTHS]
    return _bench(out_dir / "ttft_gpu.json", ["bench/ttft_gpu.py", "--device", "cuda", "--lengths", *lengths,
                                              "--reps", "3", "--warmup", "1"], timeout=240)


def _bench(out: Path, command: list[str], timeout: int) -> dict:
    """A benchmark script on CUDA, writing `out`; what it wrote is kept if it runs out of time."""
    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA device"}
    try:
        done = subprocess.run([sys.executable, *command, "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
        status, tail = ("passed" if done.returncode == 0 else "failed"), done.stdout[-3000:] + done.stderr[-2000:]
    except subprocess.TimeoutExpired as e:  # its output comes back as bytes, text=True or not
        output = e.stdout or b""
        status, tail = f"timed out after {timeout} s", (output.decode(errors="replace") if isinstance(
            output, bytes) else output)[-3000:]
    result = json.loads(out.read_text()) if out.exists() else None
    return {"status": status, "result": result, "tail": tail}


def probe(server, prompts, fork_at, new_tokens: int = 8) -> list[dict]:
    """Per prompt: the prompt served once (kept), then a fork at `fork_at(prompt)` with new tokens and a resend of the
    prompt; each hit against the server's own no-cache run of the same request."""
    rows = []
    for i, prompt in enumerate(prompts):
        fork = prompt[:fork_at(prompt)] + [(7 * i + j) % 200 + 3 for j in range(16)]
        for kind, ids in (("fork", fork), ("resend", prompt + [5])):
            flush_cache(server.base_url)
            scored(server, prompt, len(prompt) - 1, 1)  # cache the prompt
            start = len(ids) - 16
            hit = scored(server, ids, start, new_tokens)
            reference = no_cache(server, ids, start, new_tokens)
            worst, mean = exact_errors(hit, reference)
            meta = hit["meta"]
            rows.append({"kind": kind, "prompt": i, "cached": meta["cached_tokens"], "max": worst, "mean": mean,
                         "exact": meta.get("tail_replay_exact"), "replayed": meta.get("tail_replay_tokens")})
    return rows


def run_serving(model: Path, device: str, out_dir: Path) -> dict:
    if importlib.util.find_spec("sglang") is None:
        return {"status": "skipped", "reason": "sglang is not installed"}
    if device == "cuda" and not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA device"}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(900, 2000))] for _ in range(4)]
    results = {}
    for name, flags in (("stock", ()), ("tail_replay", ("--enable-tail-replay",))):
        server = ServerProcess(str(model), extra_args=("--enable-cache-report", *flags),
                               log_path=out_dir / f"{name}.log", on_gpu=device == "cuda", gpu_scheduling=True,
                               max_total_tokens=32768, context_length=8192)
        try:
            server.start().wait_healthy(300)
            results[name] = probe(server, prompts, fork_at=lambda p: len(p) // 2 + 37)  # off the 64-token grid
        finally:
            server.stop()
    failures = []
    for stock, ours in zip(results["stock"], results["tail_replay"]):
        if ours["exact"] and ours["cached"] and ours["max"] > max(stock["max"], EXACT_TOL):
            failures.append(f"{ours['kind']} of prompt {ours['prompt']}: {ours['max']:.4g} nats against stock's "
                            f"{stock['max']:.4g}")
    reused = [(s["cached"], t["cached"]) for s, t in zip(results["stock"], results["tail_replay"])]
    return {"status": "failed" if failures else "passed", "failures": failures, "cached_stock_vs_tail_replay": reused,
            **results}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint (default: the `small` preset in bfloat16, built here)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the serving part runs")
    parser.add_argument("--skip", nargs="*", choices=PARTS, default=[])
    args = parser.parse_args(argv)
    out_dir = args.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None and "serving" not in args.skip and importlib.util.find_spec("sglang") is not None:
        from tailreplay_eval.models import build_model

        model = build_model("small", out_dir / "models" / "small", dtype="bfloat16")
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.node(),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "torch": torch.__version__, "command": " ".join(sys.argv)}
    runners = {"kernels": lambda: run_kernels(out_dir), "kernel_bench": lambda: run_kernel_bench(out_dir),
               "serving": lambda: run_serving(model, args.device, out_dir), "ttft": lambda: run_ttft(out_dir)}
    for part in PARTS:
        report[part] = {"status": "skipped", "reason": "--skip"} if part in args.skip else runners[part]()
        print(f"{part}: {report[part]['status']} {report[part].get('reason', '')}", flush=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 1 if any(report[p]["status"] not in ("passed", "skipped") for p in PARTS) else 0


if __name__ == "__main__":
    sys.exit(main())
