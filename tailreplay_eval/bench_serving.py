"""One run of SGLang's own `python -m sglang.bench_serving` against a running server, from a flushed cache, with the
server's eviction and replay counters over the run (bench/load.py, bench/profile_load.py).

The workloads are bench_serving datasets with fixed seeds; `args` carries their shape (`groups`,
`prompts_per_group`, `system_len`, `question_len`, `output_len`, `seed`):
- shared prefix: `generated-shared-prefix`, `groups` system prompts of `system_len` tokens, each followed by
  `prompts_per_group` questions of `question_len` tokens;
- multi-turn: the same generator with 3 turns per conversation (backend `sglang-oai-chat`), half as many;
- no reuse: `random-ids`, prompts as long as the shared-prefix ones and nothing shared.
"""

import json
import subprocess
import sys
from pathlib import Path

import requests

WORKLOADS = ("shared prefix", "multi-turn", "no reuse")
COUNTERS = {"evicted": "sglang:evicted_tokens_total", "replayed": "sglang:tail_replay_tokens_total"}


def dataset_args(workload: str, args) -> list[str]:
    if workload == "no reuse":
        n = args.groups * args.prompts_per_group
        return ["--backend", "sglang", "--dataset-name", "random-ids", "--num-prompts", str(n),
                "--random-input-len", str(args.system_len + args.question_len), "--random-output-len",
                str(args.output_len), "--random-range-ratio", "1"]
    turns = 3 if workload == "multi-turn" else 1
    per_group = args.prompts_per_group if turns == 1 else max(1, args.prompts_per_group // 2)
    return ["--backend", "sglang" if turns == 1 else "sglang-oai-chat", "--dataset-name", "generated-shared-prefix",
            "--gsp-num-groups", str(args.groups), "--gsp-prompts-per-group", str(per_group),
            "--gsp-system-prompt-len", str(args.system_len), "--gsp-question-len", str(args.question_len),
            "--gsp-output-len", str(args.output_len), "--gsp-num-turns", str(turns),
            "--num-prompts", str(args.groups * per_group)]


def counters(base_url: str) -> dict[str, float]:
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for key, name in COUNTERS.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals


def run(server, model_path: Path, workload: str, rate: float, args, out: Path) -> dict:
    """One bench_serving run from a flushed cache (after one warm-up request, so that a fresh server's first forward
    is not timed); its JSON record plus the server's counters over the run."""
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--base-url", server.base_url, "--model", str(model_path),
           "--tokenizer", str(model_path), *dataset_args(workload, args), "--request-rate", str(rate),
           "--seed", str(args.seed), "--warmup-requests", "1", "--flush-cache", "--cache-report", "--output-file",
           str(out), "--output-details", "--disable-tqdm"]
    before = counters(server.base_url)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench_serving failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    after = counters(server.base_url)
    record = json.loads(out.read_text().splitlines()[-1])
    record["server_counters"] = {k: after[k] - before[k] for k in COUNTERS}
    return record


def summary(record: dict) -> dict:
    cache = record.get("cache_report") or {}
    errors = [e for e in record.get("errors", []) if e]
    return {"completed": record["completed"], "failed": len(errors), "duration_s": record["duration"],
            "requests_per_s": record["request_throughput"], "input_tokens_per_s": record["input_throughput"],
            "output_tokens_per_s": record["output_throughput"],
            "ttft_p50_s": record["median_ttft_ms"] / 1e3, "ttft_p99_s": record["p99_ttft_ms"] / 1e3,
            "prompt_tokens": cache.get("total_prompt_tokens"), "cached_tokens": cache.get("total_cached_tokens"),
            "evicted_tokens": record["server_counters"]["evicted"],
            "replayed_tokens": record["server_counters"]["replayed"]}
